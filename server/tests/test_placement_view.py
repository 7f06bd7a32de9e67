"""The collector's view of where each run it holds is placed (``_placement_view``), and what a split run's alerts add.

Every row of the module's table: no ``--peers``, a whole run, a split run, a misplaced rank; and what the view must
never do: disagree with the agents' rule, or grow with a world size the agents made up.
"""

from __future__ import annotations

import itertools
import logging

import pytest

from ampwatch.contract.placement import blocks, collector_for
from ampwatch.server._placement_view import BLOCKS_LISTED, Placements, RunPlacement
from ampwatch.server.alerting.alert import Alert
from ampwatch.server.alerting.annotations import BlockTexts
from ampwatch.server.alerting.payloads import slack_body, webhook_body

PEERS = ("http://c1:9457", "http://c2:9457", "http://c3:9457")


@pytest.mark.parametrize("world_size, block_ranks, peers", [
    (world, block, PEERS[:n]) for world, block, n in itertools.product((1, 2, 5, 8, 9, 20), (1, 4, 8), (1, 2, 3))])
def test_the_view_of_each_collector_is_the_agents_rule(world_size, block_ranks, peers):
    rule = blocks("exp-7", world_size, peers, block_ranks)
    held = set()
    for here in peers:
        view = RunPlacement.of("exp-7", world_size, peers, here, block_ranks)
        assert view.blocks == rule and view.block_count == len(rule) and view.split == (len(rule) > 1)
        mine = {rank for rank in range(world_size) if view.holds(rank)}
        assert mine == {r for r in range(world_size) if collector_for("exp-7", r, world_size, peers, block_ranks)
                        == here}
        assert not mine & held and view.held_ranks == len(mine)
        held |= mine
    assert held == set(range(world_size))  # every rank belongs to exactly one collector


def test_a_made_up_world_size_lists_a_bounded_number_of_blocks_at_once():
    view = RunPlacement.of("huge", 10**9, PEERS, PEERS[0], 1)
    assert view.block_count == 10**9 and len(view.blocks) == BLOCKS_LISTED
    assert view.holds(10**9 - 1) == (collector_for("huge", 10**9 - 1, 10**9, PEERS, 1) == PEERS[0])
    assert f"{10**9 - BLOCKS_LISTED} more blocks not listed" in view.texts()["other_blocks"]


def test_without_peers_nothing_is_placed_or_counted():
    placements = Placements((), None, 2)
    placements.note("exp", 3, 4)
    assert not placements.enabled and placements.of("exp") is None and placements.to_json("exp") is None
    assert placements.alert_block("exp") is None and placements.misplaced("exp") == 0


def test_a_whole_run_adds_nothing_to_its_alerts_and_a_split_run_names_its_blocks():
    here = collector_for("whole", 0, 2, PEERS, 2)
    placements = Placements(PEERS, here, 2)
    placements.note("whole", 0, 2)
    assert placements.alert_block("whole") is None
    assert placements.to_json("whole")["blocks"] == [
        {"index": 0, "first_rank": 0, "last_rank": 1, "collector": here, "here": True}]

    first = collector_for("split", 0, 5, PEERS, 2)
    placements = Placements(PEERS, first, 2)
    placements.note("split", 0, 5)
    label, texts = placements.alert_block("split")
    assert label == "1" and texts["block"] == "ranks 0-1 of 5 (block 1 of 3)"
    others = [b for b in blocks("split", 5, PEERS, 2) if b.collector != first]
    assert texts["other_blocks"] == "; ".join(
        f"block {b.index + 1} (ranks {b.first_rank}-{b.last_rank}): {b.collector}/#run=split" for b in others)


def test_misplaced_ranks_are_counted_once_each_logged_once_per_run_and_judged_again_when_the_world_changes(caplog):
    here = collector_for("exp", 0, 8, PEERS, 2)
    placements = Placements(PEERS, here, 2)
    away = [rank for rank in range(8) if collector_for("exp", rank, 8, PEERS, 2) != here]
    assert away
    with caplog.at_level(logging.WARNING, logger="ampwatch.server"):
        for _ in range(3):
            for rank in range(8):
                placements.note("exp", rank, 8)
    assert placements.misplaced("exp") == len(away)
    assert len([r for r in caplog.records if "misplaced_ranks" in r.getMessage()]) == 1
    placements.note("exp", 0, 2)  # the run shrank to one block (elastic): rank 0's block is now the whole run
    assert placements.of("exp").world_size == 2 and not placements.of("exp").split
    assert placements.misplaced("exp") == int(collector_for("exp", 0, 2, PEERS, 2) != here)
    placements.keep(set())
    assert placements.of("exp") is None and placements.misplaced("exp") == 0


