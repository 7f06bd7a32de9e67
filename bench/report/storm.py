"""Section 7's lockstep storm (``bench.experiments.storm``): issue 26's targets at 1,024 ranks, this tree beside an
earlier commit.

Rendered from the ``lockstep_storm`` result in ``bench/experiments/results/job1024_before_after.json``: the targets
with both sides' figures, then each side's phases (ingest latency, ``/metrics`` plain and gzipped, CPU), then memory,
news delivery and storage. The caption gives the command, date and load: on a shared 2-core machine the
absolute figures are the machine's as much as the collector's, the ratios between the sides are not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.report._format import fmt, measured_by, side_rows

__all__ = ["section", "target_rows"]

PHASES = ("healthy", "storm", "recovery", "hold")


def _latency(r: dict, phase: str) -> str:
    x = r["latency"].get(phase) or {}
    return f"p99 {fmt(x.get('p99_ms'))} ms, max {fmt(x.get('max_ms'))} ms, {fmt(x.get('over_1s'))} over 1 s"


def _scrape(r: dict, phase: str, kind: str, q: str = "p50_ms") -> float | None:
    return ((r["metrics_ms"].get(phase) or {}).get(kind) or {}).get(q)


def _gzip_ratio(r: dict, phase: str) -> float | None:
    plain, gz = _scrape(r, phase, "plain"), _scrape(r, phase, "gzip")
    return round(gz / plain, 2) if plain and gz else None


def _ok_latency(r: dict, phase: str) -> bool:
    x = r["latency"].get(phase) or {}
    return x.get("p99_ms") is not None and x["p99_ms"] < 250 and x.get("over_1s") == 0


TARGETS: tuple[tuple[str, Callable[[dict], str], Callable[[dict], bool]], ...] = (
    ("storm ingest p99 < 250 ms, no answer over 1 s", lambda r: _latency(r, "storm"),
     lambda r: _ok_latency(r, "storm")),
    ("recovery ingest p99 < 250 ms, no answer over 1 s", lambda r: _latency(r, "recovery"),
     lambda r: _ok_latency(r, "recovery")),
    ("collector RSS <= 50 KiB per rank after 15 minutes including a storm",
     lambda r: f"{fmt(r['kib_per_rank'])} KiB ({fmt(r['rss_mib']['empty'])} -> {fmt(r['rss_mib']['end'])} MiB "
               f"after {fmt(r['minutes'])} min)", lambda r: r["kib_per_rank"] <= 50 and r["minutes"] >= 15),
    ("`/metrics` <= 100 ms healthy (median, plain / gzip)",
     lambda r: f"{fmt(_scrape(r, 'healthy', 'plain'))} / {fmt(_scrape(r, 'healthy', 'gzip'))} ms",
     lambda r: max(_scrape(r, "healthy", "plain") or 1e9, _scrape(r, "healthy", "gzip") or 1e9) <= 100),
    ("`/metrics` <= 300 ms in the storm (median, plain / gzip)",
     lambda r: f"{fmt(_scrape(r, 'storm', 'plain'))} / {fmt(_scrape(r, 'storm', 'gzip'))} ms",
     lambda r: max(_scrape(r, "storm", "plain") or 1e9, _scrape(r, "storm", "gzip") or 1e9) <= 300),
    ("gzip costs at most 1.5x plain (healthy / storm)",
     lambda r: f"{fmt(_gzip_ratio(r, 'healthy'), 2)}x / {fmt(_gzip_ratio(r, 'storm'), 2)}x",
     lambda r: all(x is not None and x <= 1.5 for x in (_gzip_ratio(r, "healthy"), _gzip_ratio(r, "storm")))),
)
"""Issue 26's targets at 1,024 ranks: label, one side's figure, whether that side meets it."""


def target_rows(doc: dict) -> list[str]:
    """The targets table: each target, the earlier commit's figure, this tree's, and whether this tree meets it."""
    if not doc.get("after"):
        return []
    ref = (doc.get("before") or {}).get("ref")
    head = f"| target | before ({ref}) | after | |" if ref else "| target | after | |"
    rows = []
    for label, figure, ok in TARGETS:
        cells = ([figure(doc["before"])] if ref else []) + [figure(doc["after"])]
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {'met' if ok(doc['after']) else '**not met**'} |")
    return [head, "|---|" + "---|" * (len(head.split("|")) - 3), *rows]


def _phase_table(doc: dict) -> list[str]:
    out = ["| side | phase | rank batches/s | ingest p50 / p99 / max ms | over 1 s | `/metrics` plain ms, median "
           "(max) | gzip ms, median (max) | collector CPU, cores | CPU µs per answered batch |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, r in _sides(doc):
        for phase in PHASES:
            x = r["latency"].get(phase) or {}
            out.append(f"| {name} | {phase} | {fmt(r['requests_per_s'].get(phase))} | {fmt(x.get('p50_ms'))} / "
                       f"{fmt(x.get('p99_ms'))} / {fmt(x.get('max_ms'))} | {fmt(x.get('over_1s'))} | "
                       f"{fmt(_scrape(r, phase, 'plain'))} ({fmt(_scrape(r, phase, 'plain', 'max_ms'))}) | "
                       f"{fmt(_scrape(r, phase, 'gzip'))} ({fmt(_scrape(r, phase, 'gzip', 'max_ms'))}) | "
                       f"{fmt(r['collector_cpu_cores'].get(phase), 3)} | {fmt(_cpu_per_batch(r, phase))} |")
    return out


def _cpu_per_batch(r: dict, phase: str) -> int | None:
    """The collector's CPU per answered batch in ``phase`` (scrapes and the alert pass included): less swayed by
    other jobs on the machine than latency is."""
    cores, rate = r["collector_cpu_cores"].get(phase), r["requests_per_s"].get(phase)
    return round(1e6 * cores / rate) if cores and rate else None


def _sides(doc: dict) -> list[tuple[str, dict]]:
    return [(f"before ({doc['before']['ref']})" if side == "before" else side, doc[side])
            for side in ("before", "after") if doc.get(side)]


def section(doc: dict | None) -> list[str]:
    """The lockstep storm's lines, or none where it was not measured."""
    if not doc or not doc.get("after"):
        return []
    a: dict[str, Any] = doc["after"]
    phases = a["phases_s"]
    return ["Issue 26's targets (the verdict is the *after* side's):", "", *target_rows(doc), "",
            *_phase_table(doc), "",
            "| side | first skip -> its batch answered p50 / p99 / max s (within 2 s) | RSS empty / after the storm / "
            "end / peak MiB | event rows per storm-minute | event MB per storm-minute | database MB per storm-minute "
            "| refused / timed-out / missed |", "|---|---|---|---|---|---|---|",
            *side_rows(doc, lambda name, r: (
                f"| {name} | {fmt(r['first_skip_to_answer']['p50_s'], 2)} / "
                f"{fmt(r['first_skip_to_answer']['p99_s'], 2)}"
                f" / {fmt(r['first_skip_to_answer']['max_s'], 2)} ({fmt(r['first_skip_to_answer']['within_2s'])} of "
                f"{fmt(r['first_skip_to_answer']['n'] + r['first_skips_not_answered'])}) | "
                f"{fmt(r['rss_mib']['empty'])} / {fmt(r['rss_mib']['after_storm'])} / {fmt(r['rss_mib']['end'])} / "
                f"{fmt(r['rss_mib']['peak'])} | {fmt(r['event_rows_per_storm_minute'])} | "
                f"{fmt(r['event_mb_per_storm_minute'], 2)} | {fmt(r['db_mb_per_storm_minute'], 2)} | "
                f"{fmt(sum(r['refused'].values()))} / {fmt(r['timeouts'])} / {fmt(r['missed_updates'])} |"),
                       sides=[s for s in ("before", "after") if doc.get(s)]),
            "", f"A DDP job of {fmt(a['ranks'])} ranks x 2 optimizers whose ranks iterate together (an iteration "
            f"every {fmt(a['iteration_s'])} s) and send as the agent's own schedule says (a heartbeat, news at "
            f"the iteration it happens), real HTTP on loopback, one kept-alive connection per rank "
            f"(`bench.experiments._fleet_ranks --lockstep`): healthy for {fmt(phases['healthy'])} s, then every rank "
            f"skips every iteration for {fmt(phases['storm'])} s (each rank's news at the storm's first skip and at "
            "each rung comes in the same second), then the checkpoint taken before the storm is restored on every "
            f"rank at the same iteration (*recovery*, {fmt(phases['recovery'])} s), then the job trains on "
            f"(*hold*) until {fmt(a['minutes'])} minutes after its start, when the collector's resident memory "
            "is read.", "", "`/metrics` is scraped every 7.5 s, plain and gzipped one right after the other. Each "
            "side on a fresh collector with default settings, one after the other.",
            "", f"{measured_by(doc)}; load average (1 / 5 / 15 min) at the end of each side: "
            + ", ".join(f"{name} {' / '.join(map(str, r['loadavg']))}" for name, r in _sides(doc))
            + (f". {doc['note']}" if doc.get("note") else "."), ""]
