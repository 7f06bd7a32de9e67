"""Real DDP over gloo with 2 and 4 processes: the rank whose own gradients held the inf is named (issue 17)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ddp_harness import run_ranks  # noqa: E402
from ddp_origin_worker import ITERATIONS, injections  # noqa: E402

WORKER = Path(__file__).with_name("ddp_origin_worker.py")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request, tmp_path_factory) -> list[dict]:
    """Run the N-rank worker once (bounded in time, whole process group killed on timeout)."""
    world_size = request.param
    out = tmp_path_factory.mktemp(f"origin{world_size}")
    return run_ranks(WORKER, out, world_size, [str(world_size)], timeout=300, what=f"{world_size}-rank")


def origin_iterations(run: dict) -> list[int]:
    return [e["iteration"] for e in run["skips"] if e["origin"]]


def test_the_rank_fed_an_inf_is_the_only_origin_and_every_rank_still_skips(ranks):
    plan = injections(len(ranks))
    skipped = sorted(plan)
    expected = [i not in plan for i in range(ITERATIONS)]
    for rank, result in enumerate(ranks):
        run = result["origin"]
        # Every rank skips, exactly as without the hook: the all-reduce spread the inf.
        assert run["truth"] == run["reported"] == expected == result["plain"]["reported"]
        assert [e["iteration"] for e in run["skips"]] == skipped
        assert run["state"]["optimizers"] == result["plain"]["state"]["optimizers"]
        mine = [i for i in skipped if rank in plan[i]]
        assert origin_iterations(run) == mine
        assert run["state"]["origin_iterations"] == len(mine)
        for event in run["skips"]:
            if event["origin"]:  # the bucket's parameters, named by the model
                assert event["origin_buckets"] and event["origin_params_total"] >= len(event["origin_params"]) > 0
                assert set(event["origin_params"]) <= {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight",
                                                       "4.bias"}
            else:
                assert event["origin_buckets"] == event["origin_params"] == [] and event["origin_params_total"] == 0


def test_two_origins_in_one_iteration_are_both_reported(ranks):
    both = [i for i, owners in injections(len(ranks)).items() if len(owners) == 2]
    assert both
    for iteration in both:
        owners = {r for r, result in enumerate(ranks) if iteration in origin_iterations(result["origin"])}
        assert owners == set(injections(len(ranks))[iteration])


def test_clean_iterations_report_no_origin_and_cost_no_extra_sync(ranks):
    for result in ranks:
        clean = result["clean_origin"]
        assert all(clean["reported"]) and clean["skips"] == [] and clean["state"]["origin_iterations"] == 0
        assert clean["syncs"] == result["clean_plain"]["syncs"]
        assert clean["syncs"] > 0  # the counter works: the scaler reads found_inf once per step


def test_training_is_bit_identical_with_and_without_the_hook(ranks):
    for result in ranks:
        assert result["origin"]["bits"] == result["plain"]["bits"]
        assert result["clean_origin"]["bits"] == result["clean_plain"]["bits"]


def test_a_user_comm_hook_is_wrapped_and_still_runs(ranks):
    plan = injections(len(ranks))
    for rank, result in enumerate(ranks):
        run = result["user_hook"]
        assert run["hook_calls"] >= ITERATIONS  # at least one bucket per iteration went through the user's hook
        assert run["bits"] == result["plain"]["bits"]  # the user's hook is DDP's all-reduce: same training
        assert origin_iterations(run) == [i for i in sorted(plan) if rank in plan[i]]


def test_a_model_with_a_hook_already_registered_is_refused_with_what_to_do(ranks):
    for result in ranks:
        already = result["already"]
        assert already["error"] and "comm_hook=" in already["error"] and "allreduce_hook" in already["error"]
        assert already["scaler_patched"] is False  # watch() left nothing behind
