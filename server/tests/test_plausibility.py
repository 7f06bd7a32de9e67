"""The counter plausibility bound against a batch's claimed time: a ``sent_at`` far back buys no more than a day.

The collector's clock is injected and moved by the test (days pass in no time); batches are real requests
to the app. A rank first seen 11 days ago allows 11 days' worth over all its processes, so only the
per-process bound stands between a forger and a week of counts here.
"""

from __future__ import annotations

import time
import uuid

from fastapi.testclient import TestClient

from ampwatch.server import create_app
from ampwatch.server._plausibility import FIRST_BATCH_SPAN_S
from ampwatch_support.batches import APPLIED, make_batch, optimizer

DAY = 86400.0
RATE = 10_000  # --max-counter-rate's default, per second


class Clock:
    """Unix seconds that move only when the test says."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _process(rank: int, **fields) -> dict:
    return dict(run="dated-back", rank=rank, incarnation=uuid.uuid4().hex, process_key=uuid.uuid4().hex, **fields)


def _dated_back_then(client: TestClient, clock: Clock, rank: int, rise: float):
    """A new process of ``rank``: its first batch dated 10 days back (arriving now), then ``rise`` skips."""
    process = _process(rank)
    dated_back = make_batch(**process, seq=1, sent_at=clock.now - 10 * DAY)
    assert client.post("/v1/ingest", json=dated_back).json() == APPLIED
    clock.now += 1
    return client.post("/v1/ingest", json=make_batch(**process, seq=2, sent_at=clock.now,
                                                     optimizers={"gen": optimizer(skipped=int(rise))}))


def test_a_previous_batch_dated_ten_days_back_lets_the_next_one_rise_by_a_day_at_most(config_for):
    clock = Clock()
    long = 30 * DAY  # nothing expires or retires while the days pass
    app = create_app(config_for(silent_after=3600, expire_after=long, run_retention=long, db_retention=2 * long),
                     clock=clock)
    with TestClient(app) as client:
        assert client.post("/v1/ingest", json=make_batch(**_process(0), seq=1, sent_at=clock.now, closed=True)
                           ).json() == APPLIED
        clock.now += 11 * DAY
        week = _dated_back_then(client, clock, 0, 7 * DAY * RATE)
        assert week.status_code == 422 and week.json()["error"] == "implausible", week.text
        assert "in one batch" in week.json()["message"]
        bound = int(week.json()["message"].split("plausibility bound of ")[1].split(":")[0])
        assert bound <= RATE * (FIRST_BATCH_SPAN_S + 60 + 2), "the earlier sent_at counted as more than a day back"
        # Half a day's worth after the same dated-back batch is within the bound (another rank: no claim between).
        assert _dated_back_then(client, clock, 1, DAY / 2 * RATE).json() == APPLIED
        ranks = client.get("/v1/runs/dated-back").json()["ranks"]
        assert [r["optimizers"]["gen"]["skipped"] for r in ranks] == [0, int(DAY / 2 * RATE)]