def test_a_split_runs_notifications_carry_its_block_and_the_other_blocks():
    texts = BlockTexts({"summary": "Most ranks skip", "description": "50% of run r.", "runbook_url": "u"},
                       {"block": "ranks 0-1 of 4 (block 1 of 2)", "other_blocks": "block 2 (ranks 2-3): http://c2/#run=r",
                        "summary": " [ranks 0-1 of 4 (block 1 of 2) on this replica]", "description": " Other: c2."})
    assert dict(texts) == {"summary": "Most ranks skip [ranks 0-1 of 4 (block 1 of 2) on this replica]",
                           "description": "50% of run r. Other: c2.", "runbook_url": "u",
                           "block": "ranks 0-1 of 4 (block 1 of 2)",
                           "other_blocks": "block 2 (ranks 2-3): http://c2/#run=r"}
    alert = Alert(name="AmpRunSkipStorm", labels={"run": "r", "severity": "warning"}, annotations=texts,
                  starts_at=1.0)
    assert webhook_body([alert])["alerts"][0]["annotations"] == dict(texts)
    slack = slack_body([alert])["blocks"][0]["text"]["text"]
    assert "other_blocks: block 2 (ranks 2-3): http://c2/#run=r" in slack and "block: ranks 0-1 of 4" in slack


def test_a_gradient_spike_on_most_of_a_split_runs_ranks_here_is_the_jobs_not_an_outlier(tmp_path):
    """The gradient-outlier rule's whole-job share (``outlier_rank_share`` of the run's ranks) is judged over the
    ranks of the run this collector holds: 2 of the 4 ranks of its block spiking is the job, as in a 4-rank run,
    although 2 of the run's 8 ranks would not be more than the share."""
    from fastapi.testclient import TestClient

    from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
    from ampwatch.server import ServerConfig, create_app
    from ampwatch_support.batches import APPLIED, make_batch, optimizer

    assert 2 > T.outlier_rank_share * 4 and not 2 > T.outlier_rank_share * 8
    here = collector_for("split-8", 0, 8, PEERS[:2], 4)
    config = ServerConfig(db=str(tmp_path / "ampwatch.db"), allowed_hosts=("testserver",), peers=PEERS[:2],
                          advertise_url=here, block_ranks=4)
    with TestClient(create_app(config)) as client:
        for iteration in (10, 11):
            for rank in range(4):
                spike = {"id": 1, "kind": "grad_norm_spike", "time": 1.0, "iteration": 11, "optimizer": "gen",
                         "local": True, "value": 100.0, "mean": 1.0, "std": 0.1, "z": 990.0, "streak": 1}
                batch = make_batch(run="split-8", rank=rank, world_size=8, local_rank=rank, host="h",
                                   incarnation=f"{rank:032x}", seq=iteration, iteration=iteration,
                                   optimizers={"gen": optimizer(steps=iteration,
                                                                local_grad_norm={"mean": 1.0, "std": 0.1})},
                                   events=[spike] if iteration == 11 and rank < 2 else [])
                assert client.post("/v1/ingest", json=batch).json() == APPLIED
        placement = client.get("/v1/runs/split-8/placement").json()["placement"]
        assert placement["split"] and placement["misplaced_ranks"] == 0  # ranks 0-3: the block placed here
        events = client.get("/v1/runs/split-8/events", params={"kind": "gradient_outlier"}).json()["events"]
        assert events == []


def test_a_split_run_with_no_block_here_says_so_in_its_alerts():
    held = {b.collector for b in blocks("split", 4, PEERS, 2)}  # 2 blocks on 3 collectors: one holds none
    (idle,) = set(PEERS) - held
    view = RunPlacement.of("split", 4, PEERS, idle, 2)
    assert view.split and view.held_ranks == 0 and view.label() == "none"
    assert view.texts()["block"] == "no block placed here of the 4 ranks (2 blocks)"
    assert all(url in view.texts()["other_blocks"] for url in held)
