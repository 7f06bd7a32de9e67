"""The rank whose gradients stand out: every row of the gradient-outlier table (docs/protocol.md#gradient_outlier)
through the collector's ingest, each in a run of its own; the event, the counter and its alert, the evidence the
suspects read, and the count kept across a restart."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server import create_app
from ampwatch.server._outliers import MAD_SCALE, WAIT_S
from ampwatch_support.batches import APPLIED, make_batch, optimizer, samples, skip_event
from ampwatch_support.exposition import value
from ampwatch_support.patience import wait_until

START = 1_764_400_000.0


class Clock:
    """The collector's clock, moved by the test (the wait of row 2 is 30 s)."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


class Job:
    """Ranks of one run posting to the collector (an app's test client, or HTTP to a collector process): each rank's
    level of its own gradient norm and its iteration."""

    def __init__(self, client: httpx.Client, run: str, size: int, means: list[float | None], stds: float = 0.1,
                 iteration: int = 10) -> None:
        self.client, self.run, self.size, self.means, self.stds = client, run, size, means, stds
        self.seq = [0] * size
        self.ids = itertools.count(1)
        for rank in range(size):
            self.report(rank, iteration)

    def report(self, rank: int, iteration: int, *events: dict, again: dict | None = None) -> dict:
        """Post rank ``rank``'s batch at ``iteration`` with ``events`` (``again``: post that batch once more)."""
        if again is not None:
            assert self.client.post("/v1/ingest", json=again).status_code == 200
            return again
        self.seq[rank] += 1
        mean = self.means[rank]
        levels = {} if mean is None else {"local_grad_norm": {"mean": mean, "std": self.stds}}
        batch = make_batch(run=self.run, rank=rank, world_size=self.size, local_rank=rank, host=f"{self.run}-host",
                           incarnation=f"{rank:032x}", process_key=f"{rank:032x}", seq=self.seq[rank],
                           iteration=iteration, optimizers={"gen": optimizer(steps=iteration, **levels)},
                           events=list(events))
        assert self.client.post("/v1/ingest", json=batch).json() == APPLIED
        return batch

    def spike(self, rank: int, iteration: int, spiked: float | str, ids: list | None = None) -> dict:
        """A local ``grad_norm_spike`` of rank ``rank`` (its own gradient norm before DDP's all-reduce)."""
        return {"id": next(self.ids), "kind": "grad_norm_spike", "time": START + iteration, "iteration": iteration,
                "optimizer": "gen", "local": True, "value": spiked, "mean": 1.0, "std": 0.1,
                "z": None if isinstance(spiked, str) else (spiked - 1.0) / 0.1, "streak": 1,
                **({"samples": samples(ids)} if ids else {})}

    def outliers(self) -> list[dict]:
        return self.client.get(f"/v1/runs/{self.run}/events", params={"kind": "gradient_outlier"}).json()["events"]

    def counted(self, rank: int) -> float | None:
        return value(self.client.get("/metrics").text, "ampwatch_rank_gradient_outliers_total", run=self.run,
                     rank=str(rank))


@pytest.fixture(scope="module")
def collector(tmp_path_factory) -> Iterator[tuple[TestClient, Clock]]:
    from ampwatch.server import ServerConfig
    clock = Clock()
    config = ServerConfig(db=str(tmp_path_factory.mktemp("outliers") / "ampwatch.db"), allowed_hosts=("testserver",))
    with TestClient(create_app(config, clock=clock)) as client:
        yield client, clock


def test_row_1_a_spike_with_no_other_rank_to_compare_with_is_not_judged(collector):
    client, _ = collector
    job = Job(client, "row-1", 2, means=[1.0, None])  # rank 1 watches no ddp=: no level of its own norm
    job.report(0, 11, job.spike(0, 11, 100.0))
    job.report(1, 11)
    assert job.outliers() == [] and job.counted(0) == 0


def test_row_2_a_spike_waits_until_every_other_rank_reported_its_iteration(collector):
    client, _ = collector
    job = Job(client, "row-2", 4, means=[1.0] * 4, iteration=5)
    job.report(0, 12, job.spike(0, 12, 100.0))
    job.report(1, 12)
    job.report(2, 20)
    assert job.outliers() == []  # rank 3 is still at iteration 5: its spike at 12 may come yet
    job.report(3, 12)
    assert [(e["rank"], e["iteration"]) for e in job.outliers()] == [(0, 12)]


