"""The run page at N ranks in issue 14's scenario, this tree beside an earlier commit, in real Chromium.

Each side starts a collector (the earlier commit's ``server/src`` first on its ``PYTHONPATH``, so its
status page too) and drives ``ampwatch_support.staged_job``: N ranks x 2 optimizers, collapse on
40-43, 1 skip in 8 on 777, a poisoned step on 512, scheduler-after-skip on 900, rank 1000 killed,
16 ticks of 20 iterations sent back to back, then a tick every 2 s (the agent's interval) while
measuring. ``--silent-after 10`` so the killed rank is silent within the bench. Two phases, measured
alike: *trouble* (once rank 1000 is silent) and *storm* (every rank skipping every step, from two
ticks after the storm began):

- the run view's endpoints (median ms of 7 GETs a second apart, bytes): the summary (built once per
  change on the after side), the scale spread (after side only), the full run (what the page read
  every refresh before); measured again once the job stopped sending (*quiet*: 20 GETs 0.25 s apart;
  the summary's cache holds there, so its fastest answer is what one more reader costs, while the
  slower ones waited for the built-in alert pass on the event loop);
- the status page in headless Chromium (``ampwatch_support.headless_browser``): *first paint* is the
  time from navigation start (the Performance API's time origin, so not the browser's launch) to the
  first ranks-in-trouble row in the DOM, with its parts (the HTML answered, the script answered and
  run, the summary asked for and answered); *bytes per refresh* is every ``/v1/`` answer's body during
  ``--watch`` seconds divided by the refreshes completed meanwhile, by endpoint too.

    python -m bench.experiments.run_page [--ranks 1024] [--before a95d20e] [--out FILE]

About 9 minutes on a shared 2-core machine (each side: 16 back-to-back ticks, then two live phases
of about a minute and a quiet one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from bench import _servers
from bench._before_after import before_after, print_and_store
from bench.experiments._job1024 import add_comparison_options

__all__ = ["main"]

KEY = "run_page"
RUN = "job-1024"
SILENT_AFTER_S = 10

# Set on the page before its scripts run: when the first ranks-in-trouble row lands, and how many refreshes ended.
_PROBE = """
window.__refreshes = 0;
new MutationObserver(() => {
  if (window.__firstRows === undefined && document.querySelector('#trouble tr.trouble'))
    window.__firstRows = performance.now();
}).observe(document, {childList: true, subtree: true});
document.addEventListener('DOMContentLoaded', () => new MutationObserver(() => window.__refreshes++)
  .observe(document.getElementById('refreshed'), {childList: true, characterData: true, subtree: true}));
