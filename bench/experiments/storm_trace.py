"""Read a storm run's collector trace (``python -m bench.experiments.storm --trace FILE``): where the slowest answers'
time went, and what else ran while they waited.

For the storm and recovery phases together: the job's ingest p99 (as the agent times it, from handing a batch over
to its answer) and the collector's own (its handler's first line to its answer sent; the difference is the time a
request waited for the event loop to read it, and the answer's way back); the phases of the collector's slowest 1%
of requests against those of all; and for the job's slowest 1% of answers, how many overlapped each kind of event
(a group commit over 20 ms, a checkpoint, a collection over 5 ms, an alert pass, a render, event-loop lag over
20 ms) beside how many of all answers did.

    python -m bench.experiments.storm_trace /tmp/storm.trace.after
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from collections import Counter

__all__ = ["read", "summary", "main"]

_PHASES = ("read", "parse", "turn", "apply", "queue", "write", "commit", "resume", "after", "send")
_WINDOW = ("storm", "recovery")


def read(path: str) -> tuple[list[dict], dict]:
    """The trace's lines and the job's answers (``bounds``, ``latency``: per phase, [sent, seconds] pairs)."""
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    with open(path + ".job.json") as f:
        return lines, json.load(f)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _events(lines: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Intervals (start, end; Unix s) of the events that may hold a request up, by kind."""
    out: dict[str, list[tuple[float, float]]] = {}

    def add(kind: str, t: float, ms: float) -> None:
        out.setdefault(kind, []).append((t, t + ms / 1000))

    for x in lines:
        k = x["k"]
        if k == "commit":
            if x["checkpoint"]:
                add("checkpoint", x["t"], x["write"] + x["commit"])
            if x["write"] + x["commit"] > 20:
                add("commit>20ms", x["t"], x["write"] + x["commit"])
        elif k == "gc" and x["ms"] > 5:
            add(f"gc{x['gen']}>5ms", x["t"], x["ms"])
        elif k in ("pass", "render"):
            add(k, x["t"], x["ms"])
        elif k == "lag" and x["ms"] > 20:
            add("lag>20ms", x["t"] - x["ms"] / 1000, x["ms"])
        elif k == "checkpoint":
            add("checkpoint", x["t"], x["ms"])
    for intervals in out.values():
        intervals.sort()
    return out


def _overlaps(intervals: list[tuple[float, float]], a: float, b: float) -> bool:
    i = bisect.bisect_right(intervals, (b, float("inf")))
    return any(s < b and e > a for s, e in intervals[max(0, i - 50):i])


def clusters(lines: list[dict], slowest: list[tuple[float, float]], start: float) -> list[dict]:
    """The slowest answers in clusters (a second apart or more), each with what ran from half a second before its
    first answer was sent to its last answer: each thread's CPU, the alert passes and renders (wall / CPU ms), young
    collections' CPU, commits that checkpointed, the longest commit, the event loop's longest lag."""
    out: list[dict] = []
    for sent, seconds in sorted(slowest):
        if out and sent - out[-1]["_last"] < 1.0:
            out[-1]["_last"], out[-1]["_end"] = sent, max(out[-1]["_end"], sent + seconds)
            out[-1]["answers"] += 1
            out[-1]["max_ms"] = max(out[-1]["max_ms"], round(1000 * seconds, 1))
        else:
            out.append({"_first": sent, "_last": sent, "_end": sent + seconds, "answers": 1,
                        "max_ms": round(1000 * seconds, 1)})
    for c in out:
        a, b = c.pop("_first") - 0.5, c.pop("_end")
        c.pop("_last")
        inside = [x for x in lines if a <= x["t"] < b]
        cpu: Counter = Counter()
        for x in inside:
            if x["k"] == "cpu":
                cpu.update(x["threads"])
        commits = [x for x in inside if x["k"] == "commit"]
        c.update(from_s=round(a + 0.5 - start, 2), window_s=round(b - a, 2),
                 thread_cpu_ms={k: round(v) for k, v in cpu.most_common()},
                 passes=[[x["ms"], x["cpu_ms"]] for x in lines if x["k"] == "pass" and x["t"] < b
                         and x["t"] + x["ms"] / 1000 > a],
                 renders=[[x["ms"], x["cpu_ms"]] for x in lines if x["k"] == "render" and x["t"] < b
                          and x["t"] + x["ms"] / 1000 > a],
                 gc_cpu_ms=round(sum(x.get("cpu_ms", x["ms"]) for x in inside if x["k"] == "gc")),
                 commits=len(commits), checkpointed_commits=sum(x["checkpoint"] for x in commits),
                 longest_commit_ms=max((x["write"] + x["commit"] for x in commits), default=None),
                 checkpoint_thread_ms=round(sum(x["ms"] for x in inside if x["k"] == "checkpoint"), 1),
                 longest_lag_ms=max((x["ms"] for x in inside if x["k"] == "lag"), default=0))
    return out


def summary(lines: list[dict], job: dict) -> dict:
    """The figures :func:`main` prints (see the module's docstring)."""
    bounds = job["bounds"]
    start, end = bounds[_WINDOW[0]][0], bounds[_WINDOW[-1]][1]
    answers = [(s, d) for p in _WINDOW for s, d in job["latency"].get(p, [])]
    requests = [x for x in lines if x["k"] == "req" and start <= x["t"] < end]
    totals = [x["total"] for x in requests]
    slow_cut = _p(totals, 0.99)
    slow = [x for x in requests if x["total"] >= slow_cut]
    phases = {p: {"all_mean_ms": round(statistics.fmean([x.get(p, 0) for x in requests]), 2) if requests else None,
                  "slowest_1%_mean_ms": round(statistics.fmean([x.get(p, 0) for x in slow]), 2) if slow else None}
              for p in _PHASES}
    events = _events(lines)
    cut = _p([d for _, d in answers], 0.99)
    slowest = [(s, d) for s, d in answers if d >= cut]
    overlap = {kind: {"slowest_1%": sum(_overlaps(iv, s, s + d) for s, d in slowest),
                      "all": round(sum(_overlaps(iv, s, s + d) for s, d in answers) / max(1, len(answers)) *
                                   len(slowest), 1),
                      "count_in_window": sum(start <= a < end for a, _ in iv)}
               for kind, iv in sorted(events.items())}
    cpu: Counter = Counter()
    for x in lines:
        if x["k"] == "cpu" and start <= x["t"] < end:
            cpu.update(x["threads"])
    commits = [x for x in lines if x["k"] == "commit" and start <= x["t"] < end]
    return {
        "answers": len(answers), "job_p99_ms": round(1000 * cut, 1),
        "collector_p99_ms": round(slow_cut, 1), "collector_requests": len(requests),
        "phases": phases, "slowest_answers_overlapping": overlap,
        "thread_cpu_s": {k: round(v / 1000, 2) for k, v in cpu.most_common()},
        "commits": {"n": len(commits), "jobs_mean": round(statistics.fmean([c["jobs"] for c in commits]), 1)
                    if commits else None,
                    "commit_ms_p50_p99_max": [round(_p([c["commit"] for c in commits], q), 2) for q in (.5, .99, 1)]
                    if commits else None,
                    "write_ms_p50_p99_max": [round(_p([c["write"] for c in commits], q), 2) for q in (.5, .99, 1)]
                    if commits else None,
                    "checkpoints": sum(c["checkpoint"] for c in commits)},
        "clusters_of_the_slowest": clusters(lines, slowest, start),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.storm_trace",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="the trace file a side wrote (FILE.after)")
    result = summary(*read(parser.parse_args(argv).trace))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
