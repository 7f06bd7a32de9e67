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
  optimizers' counters (8 MiB), while a real job's rank keeps sending (``ampwatch_support.wide_body``);
- rebinding: a web page whose name is rebound to 127.0.0.1 posts a batch and reads ``/v1/runs`` and
  ``/metrics`` with ``Host`` and ``Origin`` both its own name;
- forged close: a batch from a fresh incarnation with the host and pid that ``GET /v1/runs/{run}`` shows
  of a live rank, saying it closed; the live rank sends again;
- many incarnations: up to 625 new incarnations of one rank, two batches each (the first dated a day
  back), each as large as the plausibility bound lets one process be, to reach 10^12 skips;
- idle connections: against a collector with 4,096 open files, idle connections opened 512 at a time
  (from one address, then from eight) until a new agent's batch from another address gets no answer
  within 5 s, up to 8,192; then 1,000 that sent half a request line; how many are still open 15 s later.

About two and a half minutes per side on a loaded 2-core machine.

    python -m bench.experiments.attacks [--before 23f3925^] [--key attacks] [--out FILE]
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import tempfile
import time
import uuid

import httpx

from ampwatch_support import wide_body
from ampwatch_support.batches import make_batch, optimizer, skip_event
from ampwatch_support.exposition import value
from bench import _servers
from bench._before_after import before_after_main

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


def _rebinding(client: httpx.Client, port: int) -> dict:
    page = {"Host": f"attacker.example:{port}", "Origin": f"http://attacker.example:{port}"}
    write = client.post("/v1/ingest", json=make_batch(run="rebound"), headers=page).status_code
    return {"write": write, "read_runs": client.get("/v1/runs", headers=page).status_code,
            "read_metrics": client.get("/metrics", headers=page).status_code,
            "run_written": client.get("/v1/runs/rebound").status_code == 200}


def _forged_close(client: httpx.Client) -> dict:
    victim = dict(run="forged-close", rank=3, world_size=8, host="node-a", pid=111, incarnation=uuid.uuid4().hex,
                  process_key=uuid.uuid4().hex)
    client.post("/v1/ingest", json=make_batch(**victim, seq=1, iteration=1))
    (shown,) = client.get("/v1/runs/forged-close").json()["ranks"]
    forged = dict(run="forged-close", rank=3, world_size=8, host=shown["host"], pid=shown["pid"],
                  incarnation=uuid.uuid4().hex)
    status = client.post("/v1/ingest", json=make_batch(**forged, seq=1, closed=True)).status_code
    client.post("/v1/ingest", json=make_batch(**victim, seq=2, iteration=2))
    later = client.post("/v1/ingest", json=make_batch(**forged, seq=2, closed=True)).status_code
    (rank,) = client.get("/v1/runs/forged-close").json()["ranks"]
    return {"forged_close": status, "rank_closed_after_the_victim_sends": rank["closed"],
            "conflicts": len(rank["conflicts"]), "forged_next_batch": later}


def _many_incarnations(client: httpx.Client) -> dict:
    started, codes, day = time.perf_counter(), {}, 86_400.0
    for _ in range(625):
        now, process = time.time(), dict(run="incarnations", rank=0, incarnation=uuid.uuid4().hex)
        for seq, (sent_at, skipped) in enumerate(((now - day, 800_000_000), (now, 1_600_000_000)), 1):
            code = client.post("/v1/ingest", json=make_batch(**process, seq=seq, sent_at=sent_at,
                                                             optimizers={"gen": optimizer(skipped=skipped)})
                               ).status_code
            codes[str(code)] = codes.get(str(code), 0) + 1
    (rank,) = client.get("/v1/runs/incarnations").json()["ranks"]
    return {"seconds": round(time.perf_counter() - started, 1), "answers": codes,
            "skipped_total": rank["optimizers"]["gen"]["skipped"]}


def _agent_answered(url: str) -> bool:
    """Whether a new agent's batch, from 127.0.0.2, is answered within 5 s."""
    try:
        with httpx.Client(base_url=url, timeout=5,
                          transport=httpx.HTTPTransport(local_address="127.0.0.2")) as agent:
            return agent.post("/v1/ingest", json=make_batch(run=f"agent-{uuid.uuid4().hex[:8]}")).status_code == 200
    except httpx.HTTPError:
        return False


def _still_open(sockets: list[socket.socket]) -> int:
    """How many of ``sockets`` the collector has not closed (reading would block: nothing sent, no EOF)."""
    count = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            sock.recv(1)
        except BlockingIOError:
            count += 1
        except OSError:
            pass
    return count


def _idle_connections(env: dict | None, tmp: str, open_files: int = 4096) -> dict:
    result: dict = {"open_files": open_files}
    for label, addresses in (("from_one_address", 1), ("from_eight_addresses", 8)):
        with _servers.CollectorProcess(os.path.join(tmp, f"idle-{addresses}.db"), env=env,
                                       open_files=open_files) as collector:
            held: list[socket.socket] = []
            refused_at = None
            try:
                while len(held) < 2 * open_files:
                    for _ in range(512):
                        address = f"127.0.1.{len(held) % addresses + 1}"
                        held.append(socket.create_connection(("127.0.0.1", collector.port), timeout=10,
                                                             source_address=(address, 0)))
                    if not _agent_answered(collector.url):
                        refused_at = len(held)
                        break
                result[label] = {"opened": len(held), "new_agent_refused_at": refused_at}
            finally:
                for sock in held:
                    sock.close()
            if addresses == 1:
                half = [socket.create_connection(("127.0.0.1", collector.port), timeout=10,
                                                 source_address=(f"127.0.2.{i % 8 + 1}", 0)) for i in range(1000)]
                idle = [socket.create_connection(("127.0.0.1", collector.port), timeout=10,
                                                 source_address=(f"127.0.3.{i % 8 + 1}", 0)) for i in range(1000)]
                for sock in half:
                    sock.sendall(b"GET /heal")
                time.sleep(15)
                result["after_15_s"] = {"half_request_lines_open": _still_open(half), "idle_open": _still_open(idle),
                                        "new_agent_answered": _agent_answered(collector.url)}
                for sock in half + idle:
                    sock.close()
    return result


def _db_bytes(db: str) -> int:
    """The database's size with its write-ahead log folded in (a checkpoint from a second connection)."""
    with sqlite3.connect(db, timeout=60) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return os.path.getsize(db)


def _events_applied(client: httpx.Client) -> float:
    return value(client.get("/metrics").text, "ampwatch_collector_events_applied_total") or 0


def _side(path: str | None) -> dict:
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
            result["wide_body"] = wide_body.play(
                lambda body: client.post("/v1/ingest", content=body, headers=JSON).status_code, collector.proc.pid,
                lambda: elsewhere.post("/v1/ingest", json=make_batch(run="real-job", seq=int(time.time() * 1e3))
                                       ).status_code)
            result["rebinding"] = _rebinding(elsewhere, collector.port)
            result["forged_close"] = _forged_close(elsewhere)
            result["many_incarnations"] = _many_incarnations(elsewhere)
        result["idle_connections"] = _idle_connections(env, tmp)
    return result


def main(argv: list[str] | None = None) -> dict:
    return before_after_main(argv, __doc__.splitlines()[0], "23f3925^", "the one before issue 15's first slice",
                             KEY, _side)


if __name__ == "__main__":
    main()