"""


# Where the first paint's time went, in ms from navigation start: the page's HTML answered, its script answered,
# its scripts run (DOMContentLoaded), the first summary asked for and answered (the Resource Timing API).
_PARTS = """(() => {
  const nav = performance.getEntriesByType('navigation')[0];
  const resources = performance.getEntriesByType('resource');
  const summary = resources.find(e => e.name.includes('/summary'));
  const script = resources.find(e => e.name.endsWith('/app.js'));
  const ms = v => v === undefined ? null : Math.round(v);
  return {html_answered: ms(nav.responseEnd), script_answered: ms(script && script.responseEnd),
          scripts_run: ms(nav.domContentLoadedEventEnd),
          summary_asked: ms(summary && summary.startTime), summary_answered: ms(summary && summary.responseEnd)};
})()"""


def _get(url: str, times: int = 7, gap_s: float = 1.0) -> dict | None:
    """Median ms and bytes of ``times`` GETs ``gap_s`` apart (the first one's ms too); None where it is a 404."""
    spent, size = [], 0
    for i in range(times):
        t = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=120) as answer:
                size = len(answer.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        spent.append((time.perf_counter() - t) * 1000)
        if i + 1 < times:
            time.sleep(gap_s)
    return {"median_ms": round(statistics.median(spent), 1), "first_ms": round(spent[0], 1),
            "min_ms": round(min(spent), 1), "bytes": size}


def _endpoints(url: str, run: str, times: int = 7, gap_s: float = 1.0) -> dict:
    quoted = urllib.parse.quote(run, safe="")
    paths = {"summary": f"/v1/runs/{quoted}/summary?limit=50", "scale": f"/v1/runs/{quoted}/scale?window=1000",
             "run": f"/v1/runs/{quoted}"}
    return {name: dict(_get(url + path, times, gap_s) or {"missing": True}, path=path)
            for name, path in paths.items()}


def _page(url: str, run: str, watch_s: float) -> dict:
    """Open the run view in Chromium; first paint (ms from navigation start) and API bytes per refresh."""
    from ampwatch_support.headless_browser import open_page, wait_until

    received: list[tuple[float, str, int]] = []
    with open_page("about:blank") as (page, problems):
        page.add_init_script(_PROBE)
        def answered(response) -> None:
            if "/v1/" in response.url:
                try:
                    received.append((time.perf_counter(), urllib.parse.urlsplit(response.url).path,
                                     len(response.body())))
                except Exception:  # the page closed before this answer's body was read: the watch is over
                    pass

        page.on("response", answered)
        page.goto(f"{url}/#run={urllib.parse.quote(run)}")
        painted = wait_until(page, "window.__firstRows !== undefined", 60)
        first_paint = round(page.evaluate("window.__firstRows")) if painted else None  # never: a result too
        parts = page.evaluate(_PARTS) if painted else None
        wait_until(page, "window.__refreshes >= 1", 120)
        mark, done = time.perf_counter(), page.evaluate("window.__refreshes")
        page.wait_for_timeout(watch_s * 1000)
        refreshes = page.evaluate("window.__refreshes") - done
        window = [(path, size) for t, path, size in received if t >= mark]
    by_path: dict[str, int] = {}
    for path, size in window:
        key = path.replace(urllib.parse.quote(run), "{run}").replace(run, "{run}")
        by_path[key] = by_path.get(key, 0) + size
    per = max(1, refreshes)
    return {"first_paint_ms": first_paint, "first_paint_parts": parts, "refreshes": refreshes, "watch_s": watch_s,
            "refresh_bytes": round(sum(size for _, size in window) / per) if refreshes else None,
            "by_endpoint": {k: round(v / per) for k, v in sorted(by_path.items(), key=lambda kv: -kv[1])},
            "console_problems": problems[:5]}


def _side(ranks: int, watch_s: float, path: str | None) -> dict:
    from ampwatch_support.staged_job import KILLED, StagedJob

    env = {"PYTHONPATH": path} if path else None
    result: dict = {"ranks": ranks}
    with _servers.collector(("--silent-after", str(SILENT_AFTER_S)), env=env) as srv:
        job = StagedJob(srv.url, run=RUN, ranks=ranks)
        t = time.perf_counter()
        job.run_ticks(16)
        result["fill_s"] = round(time.perf_counter() - t, 1)
        stop = threading.Event()
        live = threading.Thread(target=job.run_live, args=(stop,), daemon=True)
        live.start()
        try:
            time.sleep(SILENT_AFTER_S + 2)  # rank 1000 (killed after tick 8) is silent by now
            phases = {}
            for phase in ("trouble", "storm"):
                if phase == "storm":
                    job.storm()
                    time.sleep(5)  # two ticks into the storm
                cpu0, t0 = srv.stats.cpu_s(), time.perf_counter()
                phases[phase] = {"endpoints": _endpoints(srv.url, RUN), "page": _page(srv.url, RUN, watch_s),
                                 "tick": job.tick}
                phases[phase]["collector_cpu_pct"] = round(100 * (srv.stats.cpu_s() - cpu0)
                                                           / (time.perf_counter() - t0), 1)
                print(f"{path or 'this tree'} {phase}: {phases[phase]}", file=sys.stderr)
        finally:
            stop.set()
            live.join(120)
        # Nothing arrives any more: what one more reader (a tab, a script) costs once the run stops changing.
        time.sleep(SILENT_AFTER_S + 2)  # every rank silent: no change left to come
        result["quiet"] = {"endpoints": _endpoints(srv.url, RUN, times=20, gap_s=0.25)}
        result.update(phases, killed_rank=KILLED, silent_after_s=SILENT_AFTER_S)
    return result


def _lines(side: str, r: dict) -> str:
    return "\n".join(f"{side} {phase}: first paint {r[phase]['page']['first_paint_ms']} ms, "
                     f"{r[phase]['page']['refresh_bytes']} bytes per refresh, "
                     f"summary {r[phase]['endpoints']['summary']}" for phase in ("trouble", "storm"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--watch", type=float, default=15.0, help="seconds of refreshes counted per phase")
    add_comparison_options(parser, KEY, before="a95d20e")
    args = parser.parse_args(argv)
    result = dict(before_after(args.before, lambda path: _side(args.ranks, args.watch, path)), ranks=args.ranks)
    return print_and_store(result, KEY, args.out, _lines)


if __name__ == "__main__":
    main()
