"""A run lives on one replica: real gloo DDP ranks with the real agent, several real collectors.

The rule is ``ampwatch.contract.placement``'s (its docstring is the table); what these tests prove end to end:

| the job (real gloo DDP ranks) | where its ranks' counters end up |
|---|---|
| 4 ranks, 3 collectors, the default block | all on ``ranking(run, urls)[0]``; the others hold none |
| 4 ranks, blocks of 2 (``AMPWATCH_BLOCK_RANKS=2``), the node relay on | ranks 0-1 and 2-3 each on their block's |
|  | collector, gathered by the host's one relay; the third collector holds none |
| 2 ranks, blocks of 1, rank 0's collector down at the start | rank 1 on its collector at once; rank 0 retried |
|  | until its collector is back on the same port, then complete there; no other one ever holds it |
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Iterator

import pytest

from ampwatch.contract import placement
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import fewer_requests, requests_and_batches, samples, scrape, value
from ampwatch_support.patience import START_S
from ampwatch_support.ports import free_port
from ampwatch_support.rank_processes import RankProcess, check_rank_truth, kill_all, spawn_rank, wait_for

pytestmark = pytest.mark.slow

# A DDP rank trains until the stop file exists (the ranks agree on it with an all-reduce, so they stop at the same
# iteration); every 10th iteration rank 0's input holds an inf, which DDP carries to every rank: all skip.
RANK = """
import gc, json, os, pathlib, sys, threading, time
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from ampwatch import agent
urls, run, stop, out = sys.argv[1:5]
torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu", growth_interval=100_000)  # the scale moves only by backoffs
watch = agent.watch(scaler, {"main": opt}, ddp=model, collector=urls, run=run, push_interval=0.05)
data = torch.Generator().manual_seed(rank)
truth = {"iterations": 0, "skipped_at": [], "steps": 0, "backoffs": 0, "growths": 0}
stopping = torch.zeros(1)
while not stopping.item():
    x = torch.randn(16, 8, generator=data)
    if rank == 0 and truth["iterations"] % 10 == 9:
        x[0, 0] = float("inf")
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    before = scaler.get_scale()
    scaler.update()
    if scaler.get_scale() < before:
        truth["skipped_at"].append(truth["iterations"])
        truth["backoffs"] += 1
    else:
        truth["steps"] += 1
    truth["iterations"] += 1
    if truth["iterations"] % 20 == 0 and any(t.name == "ampwatch-relay" for t in threading.enumerate()):
        pathlib.Path(out, "relay" + str(rank)).touch()
    time.sleep(0.02)
    stopping[0] = float(os.path.exists(stop))
    dist.all_reduce(stopping, op=dist.ReduceOp.MAX)
watch.close(timeout=20)
pathlib.Path(out, "truth" + str(rank) + ".json").write_text(json.dumps(truth))
del model
gc.collect()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def collectors(tmp_path_factory) -> Iterator[list[str]]:
    """Three real collectors, each on its own free port."""
    folder = tmp_path_factory.mktemp("collectors")
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(CollectorProcess(str(folder / f"c{i}.db"))).url for i in range(3)]


@contextlib.contextmanager
def _job(urls: list[str], run: str, tmp: pathlib.Path, world: int,
         env: dict[str, str] | None = None) -> Iterator[dict[int, RankProcess]]:
    """Start a ``world``-rank gloo DDP job reporting to ``urls``; kill any rank still running at the end."""
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "AMPWATCH_RELAY_DIR": str(tmp / "relay")}
    ranks = {r: spawn_rank(RANK, ",".join(urls), run, str(tmp / "stop"), str(tmp), rank=r, world_size=world,
                           env={**master, **(env or {})})
             for r in range(world)}
    try:
        yield ranks
    finally:
        kill_all(ranks.values())


def _finish(ranks: dict[int, RankProcess], tmp: pathlib.Path) -> dict[int, dict]:
    """Stop the job; return each rank's ground truth."""
    (tmp / "stop").touch()
    truths = {}
    for rank, proc in ranks.items():
        out, _ = proc.communicate(timeout=START_S)
        assert proc.returncode == 0, out[-3000:]
        truths[rank] = json.loads((tmp / f"truth{rank}.json").read_text())
    return truths


def _held(url: str, run: str) -> set[int]:
    """The ranks of ``run`` the collector at ``url`` has any series of."""
    return {int(labels["rank"]) for (_, labelset) in samples(scrape(url))
            for labels in [dict(labelset)] if labels.get("run") == run and "rank" in labels}


def _reported(url: str, run: str, ranks: range | list[int], past: int = 0) -> bool:
    """Whether the collector has an iteration past ``past`` from each of ``ranks``."""
    text = scrape(url)
    return all((value(text, "ampwatch_iteration", run=run, rank=str(r)) or 0) > past for r in ranks)


