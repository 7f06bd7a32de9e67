"""Prometheus rule evaluation at 1,024 ranks x 2 optimizers over full 30-minute windows: earlier rules vs these.

The real Debian ``prometheus`` evaluates the ampwatch rules every 15 s over a simulated 1,024-rank job
(``bench.experiments._job_history``: healthy ranks, a few in trouble, a whole-job storm). The job's last 33 minutes, one
sample per series every 15 s, are written into Prometheus's head through its remote-write receiver, in time
order, as 33 minutes of scrapes would have stored them (a backfilled block would be read differently, and
more slowly, than the head a live server holds), so every window of every rule is full from the first
evaluation; then a loopback exporter serves the job's live ``/metrics``, scraped every 15 s. Two Prometheus
servers run side by side, each given the same history: one with the rules of an earlier commit
(``render_rules`` from ``git archive <ref>``), one with this tree's. Each group evaluation's time and every
rule's are read from ``/api/v1/rules``; the first evaluation (cold caches) is left out. Those are wall-clock
times, which stretch when other processes hold the CPU, so each server's CPU time per 15 s (from /proc: rule
evaluation, the scrape and these reads) is reported too. Both servers must fire the same alerts for the same
ranks (checked). Then every query of the earlier commit's dashboard and of this tree's runs over the last 30
minutes as Grafana would (15 s steps; tables at one instant): series and bytes per panel.

    python -m bench.experiments.rule_eval [--ranks 1024] [--evaluations 10] [--before a95d20e]
        [--storm short|after|during]
                              [--out FILE]

``--storm during`` measures while a whole-job storm is under way (every rank skipping since a minute before
the live evaluations, its scale collapsing); ``after`` about two minutes after a one-minute storm (its
scale collapsed, then restored from a checkpoint), while its streak alerts still hold; ``short`` (the
default) with the 18-skip storm of issue 14 two minutes before the history's end. Rules that fold a storm
into one alert fire fewer instances than earlier ones: both sides must then fire the same alerts apart from
the storm's (checked).

Takes about 8 minutes on a shared 2-core machine (3-5 of them writing the history); everything listens on
127.0.0.1 and every process started is stopped at the end, even on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ampwatch.contract.alerts import SPEAKERS
from ampwatch.dashboards.dashboard import VARIABLES_AT_ALL
from bench._before_after import ROOT, print_and_store, source_of
from bench._servers import free_port
from bench.experiments._job_history import Job
from bench.experiments._remote_write import RemoteWriter

__all__ = ["main", "measure"]

KEY = "rule_eval"
# Alerts a whole-job storm raises per rank in earlier rules and as one run alert in later ones: not compared.
# The run-wide ones of this tree and the per-rank ones they speak for, and those of earlier rules.
_STORM_ALERTS = frozenset({*SPEAKERS, *SPEAKERS.values(), "AmpRunSkipStorm", "AmpConsecutiveSkippedSteps",
                           "AmpLossScaleCollapsed"})
INTERVAL_S = 15
POLL_S = 5  # /api/v1/rules lists every active alert: read it a few times per interval, not every second
HISTORY_S = 33 * 60  # the longest rule window (30m) plus room for the first evaluations
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def _generated(pythonpath: str | None) -> dict:
    """Return the rule file and the dashboard's ``[title, query, instant]`` triples, from this tree or from the
    sources on ``pythonpath`` (an earlier commit's), in a child process so that the two never mix."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    code = ("import json; from ampwatch.dashboards.dashboard import dashboard_json; "
            "from ampwatch.dashboards.rules import render_rules; "
            "print(json.dumps({'rules': render_rules(), 'panels': [[p['title'], t['expr'], t.get('instant', False)] "
            "for p in dashboard_json()['panels'] for t in p.get('targets', [])]}))")
    return json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True,
                                     text=True, timeout=120).stdout)


# What Grafana puts in a query over the dashboard's last 30 minutes at a 15 s scrape interval.
_GRAFANA = {**VARIABLES_AT_ALL, "$__rate_interval": "1m", "$__range": "30m"}