def test_row_2_a_spike_waits_no_longer_than_two_heartbeats_then_is_judged_with_what_is_known(collector):
    client, clock = collector
    job = Job(client, "row-2-late", 4, means=[1.0] * 4, iteration=5)
    job.report(2, 13, job.spike(2, 13, 100.0))
    job.report(0, 13)
    clock.now += WAIT_S - 1
    job.report(1, 13)
    assert job.outliers() == []  # rank 3 never reported iteration 13, and the wait is not over
    clock.now += 2
    job.report(1, 14)  # any batch of the run judges what is due (a periodic pass too, for a run that went quiet)
    assert [(e["rank"], e["iteration"], e["ranks_compared"]) for e in job.outliers()] == [(2, 13, 3)]


def test_row_3_a_spike_on_more_than_a_share_of_the_ranks_is_the_whole_jobs_and_names_no_outlier(collector):
    client, _ = collector
    assert T.outlier_rank_share * 4 < 2  # two ranks of four are more than the share
    job = Job(client, "row-3", 4, means=[1.0] * 4)
    job.report(0, 11, job.spike(0, 11, 100.0))
    job.report(1, 11, job.spike(1, 11, "NaN"))  # a non-finite one too (row 4 yields to row 3)
    job.report(2, 11)
    job.report(3, 11)
    assert job.outliers() == [] and job.counted(0) == job.counted(1) == 0
    # One rank of two is more than the share, but a rank alone is never the whole job.
    pair = Job(client, "row-3-pair", 2, means=[1.0, 1.0])
    pair.report(0, 11, pair.spike(0, 11, 100.0))
    pair.report(1, 11)
    assert [e["rank"] for e in pair.outliers()] == [0]


def test_row_3b_a_spike_soon_after_another_ranks_is_its_consequence_and_names_no_outlier(collector):
    # A diverging job: rank 0's own gradients stood out at 20 (an outlier); the all-reduced update reached every
    # rank, whose own norms then spike in turn (rank 1 at 22, rank 0 again at 25 after rank 1's): none of those is
    # an outlier. A spike past outlier_after_iterations of quiet is judged again.
    client, _ = collector
    job = Job(client, "row-3b", 2, means=[1.0, 1.0])
    job.report(0, 20, job.spike(0, 20, 100.0))
    job.report(1, 20)
    job.report(1, 22, job.spike(1, 22, 100.0))
    job.report(0, 22)
    job.report(0, 25, job.spike(0, 25, 100.0))
    job.report(1, 25)
    later = 22 + T.outlier_after_iterations + 1  # rank 1's last spike is outlier_after_iterations + 1 before it
    job.report(0, later, job.spike(0, later, 100.0))
    job.report(1, later)
    assert [(e["rank"], e["iteration"]) for e in job.outliers()] == [(0, 20), (0, later)]
    assert (job.counted(0), job.counted(1)) == (2, 0)


def test_a_spike_near_the_end_is_compared_with_the_last_levels_of_ranks_that_closed_without_waiting(collector):
    # The other ranks closed (the job ended) before the spike's batch came: their last levels are the reference,
    # and none of them is waited for (a closed rank reports no further iteration).
    client, _ = collector
    job = Job(client, "closed-others", 3, means=[1.0, 1.0, 1.0], iteration=298)
    for rank in (1, 2):
        batch = make_batch(run=job.run, rank=rank, world_size=3, local_rank=rank, host=f"{job.run}-host",
                           incarnation=f"{rank:032x}", process_key=f"{rank:032x}", seq=2, iteration=299, closed=True,
                           optimizers={"gen": optimizer(steps=299, local_grad_norm={"mean": 1.0, "std": 0.1})})
        assert client.post("/v1/ingest", json=batch).json() == APPLIED
    job.report(0, 299, job.spike(0, 299, 100.0))
    assert [(e["rank"], e["iteration"]) for e in job.outliers()] == [(0, 299)]


