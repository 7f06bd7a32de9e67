"""One request per node (AMPWATCH_RELAY=1): the ranks of a host hand their batches to one relay.

Each rank is a real process with the real agent and a real GradScaler; the relay is a real Unix socket;
the collector is a real one (this tree's, or an earlier commit's that knows only protocol v1).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import signal
import stat
from collections.abc import Callable, Container, Iterator

import httpx
import pytest

from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import fewer_requests, requests_and_batches, scrape, value
from ampwatch_support.older_collector import V1_ONLY, older_collector
from ampwatch_support.patience import SETTLE_S, START_S
from ampwatch_support.rank_processes import RankProcess, check_rank_truth, kill_all, spawn_rank, wait_for

pytestmark = pytest.mark.slow


# A rank trains until told to stop; it leaves a file "relay<rank>" once it runs the host's relay.
RANK = """
import json, os, pathlib, sys, threading
from ampwatch_support.fault_training import Trainer
url, run, stop, out, rank = sys.argv[1:6]
trainer = Trainer(collector=url, run=run, push_interval=0.05)
while not os.path.exists(stop):
    trainer.step("train")
    if trainer.iteration % 20 == 0 and any(t.name == "ampwatch-relay" for t in threading.enumerate()):
        pathlib.Path(out, "relay" + rank).touch()
trainer.watch.close(timeout=20)
pathlib.Path(out, "truth" + rank + ".json").write_text(json.dumps(trainer.truth()))
"""


@contextlib.contextmanager
def _ranks(url: str, run: str, tmp: pathlib.Path, world: int,
           relayed: Container[int]) -> Iterator[dict[int, RankProcess]]:
    """Start ``world`` ranks, those in ``relayed`` with the node relay on; kill any still running at the end."""
    ranks = {r: spawn_rank(RANK, url, run, str(tmp / "stop"), str(tmp), str(r), rank=r, world_size=world,
                           env={"AMPWATCH_RELAY": "1" if r in relayed else "0",
                                "AMPWATCH_RELAY_DIR": str(tmp / "relay")})
             for r in range(world)}
    try:
        yield ranks
    finally:
        kill_all(ranks.values())


def _finish(ranks: dict[int, RankProcess], tmp: pathlib.Path, ended: Container[int] = ()) -> dict[int, dict]:
    """Stop the ranks still running; return each one's ground truth. Only those in ``ended`` may have ended before."""
    (tmp / "stop").touch()
    truths = {}
    for rank, proc in ranks.items():
        if rank in ended:
            continue
        out, _ = proc.communicate(timeout=START_S)
        assert proc.returncode == 0, out[-3000:]
        truths[rank] = json.loads((tmp / f"truth{rank}.json").read_text())
    return truths


def _iteration(url: str, run: str, rank: int) -> float | None:
    """The rank's iteration as the collector has it (None before its first batch)."""
    return value(scrape(url), "ampwatch_iteration", run=run, rank=str(rank))


def _all_reported(url: str, run: str, world: int) -> bool:
    """Whether the collector has an iteration past 0 from each of the ``world`` ranks."""
    return all(_iteration(url, run, r) for r in range(world))


def _relay_rank(url: str, run: str, tmp: pathlib.Path, world: int) -> int:
    """Wait until a rank runs the host's relay and every rank has reported; return the relay's rank."""
    wait_for(lambda: list(tmp.glob("relay?")) and _all_reported(url, run, world), START_S,
             "every rank to report, and one of them to run the relay")
    return int(next(tmp.glob("relay?")).name[-1])


def _wait_past(url: str, run: str, ranks: list[int], iterations: int) -> None:
    """Wait until each of ``ranks`` has reported more than ``iterations`` iterations past where it is now."""
    before = {r: _iteration(url, run, r) for r in ranks}
    wait_for(lambda: all(_iteration(url, run, r) > before[r] + iterations for r in ranks),
             what=f"ranks {ranks} to report {iterations} more iterations")


def _check_exact(url: str, run: str, rank: int, truth: dict) -> None:
    """The collector shows exactly the rank's truth, and each of its events once."""
    check_rank_truth(scrape(url), run, rank, truth)
    skips, after = [], 0
    while after is not None:
        page = httpx.get(f"{url}/v1/runs/{run}/events", params={"limit": 1000, "rank": rank, "kind": "skip",
                                                                "after": after}, timeout=10).json()
        skips += [e["iteration"] for e in page["events"]]
        after = page["next"]
    assert skips == truth["skipped_at"], "a skip event is missing or doubled"


def _run_and_check_exact(url: str, run: str, tmp: pathlib.Path, world: int, relayed: Container[int],
                         gathered: Callable[[], bool] | None = None, what: str = "") -> None:
    """Run ``world`` ranks until every one has reported and ``gathered()`` holds (when given), stop them, and
    check the collector shows each exactly.

    The relay gathers the batches that reach it within one push; on a loaded machine the ranks may miss
    each other for a while, so the test waits for the gathering it proves rather than counting a window.
    """
    with _ranks(url, run, tmp, world, relayed) as ranks:
        wait_for(lambda: _all_reported(url, run, world), START_S, "every rank to report")
        if gathered is not None:
            wait_for(gathered, START_S, what)
        truths = _finish(ranks, tmp)
    for rank, truth in truths.items():
        _check_exact(url, run, rank, truth)


