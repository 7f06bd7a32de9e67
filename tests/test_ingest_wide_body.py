"""A wide body (one object of hundreds of thousands of keys, or millions of objects) is refused before it is built
into objects, and so is the same body with a bare ``NaN`` in it.

Against a real collector process: the body is read, refused with a 422 that says why, and the
collector's peak memory hardly moves (building 500,000 keys into objects took +905 MiB and 3.6 s,
every other agent waiting); the agents' batches are applied before and after. A body msgspec
refuses for its bare ``NaN`` token was once handed to Python's json module whole: +174 MiB and the
2.7 million objects applied (a 200), +72 MiB for the 500,000 keys (docs/reliability.md).
"""

from __future__ import annotations

import httpx
import pytest

from ampwatch_support import wide_body
from ampwatch_support.batches import make_batch
from ampwatch_support.collector_process import CollectorProcess

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

PEAK_GROWTH_MIB = 64  # the body itself is 8 MiB at most; the requests around it add a few MiB


def test_wide_bodies_with_or_without_a_bare_nan_are_refused_before_they_are_built_into_objects(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector, \
            httpx.Client(base_url=collector.url, timeout=120) as client:
        assert client.post("/v1/ingest", json=make_batch(run="real-job")).status_code == 200
        pid = collector.proc.pid
        for name, body in wide_body.bodies(make_batch(run="wide-body")).items():
            wide_body.reset_peak(pid)
            base = wide_body.peak_kib(pid)
            answer = client.post("/v1/ingest", content=body, headers={"Content-Type": "application/json"})
            grown = (wide_body.peak_kib(pid) - base) / 1024
            assert answer.status_code == 422 and answer.json()["error"] == "schema", (name, answer.text[:300])
            assert answer.json()["retry"] is False and "state" in answer.json()["detail"][0], name
            assert grown < PEAK_GROWTH_MIB, f"{name}: peak memory grew by {grown:.0f} MiB"
        # The 90,000 valid optimizers are refused by the state's size, before one of them is built.
        assert "--max-optimizers-per-rank" in answer.json()["detail"][0]
        assert client.post("/v1/ingest", json=make_batch(run="real-job", seq=2)).status_code == 200
        assert client.get("/v1/runs").json()["runs"][0]["run"] == "real-job"
