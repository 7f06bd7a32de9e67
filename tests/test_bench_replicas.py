"""The 2-replica sides of ``bench.replicas`` (section 9b), run small: a 64-rank job in blocks of 32 on 2 real
collectors, and replica 0 alone with its share in a whole-job storm; and the 100,000-GPU model of docs/collector.md.

One run, several checks: each replica gets exactly the block the contract's placement names and nothing else
(its own ``/metrics``), each is pinned to a core of its own, each one's built-in alerts fire for its own storm
ranks, every first skip is answered, the cores used are reported, and the section renders the targets per replica.
Nothing here is timed: the figures are checked for what they count, not how fast they came.
"""

from __future__ import annotations

import os

import pytest

from ampwatch.contract.placement import BLOCK_RANKS, blocks
from bench import replicas
from bench.report import replicas as report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(os.cpu_count() is None or os.cpu_count() < 2, reason="pins 2 replicas to 2 cores")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_replicas_each_get_their_block_by_the_contract_on_their_own_core_and_alert_for_their_own_ranks():
    result = replicas.run(64, block_ranks=32, heartbeat=1.0, healthy_s=2, storm_s=9, iteration_s=0.25,
                          sides=("replicas", "alone_lockstep"))
    side = result["sides"]["replicas"]
    assert side["collectors"] == 2 and side["ranks_per_collector"] == 32
    urls = [r["url"] for r in side["replicas"]]
    expected = {b.collector: (b.first_rank, b.last_rank) for b in blocks("fleet", 64, urls, 32)}
    for core, r in enumerate(side["replicas"]):
        assert (r["first_rank"], r["last_rank"]) == expected[r["url"]] and r["ranks"] == 32, r
        # Its own /metrics shows every rank of its block and none of the other's.
        assert r["ranks_in_metrics"] == 32 and r["foreign_ranks_in_metrics"] == 0, r
        assert r["pinned_to"] == [core], r  # every thread of the collector, read back
        # Its storm ranks' first skips were all answered, and its own alerts named each of them.
        assert r["storm_ranks"] > 0 and r["first_skips_not_visible_by_end"] == 0, r
        assert r["rung16_to_builtin_alert"]["n"] == r["storm_ranks"] and r["streak_alerts_missing"] == 0, r
        assert r["healthy_latency"]["n"] > 0 and r["cpu_cores"]["healthy"] > 0, r
    assert sum(r["storm_ranks"] for r in side["replicas"]) == side["storm"]["storm_ranks"]
    assert side["storm"]["scrape_disagreements"] == 0 and side["refused"] == {} and side["timeouts"] == 0
    assert side["silence"]["last_batch_to_alert_s"] is not None and side["silence"]["other_ranks_silent"] == 0
    use = side["usage"]["healthy"]
    assert use["simulation"] > 0 and len(use["collectors"]) == 2 and use["machine"] >= sum(use["collectors"])
    page = "\n".join(report.section(result))
    for core, r in enumerate(side["replicas"]):
        assert f"replica {core} (ranks {r['first_rank']}-{r['last_rank']}): healthy ingest p99 < 100 ms" in page
    assert "each replica held one block of 32 ranks" in page
    # The second figure: replica 0 alone with its share, the simulation on the other core, in a whole-job storm,
    # where the run's AmpRunSkipStorm speaks for each rank's streak alert (theirs are held back).
    alone = result["sides"]["alone_lockstep"]
    assert alone["ranks"] == 32 and alone["job_ranks"] == 64 and alone["simulation_pinned_to"] == [1]
    (only,) = alone["replicas"]
    assert only["index"] == 0 and only["pinned_to"] == [0] and only["ranks_in_metrics"] == 32, only
    share = next(b for b in blocks("fleet", 64, alone["collector_urls"], 32) if b.collector == only["url"])
    assert only["foreign_ranks_in_metrics"] == 0 and (only["first_rank"], only["last_rank"]) == (share.first_rank,
                                                                                               share.last_rank)
    assert only["url"] == alone["collector_urls"][0]
    assert only["streak_alerts_missing"] == 0 and alone["storm"]["storm_ranks"] == only["storm_ranks"] > 0


def test_the_100000_gpu_model_in_collector_md_is_what_the_model_prints_from_the_contract():
    from bench.experiments import model_100k

    text = open(os.path.join(ROOT, "docs", "collector.md")).read()
    shown = text.split("<!-- model_100k: python -m bench.experiments.model_100k -->\n", 1)[1]
    shown = shown.split("<!-- end model_100k -->", 1)[0].strip("\n").splitlines()
    assert shown == model_100k.table(), "rerun python -m bench.experiments.model_100k into docs/collector.md"
    # The replicas are the blocks the contract's placement makes of such a job.
    figures = model_100k.model(100_000)
    urls = [f"http://c{i}:9457" for i in range(figures["blocks"])]
    assert len({b.collector for b in blocks("big", 100_000, urls)}) == figures["blocks"] == -(-100_000 // BLOCK_RANKS)


def test_the_block_size_line_says_how_many_blocks_each_replica_held():
    """The run of record (docs/benchmarks.json): 16,384 ranks in blocks of 4,096 on 2 replicas, 2 blocks each."""
    import json

    with open(os.path.join(ROOT, "docs", "benchmarks.json")) as f:
        result = json.load(f)["replicas"]
    assert result["settings"]["ranks"] == 16_384 and result["settings"]["block_ranks"] == BLOCK_RANKS == 4_096
    page = "\n".join(report.section(result))
    assert "Block size: each replica held 2 blocks of 4,096 ranks (8,192 ranks) of this job (2 replicas:" in page