def _placed(run: str, world: int, urls: list[str], block_ranks: int) -> dict[str, list[int]]:
    """Each collector's ranks of ``run`` by the contract's placement (none: an empty list)."""
    held: dict[str, list[int]] = {url: [] for url in urls}
    for block in placement.blocks(run, world, urls, block_ranks):
        held[block.collector] += range(block.first_rank, block.last_rank + 1)
    return held


def _check_placed(run: str, world: int, urls: list[str], block_ranks: int, truths: dict[int, dict]) -> None:
    """Every rank's counters exactly on the collector placement names for it; no other collector holds the rank."""
    for url, ranks in _placed(run, world, urls, block_ranks).items():
        assert _held(url, run) == set(ranks), f"{url} holds ranks {_held(url, run)} of {run}, placement says {ranks}"
        text = scrape(url)
        for rank in ranks:
            check_rank_truth(text, run, rank, truths[rank])


def test_every_rank_of_a_ddp_run_reports_to_the_one_collector_that_ranks_first_for_the_run(collectors, tmp_path):
    run, world = "placed-whole", 4
    first = placement.ranking(run, collectors)[0]
    with _job(collectors, run, tmp_path, world) as ranks:
        wait_for(lambda: _reported(first, run, range(world), past=20), START_S,
                 f"every rank to report 20 iterations (two skips) to {first}")
        truths = _finish(ranks, tmp_path)
    assert all(truth["skipped_at"] for truth in truths.values()), "the job ended before its first skip"
    _check_placed(run, world, collectors, placement.BLOCK_RANKS, truths)
    assert _placed(run, world, collectors, placement.BLOCK_RANKS)[first] == [0, 1, 2, 3]


def test_a_ddp_run_in_blocks_of_two_lands_block_by_block_through_one_node_relay(collectors, tmp_path):
    # One host, two blocks: the relay posts ranks 0-1 to one collector and ranks 2-3 to another.
    run, world, block_ranks = "placed-blocks", 4, 2
    placed = _placed(run, world, collectors, block_ranks)
    first, second = (url for url, ranks in placed.items() if ranks)
    before = {url: requests_and_batches(url) for url in (first, second)}
    # Spelled otherwise, the same collectors: the relay finds the URL placement names among its own.
    spelled = [url.replace("http://", "HTTP://") + "/" for url in collectors]
    with _job(spelled, run, tmp_path, world, env={"AMPWATCH_BLOCK_RANKS": str(block_ranks),
                                                  "AMPWATCH_RELAY": "1"}) as ranks:
        wait_for(lambda: _reported(first, run, placed[first], 20) and _reported(second, run, placed[second], 20),
                 START_S, "each block to report 20 iterations (two skips) to its collector")
        # Gathered: a request to each block's collector carried both of the block's ranks' batches.
        wait_for(lambda: list(tmp_path.glob("relay?"))
                 and all(fewer_requests(url, since=before[url]) for url in (first, second)), START_S,
                 "a rank to run the relay, and it to carry each block's two batches in one request")
        truths = _finish(ranks, tmp_path)
    assert len(list(tmp_path.glob("relay?"))) == 1, "exactly one rank relayed for the host"
    assert sorted([placed[first], placed[second]]) == [[0, 1], [2, 3]]
    _check_placed(run, world, collectors, block_ranks, truths)


def test_ranks_whose_collector_is_down_wait_for_it_and_arrive_complete_when_it_comes_back(collectors, tmp_path):
    # A fourth collector, down at the start; a run whose block 0 (rank 0) it holds, block 1 (rank 1) on another.
    late = CollectorProcess(str(tmp_path / "late.db"))
    urls = [*collectors, late.url]
    run = next(r for r in (f"placed-down-{i}" for i in range(200)) if placement.ranking(r, urls)[0] == late.url)
    other = placement.ranking(run, urls)[1]
    with _job(urls, run, tmp_path, 2, env={"AMPWATCH_BLOCK_RANKS": "1"}) as ranks:
        # Rank 1 reports on; rank 0 (a batch every 0.05 s) keeps failing against its collector meanwhile.
        wait_for(lambda: _reported(other, run, [1], past=50), START_S,
                 "rank 1 to report 50 iterations while rank 0's collector is down")
        assert all(_held(url, run) <= {1} for url in collectors), "rank 0 went to another replica"
        with late:  # back on the same port
            wait_for(lambda: _reported(late.url, run, [0]), START_S, "rank 0 to reach its collector once it is up")
            truths = _finish(ranks, tmp_path)
            failures = value(scrape(late.url), "ampwatch_agent_send_failures_total", run=run, rank="0")
            assert failures and failures > 0, "rank 0 never failed to reach its collector"
            _check_placed(run, 2, urls, 1, truths)