def _panel_cost(prometheus: str, panels: list[list]) -> dict:
    """Run every panel query as Grafana would over the last 30 minutes (15 s steps; tables: now); series and bytes."""
    end = time.time()
    per_panel: dict[str, dict] = {}
    for title, expr, instant in panels:
        for name, value in _GRAFANA.items():
            expr = expr.replace(name, value)
        if instant:
            url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr, 'time': end})}"
        else:
            params = urllib.parse.urlencode({"query": expr, "start": end - 1800, "end": end, "step": INTERVAL_S})
            url = f"{prometheus}/api/v1/query_range?{params}"
        with urllib.request.urlopen(url, timeout=120) as answer:
            body = answer.read()
        cost = per_panel.setdefault(title, {"series": 0, "bytes": 0})
        cost["series"] += len(json.loads(body)["data"]["result"])
        cost["bytes"] += len(body)
    return {"panels": len(per_panel), "max_series": max(c["series"] for c in per_panel.values()),
            "panels_over_100_series": sum(c["series"] > 100 for c in per_panel.values()),
            "bytes": sum(c["bytes"] for c in per_panel.values()), "per_panel": per_panel}


class _Exporter:
    """Serve the job's live ``/metrics`` on a loopback port, at the wall-clock time of each scrape."""

    def __init__(self) -> None:
        self.job: Job | None = None
        lock, exporter = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with lock:  # the simulation only moves forward
                    body = exporter.job.exposition(time.time()).encode() if exporter.job else b""
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a scrape that timed out and hung up: Prometheus counts it (up == 0), nothing to print

        self.server = Server(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _get(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return json.loads(answer.read())


class _Prometheus:
    """One Prometheus with one rule file, its remote-write receiver on, scraping the job every 15 s."""

    def __init__(self, folder: str, rules: str, target: str) -> None:
        os.makedirs(folder)
        with open(os.path.join(folder, "rules.yaml"), "w") as f:
            f.write(rules)
        with open(os.path.join(folder, "prometheus.yml"), "w") as f:
            json.dump({"global": {"scrape_interval": f"{INTERVAL_S}s", "evaluation_interval": f"{INTERVAL_S}s"},
                       "rule_files": ["rules.yaml"],
                       "scrape_configs": [{"job_name": "ampwatch", "static_configs": [{"targets": [target]}]}]}, f)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(os.path.join(folder, "prometheus.log"), "wb")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={folder}/prometheus.yml",
                                      f"--storage.tsdb.path={folder}/data", "--web.enable-remote-write-receiver",
                                      f"--web.listen-address={self.url[len('http://'):]}"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.evaluations: list[dict] = []
        self.rules: dict[str, dict] = {}  # the latest /api/v1/rules entry of each rule
        self.since = ""

    def poll(self) -> None:
        """Record the group's latest evaluation if it is new."""
        group = _get(self.url + "/api/v1/rules")["data"]["groups"][0]
        if self.evaluations and self.evaluations[-1]["at"] == group["lastEvaluation"]:
            return
        if group["lastEvaluation"] < self.since:
            return  # not evaluated since mark() (or never: "0001-01-01...")
        errors = [f"{_rule_key(r)}: {r['lastError']}" for r in group["rules"] if r.get("lastError")]
        if errors:
            raise RuntimeError("rule evaluation failed:\n" + "\n".join(errors))
        self.evaluations.append({"at": group["lastEvaluation"], "group_s": group["evaluationTime"],
                                 "rules": {_rule_key(r): r["evaluationTime"] for r in group["rules"]}})
        self.rules = {_rule_key(r): r for r in group["rules"]}

    def query(self, expr: str) -> list[dict]:
        return _get(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")["data"]["result"]

    def cpu_s(self) -> float:
        """User + system CPU seconds the process used so far (Linux /proc)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def mark(self) -> None:
        """Count evaluations, CPU and wall time from now on."""
        self.evaluations.clear()
        self.since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + 1))  # as /api/v1/rules writes it
        self.marked = (self.cpu_s(), time.monotonic())

    def cpu_per_interval(self) -> float:
        """CPU seconds used per evaluation interval since :meth:`mark` (scrapes and API reads included)."""
        cpu, wall = self.cpu_s() - self.marked[0], time.monotonic() - self.marked[1]
        return cpu / (wall / INTERVAL_S)

    def own_metric(self, name: str) -> float:
        """Return the sum of one of Prometheus's own series, read from its ``/metrics``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as answer:
            lines = answer.read().decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the session started for it above
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


def _rule_key(rule: dict) -> str:
    """A recording rule's name; an alerting rule's name and severity (one alert may have a rule per severity)."""
    return f"{rule['name']} ({rule['labels']['severity']})" if rule["type"] == "alerting" else rule["name"]


def _summary(p: _Prometheus, rules: str) -> dict:
    cpu_s = p.cpu_per_interval()  # before the queries below add to it
    kept = p.evaluations[1:]  # the first one runs on cold caches
    group = [e["group_s"] for e in kept]
    per_rule = {key: [e["rules"][key] for e in kept] for key in kept[0]["rules"]}
    heaviest = sorted(per_rule, key=lambda key: -statistics.median(per_rule[key]))
    alerts = p.query('count by (alertname, severity) (ALERTS{alertstate="firing"})')
    # The heaviest alerting rule's expression alone (best of 3 instant queries): the rest of its time is
    # Prometheus building its alerts, which templates every label and annotation of every instance.
    alerting = next(key for key in heaviest if p.rules[key]["type"] == "alerting")
    expression_s = []
    for _ in range(3):
        started = time.perf_counter()
        p.query(p.rules[alerting]["query"])
        expression_s.append(time.perf_counter() - started)
    return {
        "rules": len(per_rule), "evaluations": len(kept),
        "group_median_s": round(statistics.median(group), 4), "group_max_s": round(max(group), 4),
        "median_percent_of_interval": round(100 * statistics.median(group) / INTERVAL_S, 2),
        "max_percent_of_interval": round(100 * max(group) / INTERVAL_S, 2),
        "per_rule_ms": {key: {"median": round(1000 * statistics.median(per_rule[key]), 2),
                              "max": round(1000 * max(per_rule[key]), 2)} for key in heaviest},
        "firing": {f"{a['metric']['alertname']} ({a['metric']['severity']})": int(a["value"][1]) for a in alerts},
        "heaviest_alert": {"rule": alerting, "instances": len(p.rules[alerting].get("alerts", [])),
                           "median_ms": round(1000 * statistics.median(per_rule[alerting]), 2),
                           "expression_alone_ms": round(1000 * min(expression_s), 2)},
        "missed_iterations": p.own_metric("prometheus_rule_group_iterations_missed_total"),
        "cpu_s_per_interval": round(cpu_s, 3),
        "rule_file_bytes": len(rules),
    }


def _wait_ready(servers: list[_Prometheus]) -> None:
    deadline = time.monotonic() + 120
    for p in servers:
        while True:
            try:
                with urllib.request.urlopen(p.url + "/-/ready", timeout=5):
                    break
            except OSError as error:
                if time.monotonic() > deadline or p.proc.poll() is not None:
                    raise RuntimeError(f"prometheus at {p.url} did not start") from error
                time.sleep(0.5)


def measure(ranks: int, evaluations: int, before: str, storm: str = "short") -> dict:
    """Write the job's history into both Prometheus servers, let them evaluate, return each side's figures."""
    exporter = _Exporter()
    servers: list[_Prometheus] = []
    with tempfile.TemporaryDirectory(prefix="rule-eval-") as tmp:
        try:
            generated = {"before": _generated(source_of(before, tmp, "contract/src", "dashboards/src")),
                         "after": _generated(None)}
            rules = {side: g["rules"] for side, g in generated.items()}
            for side in ("before", "after"):
                servers.append(_Prometheus(os.path.join(tmp, side), rules[side], exporter.address))
            _wait_ready(servers)
            end = time.time()
            job = Job(ranks, end, storm=storm)
            writer = RemoteWriter([p.url for p in servers], {"job": "ampwatch", "instance": exporter.address})
            started, samples = time.perf_counter(), 0
            for t, series in job.history(end - HISTORY_S, INTERVAL_S, time.time):  # up to the clock
                writer.write(t, series)
                samples += len(series)
            history_s = time.perf_counter() - started
            exporter.job = job  # scraped from now on
            for p in servers:
                p.mark()  # only evaluations over the whole history count
            deadline = time.monotonic() + (evaluations + 3) * INTERVAL_S * 3
            while any(len(p.evaluations) < evaluations + 1 for p in servers):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fewer than {evaluations + 1} evaluations in time: "
                                       f"{[len(p.evaluations) for p in servers]}")
                for p in servers:
                    if p.proc.poll() is not None:
                        raise RuntimeError(f"prometheus exited: {p.proc.returncode}")
                    p.poll()
                time.sleep(POLL_S)
            window = servers[1].query("quantile(0.5, count_over_time(ampwatch_iteration[30m]))")
            result = {"ranks": ranks, "optimizers": 2, "interval_s": INTERVAL_S, "history_minutes": HISTORY_S / 60,
                      "storm": storm, "loadavg": _loadavg(),
                      "series": int(float(servers[1].query("count({__name__=~'ampwatch_.*'})")[0]["value"][1])),
                      "samples_per_series_in_30m": float(window[0]["value"][1]) if window else None,
                      "history_samples": samples, "history_write_s": round(history_s, 1)}
            for side, p in zip(("before", "after"), servers, strict=True):
                result[side] = _summary(p, rules[side])
            for side in ("before", "after"):  # both dashboards on the same server, once both CPU figures are in
                result[side]["dashboard"] = _panel_cost(servers[1].url, generated[side]["panels"])
            result["before"]["ref"] = before
        finally:
            for p in servers:
                p.stop()
            exporter.server.shutdown()
    compared = [{k: v for k, v in result[side]["firing"].items() if k.split(" ")[0] not in _STORM_ALERTS}
                for side in ("before", "after")]
    if compared[0] != compared[1]:
        raise AssertionError(f"the two rule sets fire different alerts: {result['before']['firing']} vs "
                             f"{result['after']['firing']}")
    return result


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _dashboard_line(side: str, r: dict) -> str:
    d = r["dashboard"]
    return (f"{side:>6}: dashboard over 30 minutes: {d['panels']} panels, at most {d['max_series']} series in one, "
            f"{d['panels_over_100_series']} with over 100, {d['bytes'] / 1e6:.1f} MB in all")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--evaluations", type=int, default=10, help="evaluations kept per side (after a first one)")
    parser.add_argument("--before", default="a95d20e", help="the commit whose rules to compare with")
    parser.add_argument("--storm", choices=("short", "after", "during"), default="short",
                        help="the whole-job storm: 18 skips 2 minutes before the history ends (default), a minute "
                             "that ended two minutes before the live evaluations, or one under way")
    parser.add_argument("--out", help=f"also store the result under {KEY!r} (another storm: {KEY}_<storm>) in this "
                                      "JSON file")
    args = parser.parse_args(argv)
    result = measure(args.ranks, args.evaluations, args.before, args.storm)
    print(f"{result['series']} series, {result['samples_per_series_in_30m']:g} samples per series in 30m, "
          f"history written in {result['history_write_s']} s")
    for side in ("before", "after"):
        r = result[side]
        top = ", ".join(f"{k} {v['median']:g} ms" for k, v in list(r["per_rule_ms"].items())[:3])
        print(f"{side:>6}: {r['rules']} rules, group median {r['group_median_s'] * 1000:.0f} ms "
              f"({r['median_percent_of_interval']}% of {INTERVAL_S} s), max {r['group_max_s'] * 1000:.0f} ms "
              f"({r['max_percent_of_interval']}%) over {r['evaluations']} evaluations, "
              f"{r['cpu_s_per_interval']} CPU s per {INTERVAL_S} s; heaviest: {top}")
    print("firing:", result["after"]["firing"])
    for side in ("before", "after"):
        h = result[side]["heaviest_alert"]
        print(f"{side:>6}: heaviest alert {h['rule']}: {h['median_ms']:g} ms with {h['instances']} instances, "
              f"its expression alone {h['expression_alone_ms']:g} ms")
    print(f"machine load (1, 5, 15 min) at the end: {_loadavg()}; "
          f"firing instances: before {sum(result['before']['firing'].values())}, "
          f"after {sum(result['after']['firing'].values())}")
    return print_and_store(result, KEY if args.storm == "short" else f"{KEY}_{args.storm}", args.out,
                           _dashboard_line, module=KEY)


if __name__ == "__main__":
    main()
