"""The collector's own timings (AMPWATCH_SERVER_TRACE): a line per ingest request with its phases, and a line per
group commit, render and alert pass; nothing when it is not asked for."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request

from ampwatch.server import ServerConfig, _trace
from ampwatch.server._state import CollectorState
from ampwatch.server.alerting.service import AlertService
from ampwatch_support.batches import ingest_status, make_batch, post_batch, skip_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.patience import wait_until

_APPLIED_PHASES = {"read", "parse", "turn", "apply", "queue", "write", "commit", "resume", "after", "send"}


def test_a_traced_collector_writes_a_line_per_request_with_its_phases_and_one_per_commit_and_render(tmp_path):
    trace = tmp_path / "trace.jsonl"
    batches = [make_batch(seq=seq, iteration=seq, events=[skip_event(seq, iteration=seq)]) for seq in (1, 2, 3)]
    with CollectorProcess(str(tmp_path / "c.db"), env={_trace.TRACE_ENV: str(trace)}) as collector:
        for batch in batches:
            post_batch(collector.url, batch)
        post_batch(collector.url, batches[1])  # a duplicate: answered, not applied again
        assert ingest_status(collector.url, b"{not json") == 400
        with urllib.request.urlopen(collector.url + "/metrics", timeout=30) as answer:
            answer.read()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    requests = [x for x in lines if x["k"] == "req"]
    assert [x["status"] for x in requests] == [200, 200, 200, 200, 400]
    for applied in requests[:3]:
        assert _APPLIED_PHASES <= applied.keys(), applied
        assert (applied["rank"], applied["events"]) == (0, 1) and applied["group"] >= 1
        assert applied["total"] >= 0
    assert {"read", "parse", "turn", "queue", "commit", "resume", "send"} <= requests[3].keys()  # the duplicate's
    assert "parse" not in requests[4] and {"read", "send"} <= requests[4].keys()  # refused as it was parsed
    commits = [x for x in lines if x["k"] == "commit"]
    assert sum(x["jobs"] for x in commits) >= 4 and all({"write", "commit", "checkpoint"} <= x.keys() for x in commits)
    assert len([x for x in lines if x["k"] == "render"]) == 1


def test_an_untraced_collector_writes_no_trace(tmp_path):
    assert _trace.TRACE_ENV not in os.environ
    with CollectorProcess(str(tmp_path / "c.db")) as collector:
        post_batch(collector.url, make_batch(seq=1))
    assert _trace.active is None
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("c.db")) == []


def test_each_alert_pass_is_traced_with_its_wall_and_cpu_time(tmp_path):
    path = tmp_path / "trace.jsonl"
    service = AlertService(period_s=0.05)

    async def two_passes() -> None:
        task = asyncio.create_task(service.run(CollectorState(ServerConfig(db=str(tmp_path / "unused.db")))))
        try:
            await asyncio.to_thread(wait_until, lambda: len([x for x in trace._lines if x[0] == "pass"]) >= 2,
                                    what="two alert passes traced")
        finally:
            task.cancel()

    trace = _trace.start(str(path))
    assert trace is not None
    try:
        asyncio.run(two_passes())
    finally:
        _trace.stop()
    passes = [json.loads(line) for line in path.read_text().splitlines() if '"pass"' in line]
    assert len(passes) >= 2 and all({"ms", "cpu_ms"} <= p.keys() for p in passes)