def test_row_4_a_non_finite_spike_of_one_rank_alone_is_an_outlier(collector):
    client, _ = collector
    job = Job(client, "row-4", 4, means=[1.0] * 4)
    for rank in range(4):
        job.report(rank, 11, *([job.spike(rank, 11, "Infinity")] if rank == 1 else []))
    [event] = job.outliers()
    assert (event["rank"], event["value"], event["z"], event["reference"]) == (1, "Infinity", None, 1.0)
    assert job.counted(1) == 1


_AT = 2.0 + T.outlier_sigma * MAD_SCALE  # the median of the others' means + outlier_sigma spreads


@pytest.mark.parametrize(("spiked", "outlier"), [(_AT + 0.1, True), (_AT - 0.4, False)])
def test_rows_5_and_6_an_outlier_stands_robust_deviations_above_the_median_of_the_others_means(collector, spiked,
                                                                                               outlier):
    client, _ = collector
    # Others' means 1, 2, 3: median 2, MAD 1, spread 1.4826 (above their deviations, 0.1): the line is _AT.
    job = Job(client, f"row-5-{outlier}", 4, means=[1.0, 2.0, 3.0, 2.5])
    for rank in range(4):
        job.report(rank, 11, *([job.spike(rank, 11, spiked)] if rank == 3 else []))
    found = job.outliers()
    assert job.counted(3) == int(outlier)
    if outlier:
        [event] = found
        assert event["reference"] == 2.0 and event["spread"] == pytest.approx(MAD_SCALE)
        assert event["z"] == pytest.approx((spiked - 2.0) / MAD_SCALE) and event["ranks_compared"] == 3
        assert (event["rank"], event["optimizer"], event["iteration"], event["value"]) == (3, "gen", 11, spiked)
    else:
        assert found == []


def test_row_5_the_spread_is_at_least_the_median_of_the_others_deviations(collector):
    client, _ = collector
    # Every other rank at mean 1 (MAD 0) with deviation 2: 100 is 49.5 deviations up; 12 only 5.5.
    for run, spiked, outliers in (("row-5-std-far", 100.0, 1), ("row-5-std-near", 12.0, 0)):
        job = Job(client, run, 4, means=[1.0] * 4, stds=2.0)
        for rank in range(4):
            job.report(rank, 11, *([job.spike(rank, 11, spiked)] if rank == 0 else []))
        assert job.counted(0) == outliers, run


def test_row_7_a_spike_sent_again_is_judged_once(collector):
    client, _ = collector
    job = Job(client, "row-7", 4, means=[1.0] * 4)
    spike = job.spike(0, 11, 100.0)
    sent = job.report(0, 11, spike)
    job.report(0, 11, again=sent)  # a retried batch
    job.report(0, 12, spike)  # the agent sent it again in its next batch (its answer was lost)
    for rank in (1, 2, 3):
        job.report(rank, 12)
    assert len(job.outliers()) == 1 and job.counted(0) == 1
    # Rank 0's process restarted from a checkpoint and spiked at iteration 11 again: that iteration was judged.
    restarted = make_batch(run="row-7", rank=0, world_size=4, host="row-7-host", incarnation="f" * 32,
                           process_key="f" * 32, seq=1, iteration=11, events=[dict(spike, id=1)],
                           optimizers={"gen": optimizer(steps=11, local_grad_norm={"mean": 1.0, "std": 0.1})})
    assert client.post("/v1/ingest", json=restarted).json() == APPLIED
    for rank in (1, 2, 3):
        job.report(rank, 13)
    assert len(job.outliers()) == 1 and job.counted(0) == 1


def test_an_outlier_is_listed_beside_the_agents_events_counted_and_fires_its_alert(collector):
    client, _ = collector
    job = Job(client, "listed", 4, means=[1.0] * 4)
    for rank in range(4):
        job.report(rank, 11, *([job.spike(rank, 11, 100.0)] if rank == 2 else []))
    kinds = [e["kind"] for e in client.get("/v1/runs/listed/events").json()["events"]]
    assert kinds == ["grad_norm_spike", "gradient_outlier"]
    latest = client.get("/v1/runs/listed/events/latest").json()["rows"]
    assert [row["event"]["kind"] for row in latest] == ["gradient_outlier", "grad_norm_spike"]
    assert job.counted(2) == 1 and job.counted(0) == 0
    assert [r["gradient_outliers"] for r in client.get("/v1/runs/listed").json()["ranks"]] == [0, 0, 1, 0]
    firing = client.get("/v1/alerts", params={"alertname": "AmpRankGradientOutlier", "run": "listed"}).json()
    assert [a["labels"]["rank"] for a in firing["firing"]] == ["2"]