def test_the_ranks_of_a_host_post_through_one_relay_in_fewer_requests_with_exact_counts(tmp_path):
    run, world = "relayed", 4
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        _run_and_check_exact(collector.url, run, tmp_path, world, relayed=range(world),
                             gathered=lambda: fewer_requests(collector.url, 0.75),
                             what="the relay to carry the ranks' batches in under 0.75 requests per batch")
        requests, batches = requests_and_batches(collector.url)
    relays = sorted(p.name for p in tmp_path.glob("relay?"))
    socket_dir = tmp_path / "relay"
    print(f"\n{batches:.0f} batches of {world} ranks in {requests:.0f} requests; relay: {relays}")
    assert len(relays) == 1, "exactly one rank relayed for the host"
    assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
    assert not list(socket_dir.glob("*.sock")), "the relay removed its socket when it closed"
    assert requests < batches, "the relay did not gather several ranks' batches per request"


def test_killing_the_relay_rank_mid_job_leaves_the_other_ranks_totals_exact_and_a_new_relay_takes_over(tmp_path):
    run, world = "relay-killed", 3
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--expire-after", "120"]) as collector:
        with _ranks(collector.url, run, tmp_path, world, relayed=range(world)) as ranks:
            killed = _relay_rank(collector.url, run, tmp_path, world)
            ranks[killed].send_signal(signal.SIGKILL)  # mid-job: no close(), no exit flush, batches in flight
            ranks[killed].wait(SETTLE_S)
            (tmp_path / f"relay{killed}").unlink()
            survivors = [r for r in range(world) if r != killed]
            wait_for(lambda: list(tmp_path.glob("relay?")), what="a surviving rank to take the relay over")
            takeover = requests_and_batches(collector.url)
            # The new relay gathers batches again: a request carries several. Waited for, not counted over a
            # window: on a loaded machine a rank's batch may miss the other's for a while.
            wait_for(lambda: fewer_requests(collector.url, since=takeover),
                     what="a request through the new relay carrying several ranks' batches")
            after = requests_and_batches(collector.url)
            _wait_past(collector.url, run, survivors, 50)
            truths = _finish(ranks, tmp_path, ended={killed})
        for rank in survivors:
            _check_exact(collector.url, run, rank, truths[rank])
        assert value(scrape(collector.url), "ampwatch_rank_closed", run=run, rank=str(killed)) == 0
    new_relay = [p.name for p in tmp_path.glob("relay?")]
    print(f"\nrelay rank {killed} killed; {new_relay} took over; after it: "
          f"{after[1] - takeover[1]:.0f} batches in {after[0] - takeover[0]:.0f} requests")
    assert len(new_relay) == 1 and int(new_relay[0][-1]) in survivors


def test_v1_agents_and_a_v2_relay_report_exactly_into_one_collector(tmp_path):
    run, world = "mixed", 4
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        _run_and_check_exact(collector.url, run, tmp_path, world, relayed=range(2),
                             gathered=lambda: fewer_requests(collector.url),
                             what="a request through the relay carrying both relayed ranks' batches")
        requests, batches = requests_and_batches(collector.url)
    print(f"\n{batches:.0f} batches in {requests:.0f} requests (2 relayed ranks, 2 posting v1)")
    assert len(list(tmp_path.glob("relay?"))) == 1
    assert requests < batches


def test_a_relay_against_a_collector_that_knows_only_v1_falls_back_to_v1_with_exact_counts(tmp_path):
    run, world = "old-collector", 3
    env = older_collector(V1_ONLY, tmp_path / "old", "the last collector that knows only protocol v1")
    with CollectorProcess(str(tmp_path / "ampwatch.db"), env=env) as collector:
        schema = httpx.post(collector.url + "/v1/ingest", content=b'{"protocol":2,"lengths":[],"batches":[]}',
                            headers={"content-type": "application/json"}, timeout=10)
        assert schema.status_code == 422, "this collector must refuse protocol v2"
        _run_and_check_exact(collector.url, run, tmp_path, world, relayed=range(world))
        text = scrape(collector.url)
        requests, batches = requests_and_batches(collector.url)
    refused = value(text, "ampwatch_collector_ingest_requests_total", code="422") - 1  # less the probe above
    print(f"\nthe v1-only collector refused {refused:.0f} v2 request(s); then {batches:.0f} batches went as v1 "
          f"in {requests:.0f} requests")
    # Each relay tries v2 once, then keeps to v1 (one more relay may take over while the ranks close).
    assert 1 <= refused <= world - 1
    assert requests == batches, "every batch the old collector took came alone, as v1"
    for rank in range(world):
        assert value(text, "ampwatch_agent_rejected_batches_total", run=run, rank=str(rank)) == 0


def test_a_stopped_relay_rank_is_bypassed_and_the_other_ranks_keep_reporting_exactly(tmp_path):
    run, world = "relay-stopped", 3
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        with _ranks(collector.url, run, tmp_path, world, relayed=range(world)) as ranks:
            stopped = _relay_rank(collector.url, run, tmp_path, world)
            ranks[stopped].send_signal(signal.SIGSTOP)  # alive, holding its lock, answering nobody
            others = [r for r in range(world) if r != stopped]
            _wait_past(collector.url, run, others, 50)
            ranks[stopped].send_signal(signal.SIGCONT)
            truths = _finish(ranks, tmp_path)
        for rank, truth in truths.items():
            _check_exact(collector.url, run, rank, truth)
    print(f"\nrelay rank {stopped} stopped; ranks {others} kept reporting past it")
