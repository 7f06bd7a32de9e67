"""Real DDP over gloo with two processes: who skips, on which rank (and ShardedGradScaler is accepted); bf16."""

from __future__ import annotations

import pytest

from ampwatch_support.ddp_harness import run_ranks

WORKER = "ampwatch_support.ddp_worker"
INJECT_AT = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run the two-rank worker once (bounded in time, whole process group killed on timeout)."""
    out = tmp_path_factory.mktemp("ddp")
    return run_ranks(WORKER, out, 2, timeout=120, what="two-rank")


pytestmark = pytest.mark.slow


def test_inf_on_one_ddp_rank_makes_every_rank_skip(ranks):
    expected = [i != INJECT_AT for i in range(4)]
    for rank in ranks:
        ddp = rank["ddp"]
        assert ddp["truth"] == expected and ddp["reported"] == expected
        assert ddp["state"]["optimizers"]["net"]["skipped"] == 1
        assert ddp["state"]["backoffs"] == 1 and ddp["state"]["loss_scale"] == ddp["scale"] == 32768.0


def test_inf_on_one_rank_with_independent_models_skips_only_that_rank(ranks):
    rank0, rank1 = (r["independent"] for r in ranks)
    assert rank0["truth"] == rank0["reported"] == [True] * 4
    assert rank1["truth"] == rank1["reported"] == [i != INJECT_AT for i in range(4)]
    assert (rank0["state"]["backoffs"], rank1["state"]["backoffs"]) == (0, 1)


def test_sharded_grad_scaler_is_accepted_and_its_all_reduced_skips_are_reported(ranks):
    expected = [i != INJECT_AT for i in range(4)]
    for rank in ranks:
        sharded = rank["sharded"]
        assert sharded["scaler"]["kind"] == "ShardedGradScaler"
        # ShardedGradScaler all-reduces found_inf, so the rank without the inf skips too.
        assert sharded["truth"] == sharded["reported"] == expected
        assert sharded["state"]["backoffs"] == 1 and sharded["state"]["loss_scale"] == sharded["scale"]


def test_ddp_in_bf16_without_a_scaler_reports_every_rank_s_poisoned_steps_and_trains_as_before(ranks):
    for rank in ranks:
        run = rank["unscaled"]
        # Rank 1's inf, all-reduced, reached both ranks' gradients and then their weights: every step from there.
        assert run["poisoned"] == list(range(INJECT_AT, 4))
        assert run["state"]["optimizers"]["net"]["poisoned_steps"] == len(run["poisoned"])
        assert [e["iteration"] for e in run["events"]] == [INJECT_AT, INJECT_AT + 1]  # the run's 1st and 2nd
        assert {p["name"] for p in run["events"][0]["params"]} == {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert run["state"]["delivery"]["agent_errors"] == 0
        assert run["bits"] == rank["unscaled_plain"]["bits"]


def test_ddp_in_bf16_names_the_rank_whose_own_gradients_poisoned_the_step(ranks):
    for r, rank in enumerate(ranks):
        first, second = rank["unscaled"]["events"]
        # Only rank 1's input held the inf; from the next step on both ranks' weights, so their own gradients, are NaN.
        assert first["origin"] is (r == 1) and second["origin"] is True
        assert first["origin_params_total"] == (len(first["origin_params"]) if r == 1 else 0)
        assert ("0.weight" in first["origin_params"]) is (r == 1)
        poisoned = len(rank["unscaled"]["poisoned"])
        assert rank["unscaled"]["state"]["origin_iterations"] == (poisoned if r == 1 else poisoned - 1)
