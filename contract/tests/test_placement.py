"""The placement rule of ``ampwatch.contract.placement``: one test per row of its table."""

from __future__ import annotations

import collections

import pytest

from ampwatch.contract.placement import BLOCK_RANKS, blocks, collector_for, normalize, ranking

URLS = [f"http://c{i}:9457" for i in range(1, 4)]
RUNS = [f"run-{i}" for i in range(600)]


def test_no_collector_listed_places_nothing():
    with pytest.raises(ValueError, match="no collector configured"):
        collector_for("r", 0, 4, [])
    with pytest.raises(ValueError, match="no collector configured"):
        blocks("r", 4, ["  "])


def test_one_collector_takes_every_rank_of_every_run():
    assert {collector_for(run, rank, 20_000, ["http://only:1"], block_ranks=1_000)
            for run in RUNS[:20] for rank in (0, 999, 1_000, 19_999)} == {"http://only:1"}


def test_a_run_within_one_block_goes_whole_to_its_first_ranked_collector():
    for run in RUNS[:50]:
        placed = {collector_for(run, rank, BLOCK_RANKS, URLS) for rank in range(0, BLOCK_RANKS, 97)}
        assert placed == {ranking(run, URLS)[0]}
    firsts = collections.Counter(ranking(run, URLS)[0] for run in RUNS)
    assert set(firsts) == set(URLS) and min(firsts.values()) > len(RUNS) / len(URLS) * 0.75  # spread over all


def test_a_bigger_run_goes_in_contiguous_blocks_spread_over_the_ranking():
    world, size = 20_001, 4_000
    found = blocks("huge", world, URLS, block_ranks=size)
    assert [(b.first_rank, b.last_rank) for b in found] == [
        (0, 3_999), (4_000, 7_999), (8_000, 11_999), (12_000, 15_999), (16_000, 19_999), (20_000, 20_000)]
    order = ranking("huge", URLS)
    assert [b.collector for b in found] == [order[i % 3] for i in range(6)]
    for rank in (0, 3_999, 4_000, 12_345, 20_000):  # every rank is in exactly one block, and placed with it
        (block,) = [b for b in found if rank in b]
        assert collector_for("huge", rank, world, URLS, block_ranks=size) == block.collector
    assert sum(b.last_rank - b.first_rank + 1 for b in found) == world


def test_the_list_is_a_set_of_normalized_urls():
    shuffled = [URLS[2] + "/", " " + URLS[0].upper().replace("HTTP", "http"), URLS[1], URLS[1]]
    assert normalize("HTTP://C1:9457/") == "http://c1:9457"
    for run in RUNS[:100]:
        assert ranking(run, shuffled) == ranking(run, URLS)
        assert collector_for(run, 3, 8, shuffled) == collector_for(run, 3, 8, URLS)


def test_adding_a_collector_moves_only_the_runs_it_ranks_first_for():
    bigger = URLS + ["http://c4:9457"]
    moved = [run for run in RUNS if collector_for(run, 0, 8, URLS) != collector_for(run, 0, 8, bigger)]
    assert all(collector_for(run, 0, 8, bigger) == "http://c4:9457" for run in moved)
    assert 0.15 < len(moved) / len(RUNS) < 0.35  # about 1 in n + 1 = 4


def test_removing_a_collector_moves_only_the_runs_it_held():
    smaller = URLS[:2]
    for run in RUNS:
        before = collector_for(run, 0, 8, URLS)
        if before in smaller:
            assert collector_for(run, 0, 8, smaller) == before


@pytest.mark.parametrize("rank, world, size", [(-1, 8, 4), (8, 8, 4), (0, 0, 4), (0, 8, 0), (True, 8, 4)])
def test_a_rank_outside_the_world_or_a_bad_size_is_refused(rank, world, size):
    with pytest.raises(ValueError):
        collector_for("r", rank, world, URLS, block_ranks=size)
