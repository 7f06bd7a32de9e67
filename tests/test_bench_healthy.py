"""The healthy-run bench (bench/healthy.py): the simulated ranks' issue-40 batches are what the contract declares, and
the bench measures every shape against a real collector that takes them all.

The bench's ratios are only worth something while its levelled batches carry exactly the contract's levels, with
the contract's types, rounded as the agent rounds them: a level the contract adds, renames or retypes fails here
before it makes the bench measure a shape no agent sends.
"""

from __future__ import annotations

import json
import typing

import pytest

from ampwatch.contract.batch import OptimizerCounters, RankState, SignalLevel, fields
from ampwatch.server._batch_parse import parse_batch
from bench import healthy
from bench._rank_batch import SCALER, batch_body, open_identity, with_levels
from bench.experiments._fleet_plan import Plan
from bench.report import healthy as healthy_report


def _levels(part: type) -> set[str]:
    """The fields of ``part`` the contract types as a rolling level (SignalLevel)."""
    return {name for name, kind in typing.get_type_hints(part).items() if kind is SignalLevel}


def test_the_simulated_ranks_add_exactly_the_contracts_levels_typed_and_rounded_as_the_agent_sends_them():
    level_types = typing.get_type_hints(SignalLevel)
    for rank, iteration in ((0, 1), (5, 5000), (2047, 123_456)):
        today = Plan(0.0, 1.0, []).batch_state(iteration)
        levelled = with_levels(today, rank, iteration)
        # today's batches hold no level and no spike counter: the "today" side of the bench is today's shape
        assert not _levels(RankState) & set(today)
        assert set(levelled) - set(today) == _levels(RankState) == {"loss"}
        assert set(levelled["optimizers"]) == set(today["optimizers"]) == {"gen", "disc"}
        levels = [levelled[name] for name in _levels(RankState)]
        for name, counters in levelled["optimizers"].items():
            assert set(counters) - set(today["optimizers"][name]) == _levels(OptimizerCounters)
            assert set(counters) <= set(fields(OptimizerCounters))  # declared, and no spike counter while 0 ...
            levels += [counters[key] for key in _levels(OptimizerCounters)]
        assert set(levelled) <= set(fields(RankState))
        assert "loss_spikes" not in levelled and all("grad_norm_spikes" not in c
                                                     for c in levelled["optimizers"].values())
        assert len(levels) == 5  # the loss, and per optimizer (2) its gradient norm and its local one
        for level in levels:
            assert set(level) == set(fields(SignalLevel))
            assert all(type(level[key]) is level_types[key] for key in level)  # float, as declared
            assert level["std"] >= 0 and all(float(f"{v:.4g}") == v for v in level.values())  # 4 significant digits
        # the collector's own parser reads the body the simulated ranks send, levels included, as sent
        body = batch_body(open_identity("levels", rank, 2048), {"seq": 3, "sent_at": 1764400000.5, "scaler": SCALER,
                                                                 "state": levelled, "events": [], "closed": False})
        read = parse_batch(body).state
        assert (read.loss.mean, read.loss.std) == (levelled["loss"]["mean"], levelled["loss"]["std"])
        for name, counters in read.optimizers.items():
            for key in _levels(OptimizerCounters):
                sent = levelled["optimizers"][name][key]
                assert (getattr(counters, key).mean, getattr(counters, key).std) == (sent["mean"], sent["std"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_healthy_bench_measures_each_shape_on_a_real_collector_that_takes_every_batch():
    # --before: today's batches also go to a collector from `git archive` of a commit (here this one), at once
    result = healthy.run(ranks=16, heartbeats=2, rounds=1, heartbeat=1.0, before="HEAD")
    sides = result["rounds"][0]["sides"]
    assert set(sides) == set(healthy.SHAPES) | {"today at HEAD"}
    assert sides["today at HEAD"]["server"] == "HEAD" and sides["today"]["server"] is None
    assert set(result["ratios_vs_before"]) == set(healthy.SHAPES)
    for side in sides.values():
        assert side["refused"] == {} and side["timeouts"] == 0 and side["requests"] >= 16
        assert side["scrapes"] >= 1 and side["scrapes_failed"] == 0
    # the levels went on the wire: every batch of "levels", some of "levels_every_4th", none of "today"
    assert (sides["today"]["levelled_share"], sides["levels"]["levelled_share"]) == (0, 1)
    assert 0 < sides["levels_every_4th"]["levelled_share"] < 1
    today, every, some = (sides[n]["bytes_per_exchange"] for n in ("today", "levels", "levels_every_4th"))
    assert today < some < every
    assert result["exchange"]["levels"]["agent_body_bytes"] > result["exchange"]["today"]["agent_body_bytes"]
    assert set(result["ratios"]) == {"levels", "levels_every_4th"}
    page = "\n".join(healthy_report.section(result) + healthy_report.summary_rows(result))
    assert "x today" in page and "levels_every_4th" in page and "on the collector of HEAD" in page
    json.dumps(result)  # what python -m bench stores


def test_the_answers_kinds_are_counted_once_on_the_levels_side_whichever_collector_lists_them():
    def side(wire: int, lists: bool, server: str | None = None) -> dict:
        return {"wire_bytes": wire, "requests": 10, "healthy_s": 1.0, "answer_lists_kinds": lists, "server": server,
                "wire_kib_per_rank_hour": wire, "collector_cpu_us_per_rank_s": 1.0}

    kinds = 44
    # this tree's collector lists none yet: projected onto the levels' side
    projected = healthy._ratios({"today": side(1000, False), "levels": side(1200, False)}, kinds)["levels"]
    # it lists them in every answer: measured on both sides, taken off today's (today's collector sent none)
    measured = healthy._ratios({"today": side(1440, True), "levels": side(1640, True)}, kinds)["levels"]
    # an earlier collector (--before) sent none, this tree's lists them: counted as measured, once
    before = healthy._ratios({"today at x": side(1000, False, "x"), "levels": side(1640, True)}, kinds,
                             base="today at x")["levels"]
    assert projected["wire_ratio"] == 1.2 and projected["wire_ratio_with_kinds"] == 1.64
    assert measured["wire_ratio_with_kinds"] == before["wire_ratio_with_kinds"] == 1.64
