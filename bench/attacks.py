"""Issue 15's attacks on a collector with default settings, this tree beside an earlier commit, in one run.

Each side starts a real collector on loopback (the earlier one runs ``ampwatch.server`` from
``git archive <ref>``, first on PYTHONPATH) and plays, from one client address (127.0.0.1):

- takeover: a live rank (victim-run, rank 3) is claimed by a new incarnation that says it closed,
  comes from host "attacker", carries a poisoned_step event and 10^12 skips; then the same with
  plausible counters (400 skips); the victim sends again after each;
- cross-site write: a valid batch posted as ``text/plain`` with ``Origin: http://evil.example``;
- event flood: ten batches of 10,000 events, with the database growth they cause;
- run flood: 1,000 junk runs as fast as one client sends them, then a real job's first batch from
  another address (127.0.0.2, loopback on Linux);
- wide body: one batch whose ``state.optimizers`` holds 500,000 keys (5.6 MiB), then one holding 90,000
  optimizers' counters (8 MiB), while a real job's rank keeps sending (``bench/_wide_body.py``).

About a minute per side on a loaded 2-core machine.

    python -m bench.attacks [--before 23f3925^] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from typing import Optional

import httpx

from bench import _servers, _wide_body  # puts tests/helpers on sys.path
from bench._before_after import before_after, store
from batches import make_batch, optimizer, skip_event  # noqa: E402
from exposition import value  # noqa: E402

__all__ = ["main"]

KEY = "attacks"
RUN = "victim-run"
JSON = {"Content-Type": "application/json"}


def _poisoned(event_id: int) -> dict:
    return {"id": event_id, "kind": "poisoned_step", "time": time.time(), "iteration": 1, "optimizer": "gen",
            "reason": "nonfinite_grad", "params_total": 1, "params": [{"name": "w", "inf": 0, "nan": 1}]}


def _takeover(client: httpx.Client, skipped: int, incarnation: str, seq: int) -> dict:
    victim = dict(run=RUN, rank=3, world_size=8, host="node-a", pid=111, incarnation="v" * 32)
    now = time.time()
    client.post("/v1/ingest", json=make_batch(**victim, seq=seq, sent_at=now, iteration=seq,
                                              optimizers={"gen": optimizer(steps=seq, skipped=1)}))
    attack = client.post("/v1/ingest", json=make_batch(
        run=RUN, rank=3, world_size=8, host="attacker", pid=666, incarnation=incarnation, sent_at=now,
        closed=True, iteration=500, optimizers={"gen": optimizer(steps=100, skipped=skipped, poisoned_steps=1)},
        events=[_poisoned(1)]))
    client.post("/v1/ingest", json=make_batch(**victim, seq=seq + 1, sent_at=now + 1, iteration=seq + 1,
                                              optimizers={"gen": optimizer(steps=seq + 1, skipped=1)}))
    (rank,) = client.get(f"/v1/runs/{RUN}").json()["ranks"]
    text = client.get("/metrics").text
    labels = {"run": RUN, "rank": "3"}
    time.sleep(1.5)  # the built-in alerts tick every second
    firing = sorted({a["name"] for a in client.get("/v1/alerts").json()["firing"]})
    return {"attack_status": attack.status_code, "rank_closed": value(text, "ampwatch_rank_closed", **labels),
            "host": rank["host"], "skipped_total": value(text, "ampwatch_optimizer_skipped_steps_total",
                                                         optimizer="gen", **labels),
            "conflicts": value(text, "ampwatch_rank_conflicts_total", **labels), "alerts_firing": firing}


def _db_bytes(db: str) -> int:
    """The database's size with its write-ahead log folded in (a checkpoint from a second connection)."""
    with sqlite3.connect(db, timeout=60) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return os.path.getsize(db)


def _events_applied(client: httpx.Client) -> float:
    return value(client.get("/metrics").text, "ampwatch_collector_events_applied_total") or 0


def _side(path: Optional[str]) -> dict:
    env = {"PYTHONPATH": os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)} if path else None
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "attacks.db")
        with _servers.CollectorProcess(db, env=env) as collector, \
                httpx.Client(base_url=collector.url, timeout=60) as client, \
                httpx.Client(base_url=collector.url, timeout=60,
                             transport=httpx.HTTPTransport(local_address="127.0.0.2")) as elsewhere:
            result: dict = {"takeover_10e12": _takeover(client, 10 ** 12, "a" * 32, 1),
                            "takeover_plausible": _takeover(client, 400, "b" * 32, 3)}
            cross = client.post("/v1/ingest", content=json.dumps(make_batch(run="cross-site")).encode(),
                                headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
            result["cross_site_text_plain"] = cross.status_code
            before, stored, started, codes = _db_bytes(db), _events_applied(client), time.perf_counter(), {}
            for i in range(10):
                events = [skip_event(10_000 * i + k + 1, iteration=10_000 * i + k) for k in range(10_000)]
                code = client.post("/v1/ingest", json=make_batch(run="event-flood", seq=i + 1, events=events)
                                   ).status_code
                codes[str(code)] = codes.get(str(code), 0) + 1
            result["event_flood"] = {"seconds": round(time.perf_counter() - started, 1), "answers": codes,
                                     "events_stored": int(_events_applied(client) - stored),
                                     "database_growth_mb": round((_db_bytes(db) - before) / 1e6, 1)}
            started, codes = time.perf_counter(), {}
            for i in range(1000):
                code = client.post("/v1/ingest", json=make_batch(run=f"junk-{i}")).status_code
                codes[str(code)] = codes.get(str(code), 0) + 1
            runs = client.get("/v1/runs").json()
            result["run_flood"] = {"seconds": round(time.perf_counter() - started, 1), "answers": codes,
                                   "real_job_from_another_address": elsewhere.post(
                                       "/v1/ingest", json=make_batch(run="real-job")).status_code,
                                   "run_list_first_page": len(runs["runs"]), "run_list_pages": "next" in runs}
            result["wide_body"] = _wide_body.play(
                lambda body: client.post("/v1/ingest", content=body, headers=JSON).status_code, collector.proc.pid,
                lambda: elsewhere.post("/v1/ingest", json=make_batch(run="real-job", seq=int(time.time() * 1e3))
                                       ).status_code)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="23f3925^", help="the commit to compare with (default: the one before "
                                                              "issue 15's first slice)")
    parser.add_argument("--out", help=f"also store the result under {KEY!r} in this JSON file")
    args = parser.parse_args(argv)
    result = before_after(args.before, _side)
    print(json.dumps(result, indent=1))
    if args.out:
        store(args.out, KEY, result, sys.argv)
    return result


if __name__ == "__main__":
    main()