def test_a_device_whose_outliers_had_different_samples_is_a_suspect_each_event_counted_once(collector):
    client, _ = collector
    job = Job(client, "outlier-device", 4, means=[1.0] * 4)
    for iteration in (11, 12, 13):
        for rank in range(4):
            events = []
            if rank == 1:
                events.append(job.spike(1, iteration, 100.0, ids=[f"d-{iteration}-a", f"d-{iteration}-b"]))
            if iteration == 13:  # its gradients overflowed too: every rank skipped, rank 1 the origin
                events.append(skip_event(next(job.ids), iteration=iteration, origin=rank == 1,
                                         samples=samples([f"d-{iteration}-{rank}"])))
            job.report(rank, iteration, *events)
    assert len(job.outliers()) == 3
    def judged() -> dict | None:  # the judge's answer may be a few milliseconds behind the evidence
        devices = client.get("/v1/suspects", params={"run": "outlier-device"}).json()["devices"]
        return devices if devices and "skip" in {e["kind"] for e in devices[0]["evidence"]} else None
    [device] = wait_until(judged, what="the outlier device judged a suspect with its skip")
    assert (device["device"], device["events"]) == ("outlier-device-host:1", 3)
    # Its skip and its outlier at iteration 13 are one event of one origin: three events, not four (rule 13).
    assert device["sole_origin_events"] == 3 and device["iterations"] == 3, device
    assert {e["kind"] for e in device["evidence"]} == {"gradient_outlier", "skip"}


def test_the_outlier_count_survives_a_restart_of_the_collector(config_for):
    config = config_for()
    with TestClient(create_app(config)) as client:
        job = Job(client, "restart", 2, means=[1.0, 1.0])
        job.report(0, 11, job.spike(0, 11, 100.0))
        job.report(1, 11)
        assert job.counted(0) == 1
    with TestClient(create_app(config)) as client:
        assert value(client.get("/metrics").text, "ampwatch_rank_gradient_outliers_total", run="restart",
                     rank="0") == 1
        assert [e["kind"] for e in client.get("/v1/runs/restart/events").json()["events"]] == \
            ["grad_norm_spike", "gradient_outlier"]


def test_row_2_a_spike_of_a_run_that_went_quiet_is_judged_by_the_periodic_pass(config_for):
    clock = Clock()
    # silent_after 0.4 s: the collector's periodic pass runs every 0.1 s (it judges what waited long enough).
    with TestClient(create_app(config_for(silent_after=0.4), clock=clock)) as client:
        job = Job(client, "quiet", 3, means=[1.0] * 3, iteration=5)
        job.report(1, 11, job.spike(1, 11, 100.0))
        assert job.outliers() == []
        clock.now += WAIT_S + 1  # no rank sends again
        wait_until(job.outliers, what="the quiet run's spike judged")
        assert job.counted(1) == 1


def test_a_real_collector_names_the_rank_whose_gradients_stood_out_over_http(tmp_path):
    from ampwatch_support.collector_process import CollectorProcess
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector, \
            httpx.Client(base_url=collector.url, timeout=30) as http:
        job = Job(http, "over-http", 4, means=[1.0, 1.1, 0.9, 1.0])
        for rank in range(4):  # rank 3's own gradients were x1,000 in iteration 11; the others' were not
            job.report(rank, 11, *([job.spike(rank, 11, 1000.0, ids=[7, 8])] if rank == 3 else []))
        [event] = job.outliers()
        assert (event["rank"], event["iteration"], event["ranks_compared"], event["reference"]) == (3, 11, 3, 1.0)
        assert [job.counted(rank) for rank in range(4)] == [0, 0, 0, 1]
        firing = http.get("/v1/alerts", params={"alertname": "AmpRankGradientOutlier"}).json()["firing"]
        assert [(a["labels"]["run"], a["labels"]["rank"]) for a in firing] == [("over-http", "3")]
