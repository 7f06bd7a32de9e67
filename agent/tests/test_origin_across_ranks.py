"""watch(..., ddp=model) over two real gloo ranks: the origin rank in recipes that used to hide it.

The scenarios are ``ampwatch_support.origin_worker``'s (its docstring says each); every one also runs unwatched, and the
weights after every iteration must be that twin's bit for bit. The truth is where the inf was planted: an
iteration skips on every rank, and only the rank whose own gradient held it is its origin.
"""

from __future__ import annotations

import pytest

from ampwatch.contract.protocol import MAX_PARAMS
from ampwatch_support.ddp_harness import run_ranks
from ampwatch_support.origin_worker import SCENARIOS, WORLD_SIZE

WORKER = "ampwatch_support.origin_worker"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run the worker once (bounded in time, whole process group killed on timeout): each rank's results."""
    return run_ranks(WORKER, tmp_path_factory.mktemp("origin"), WORLD_SIZE, timeout=240, what="origin")


def _origins(ranks: list[dict], scenario: str) -> list[dict[int, tuple]]:
    """Per rank: iteration -> (origin, origin_params, origin_params_total) of its skips or poisoned steps."""
    return [{i: (origin, params, total) for i, origin, params, total in rank[scenario]["watched"]["origins"]}
            for rank in ranks]


def _planted(ranks: list[dict], scenario: str) -> dict[int, int]:
    return {int(i): r for i, r in ranks[0][scenario]["watched"]["planted"].items()}


def _origin_ranks(ranks: list[dict], scenario: str) -> dict[int, list[int]]:
    """Iteration -> the ranks that reported themselves its origin (every planted iteration skipped everywhere)."""
    per_rank = _origins(ranks, scenario)
    for origins in per_rank:
        assert set(_planted(ranks, scenario)) <= set(origins), (scenario, origins)
    return {i: [r for r, origins in enumerate(per_rank) if origins[i][0]] for i in per_rank[0]}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_trains_bit_for_bit_as_its_unwatched_twin_and_nothing_failed(ranks, scenario):
    for rank in ranks:
        watched, twin = rank[scenario]["watched"], rank[scenario]["twin"]
        assert watched["digests"] == twin["digests"] and watched["errors"] == 0


@pytest.mark.parametrize("scenario", ["unfrozen", "unfrozen_unscaled"])
def test_a_parameter_frozen_at_watch_and_unfrozen_later_names_the_rank_whose_own_gradient_held_the_inf(
        ranks, scenario):
    """DDP, built while ``extra`` was trainable, reduces it once unfrozen: the inf in rank 0's own gradient of it,
    at the very iteration it was unfrozen, names rank 0 (and rank 1 two iterations later, with a scaler)."""
    planted = _planted(ranks, scenario)
    assert _origin_ranks(ranks, scenario) == {i: [r] for i, r in planted.items()}
    for r, origins in enumerate(_origins(ranks, scenario)):
        for i in planted:
            if planted[i] == r:
                assert origins[i][1:] == (["extra.weight"], 1)


def test_the_forward_pre_hook_that_waits_for_frozen_parameters_comes_off_at_close_with_every_other(ranks):
    """head.bias stays frozen to the end, so the pre-hook is still waiting for it when the watch closes."""
    for rank in ranks:
        watched = rank["unfrozen"]["watched"]
        assert watched["pre_hooks"] == [1, 0] and watched["hooks_left"] == 0
        assert rank["unfrozen"]["twin"]["pre_hooks"] == [0, 0]


def test_a_parameter_trainable_at_watch_and_frozen_later_breaks_nothing_and_is_noted_again_once_unfrozen(ranks):
    origin_ranks = _origin_ranks(ranks, "frozen_later")
    assert origin_ranks == {3: [1], 5: [0]}
    rank0, rank1 = _origins(ranks, "frozen_later")
    assert "extra.weight" not in rank1[3][1] and rank1[3][2] >= 1  # the body's inf, extra frozen
    assert rank0[5][1:] == (["extra.weight"], 1)


@pytest.mark.parametrize("scenario", ["micro_sync", "micro_no_sync"])
def test_an_inf_in_the_first_micro_batch_stays_this_rank_s_when_later_ones_outnumber_any_iteration_before(
        ranks, scenario):
    """2 backwards in the first iteration, 4 in a later one (more than ever: the notes' rows grow after the inf's
    row was written); each time the first micro-batch's inf is the origin's, with and without ``no_sync()``."""
    assert _origin_ranks(ranks, scenario) == {0: [0], 2: [1]}


def test_more_than_16_parameters_holding_the_inf_name_16_and_count_them_all(ranks):
    (origin, params, total), = _origins(ranks, "many")[0].values()
    assert origin and len(params) == MAX_PARAMS and total == ranks[0]["many"]["watched"]["nonfinite_grads"] == 20
    assert _origins(ranks, "many")[1][1] == (False, [], 0)


def test_origin_parameters_carry_the_names_the_watch_was_given_not_ddp_s_or_the_module_s(ranks):
    (_, params, _), = _origins(ranks, "many")[0].values()
    assert params == ranks[0]["many"]["watched"]["given"][:MAX_PARAMS]  # encoder.0.weight, ...: in model order


def test_the_origin_describes_the_gradient_after_the_job_s_hooks_registered_before_the_watch_only(ranks):
    """docs/agent.md: the note is taken as autograd hands the gradient to the parameter's tensor hooks, after the
    ones registered before ``watch()`` and before those registered after it. head.bias's hook (before): rank 1
    is iteration 1's origin. body.bias's hook (after): iteration 3 skips on every rank and names no origin, as
    an inf made in the reduction would. A watch made after both hooks: rank 0 is iteration 5's origin."""
    assert _origin_ranks(ranks, "late_hook") == {1: [1], 3: [], 5: [0]}
    rank0, rank1 = _origins(ranks, "late_hook")
    assert rank1[1][1:] == (["head.bias"], 1) and rank0[5][1:] == (["body.bias"], 1)
