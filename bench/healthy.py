"""A healthy run's cost per rank by what its batches carry: wire bytes per rank-hour and collector CPU per rank-second,
today's batches beside issue 40's (the rolling levels of the loss and of each optimizer's gradient norm, global and
local), against this tree's collector, in the same run.

Each shape (:data:`SHAPES`) gets a fresh collector and a simulated job of N ranks in a process of its own
(``bench/experiments/_fleet_ranks.py``: the agent's own push schedule at its default heartbeat, real HTTP on
loopback, two optimizers, no skips), all shapes at once so that the machine's load falls on each alike;
``/metrics`` is scraped every 15 s as Prometheus does. Over the healthy phase (whole heartbeats, after every rank's
first batch): bytes on the wire (each request's line, headers and body, each answer with its headers, as the
fleet bench counts them) per rank-hour, and the collector's CPU (user + system, every thread, ``/proc``) per
rank-second. Issue 40's target: each at most +10% over today's shape.

The answers of a collector that lists the spike event kinds (issue 40's protocol) carry ``"kinds"`` too
(``wire_ratio_with_kinds``): counted on a levels side, projected where its collector does not send them yet, and
never on today's side (today's collector sent none).

    python -m bench.healthy [--quick] [--ranks N] [--heartbeats K] [--rounds R] [--before REF]

``--before REF`` also runs today's batches on the collector of an earlier commit (its ``server/src`` and
``contract/src`` from ``git archive``) at the same time: once issue 40's collector is in, the ratios over that side
(``ratios_vs_before``) say what the whole change costs, the new collector's own work (levels in ``/metrics``, the
outlier judgment) included, e.g. ``python -m bench.healthy --before 29e7ac7`` (the commit before issue 40's
contract).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from typing import Any

from ampwatch.agent._schedule import default_heartbeat
from ampwatch.contract.protocol import LISTED_EVENT_KINDS
from ampwatch_support.batches import OPTIMIZER_LEVELS, RANK_LEVELS, make_batch
from bench import _servers
from bench._async_http import INGEST_HEAD, request
from bench._before_after import ROOT, source_of
from bench._rank_batch import SCALER, batch_body, open_identity, with_levels
from bench.experiments._fleet_plan import Plan
from bench.experiments.fleet import SCRAPE_EVERY_S, scrape, sleep_until, warm_seconds

__all__ = ["FORMS", "SHAPES", "TARGET_RATIO", "exchange_bytes", "run", "main"]

SHAPES = {"today": 0, "levels": 1, "levels_every_4th": 4}
"""Each shape measured, and one in how many batches carries issue 40's levels (0: none, today's batches; 4: the
alternative of sending them with one heartbeat in 4, drawn at random, a minute apart on average at the default 15 s)."""

TARGET_RATIO = 1.10
"""Issue 40: a healthy run's bytes per rank-hour and collector CPU per rank-second at most 10% over today's."""


def _answer(url: str) -> bytes:
    """The body of the collector's answer to an ordinary healthy batch (a run of its own)."""
    body = json.dumps(make_batch(run="healthy-probe")).encode()
    req = urllib.request.Request(url + "/v1/ingest", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as answer:
        return answer.read()


FORMS: dict[str, Callable[[dict], Any]] = {
    "3 significant digits": lambda level: {key: float(f"{value:.3g}") for key, value in level.items()},
    "[mean, std] pairs": lambda level: [level["mean"], level["std"]],
}
"""Other ways to write a level, counted in bytes only (:func:`exchange_bytes`): the collector of this tree refuses a
pair, which is not the contract's form."""


def _reformed(state: dict, form: Callable[[dict], Any]) -> dict:
    """``state`` with each of its levels written by ``form``."""
    optimizers = {name: {key: form(value) if key in OPTIMIZER_LEVELS else value for key, value in counters.items()}
                  for name, counters in state["optimizers"].items()}
    return dict(state, optimizers=optimizers, **{key: form(state[key]) for key in RANK_LEVELS if key in state})


def exchange_bytes(levels_every: int, ranks: int = 2048, form: str | None = None) -> dict:
    """Bytes of one healthy batch of the shape (averaged over ``levels_every`` batches; ``form``: its levels written
    as :data:`FORMS` says), exact, without a collector: as the simulated ranks encode it (request line, headers,
    body) and as the agent encodes its body (``ampwatch.agent._batch.encode_batch``: compact JSON)."""
    from ampwatch.agent._batch import encode_batch

    head = open_identity("fleet", ranks // 2, ranks)
    state = Plan(0.0, 1.0, []).batch_state(5000)
    levelled = with_levels(state, ranks // 2, 5000)
    if form is not None:
        levelled = _reformed(levelled, FORMS[form])
    shapes = [state] if not levels_every else [levelled] + [state] * (levels_every - 1)
    sim, agent = [], []
    for s in shapes:
        rest = {"seq": 334, "sent_at": 1764400000.123456, "scaler": SCALER, "state": s, "events": [], "closed": False}
        body = batch_body(head, rest)
        sim.append(len(request(INGEST_HEAD, body)))
        agent.append(len(encode_batch(json.loads(body))))
    return {"request_bytes": round(statistics.mean(sim), 1), "agent_body_bytes": round(statistics.mean(agent), 1)}


def _side(shape: str, ranks: int, heartbeats: int, heartbeat: float, server: str | None = None) -> dict:
    """One shape on its own fresh collector (``server``: the ``server/src`` of an earlier commit, first on its path;
    default this tree's): its healthy phase's bytes and the collector's CPU."""
    healthy = heartbeats * heartbeat
    env = {"PYTHONPATH": server} if server else None
    with tempfile.TemporaryDirectory() as tmp, _servers.collector(env=env) as srv:
        answer = _answer(srv.url)
        out = os.path.join(tmp, "ranks.json")
        sim = subprocess.Popen([sys.executable, "-m", "bench.experiments._fleet_ranks", "--port", str(srv.port),
                                "--ranks", str(ranks), "--delivery", "after", "--warm", str(warm_seconds(ranks)),
                                "--healthy", str(healthy), "--storm", "0", "--storm-share", "0",
                                "--heartbeat", str(heartbeat), "--levels-every", str(SHAPES[shape]),
                                "--run", f"healthy-{shape}", "--out", out],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            timeline = json.loads(sim.stdout.readline())
            start, end = timeline["warm_end"], timeline["storm_at"]
            sleep_until(start)
            cpu0 = srv.stats.cpu_s()
            scrapes = []
            at = start
            while at < end:
                sleep_until(at)
                scrapes.append(scrape(srv.url))
                at += SCRAPE_EVERY_S
            sleep_until(end)
            cpu = srv.stats.cpu_s() - cpu0
            sim.wait(timeout=120)
        finally:
            if sim.poll() is None:
                sim.kill()
                sim.wait()
        if sim.returncode != 0:
            raise RuntimeError(f"the simulated job of shape {shape!r} failed (exit {sim.returncode})")
        with open(out) as f:
            job = json.load(f)
    seconds = end - start
    per_rank_hour = 3600.0 / (ranks * seconds)
    return {"shape": shape, "levels_every": SHAPES[shape], "ranks": ranks, "heartbeat_s": heartbeat,
            "healthy_s": round(seconds, 1), "requests": job["requests"]["healthy"],
            "levelled_share": round(job["levelled"]["healthy"] / max(1, job["requests"]["healthy"]), 4),
            "wire_bytes": job["bytes"]["healthy"],
            "bytes_per_exchange": round(job["bytes"]["healthy"] / max(1, job["requests"]["healthy"]), 1),
            "wire_kib_per_rank_hour": round(job["bytes"]["healthy"] * per_rank_hour / 1024, 2),
            "exchanges_per_rank_hour": round(job["requests"]["healthy"] * per_rank_hour, 1),
            "collector_cpu_s": round(cpu, 2),
            "collector_cpu_us_per_rank_s": round(1e6 * cpu / (ranks * seconds), 2),
            "refused": job["refused"], "timeouts": job["timeouts"], "missed": job["missed"],
            "scrapes": len(scrapes), "scrapes_failed": sum("error" in s for s in scrapes),
            "answer_lists_kinds": b'"kinds"' in answer, "generator_cpu_s": job["generator_cpu_s"]}


def _kinds_bytes() -> int:
    """Bytes the spike kinds add to an answer of the collector: ``{"applied": true}`` beside the same with
    ``"kinds"`` (as the collector writes its answers, ``json.dumps``)."""
    plain = json.dumps({"applied": True})
    return len(json.dumps({"applied": True, "kinds": list(LISTED_EVENT_KINDS)})) - len(plain)


def _ratios(sides: dict[str, dict], kinds: int, base: str = "today") -> dict:
    """Each shape's bytes and CPU over ``base``'s, and its bytes with the answers' kinds: counted on the shape's side
    (projected where its collector does not list them yet), not on ``base``'s (today's collector sent none)."""
    today = sides[base]
    base_bytes = today["wire_bytes"] - (kinds * today["requests"] if today["answer_lists_kinds"] else 0)
    out = {}
    for name, side in sides.items():
        if name == base or side.get("server"):
            continue
        side_bytes = side["wire_bytes"] + (0 if side["answer_lists_kinds"] else kinds * side["requests"])
        with_kinds = (side_bytes / side["healthy_s"]) / (base_bytes / today["healthy_s"])
        out[name] = {"wire_ratio": round(side["wire_kib_per_rank_hour"] / today["wire_kib_per_rank_hour"], 4),
                     "wire_ratio_with_kinds": round(with_kinds, 4),
                     "cpu_ratio": round(side["collector_cpu_us_per_rank_s"] / today["collector_cpu_us_per_rank_s"], 4)}
    return out


def _medians(measured: list[dict], key: str) -> dict:
    return {name: {k: round(statistics.median(m[key][name][k] for m in measured), 4)
                   for k in ("wire_ratio", "wire_ratio_with_kinds", "cpu_ratio")}
            for name in measured[0][key]}


def run(ranks: int = 2048, heartbeats: int = 3, rounds: int = 2, heartbeat: float | None = None,
        before: str | None = None) -> dict:
    """Measure every shape at once, ``rounds`` times; return each round's figures, their ratios and the medians.

    ``heartbeat``: seconds between a rank's batches (default: the agent's for a job of ``ranks``); shorter only to
    smoke-test the bench. ``before``: a commit whose collector also takes today's batches, at the same time (side
    ``today at REF``), and each shape's ratios over that side too (``ratios_vs_before``): once issue 40's collector
    is in, what the whole change costs, its collector's own work included."""
    heartbeat = heartbeat or default_heartbeat(ranks)
    load_start = [round(x, 2) for x in os.getloadavg()]
    kinds = _kinds_bytes()
    measured = []
    with tempfile.TemporaryDirectory() as tmp:
        server = source_of(before, tmp) if before else None
        jobs = {name: (name, None) for name in SHAPES}
        if before:
            jobs[f"today at {before}"] = ("today", server)
        for _ in range(rounds):
            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
                futures = {name: pool.submit(_side, shape, ranks, heartbeats, heartbeat, path)
                           for name, (shape, path) in jobs.items()}
                sides = {name: dict(f.result(), server=jobs[name][1] and before) for name, f in futures.items()}
            round_ = {"sides": sides, "ratios": _ratios(sides, kinds)}
            if before:
                round_["ratios_vs_before"] = _ratios(sides, kinds, base=f"today at {before}")
            measured.append(round_)
    medians = _medians(measured, "ratios")
    extra = {"before": before, "ratios_vs_before": _medians(measured, "ratios_vs_before")} if before else {}
    return {"ranks": ranks, "heartbeats": heartbeats, "rounds": measured, "ratios": medians, **extra,
            "kinds_bytes_per_answer": kinds, "target_ratio": TARGET_RATIO,
            "exchange": {**{name: exchange_bytes(every, ranks) for name, every in SHAPES.items()},
                         **{f"levels, {form}": exchange_bytes(1, ranks, form) for form in FORMS}},
            "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    """Run and print the results as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.healthy", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,024 ranks, 2 heartbeats, one round")
    parser.add_argument("--ranks", type=int, help="simulated ranks per shape (default 2,048)")
    parser.add_argument("--heartbeats", type=int, help="heartbeats measured (default 3)")
    parser.add_argument("--rounds", type=int, help="rounds of all shapes at once (default 2)")
    parser.add_argument("--before", metavar="REF", help="also run today's batches on the collector of commit REF "
                                                        "(e.g. the one before issue 40), at the same time")
    args = parser.parse_args(argv)
    quick = {"ranks": 1024, "heartbeats": 2, "rounds": 1} if args.quick else {}
    chosen = {k: v for k, v in (("ranks", args.ranks), ("heartbeats", args.heartbeats), ("rounds", args.rounds))
              if v is not None}
    print(json.dumps(run(**{**quick, **chosen}, before=args.before), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
