"""Real DDP over gloo with 2, 3 and 4 processes: the rank whose own gradients held the inf is named (issue 17).

With DDP's default (``gradient_as_bucket_view=False``) the hook takes the fused path at 2, 3 and 4 ranks (the
check rides DDP's own scaling); at 3 ranks with ``gradient_as_bucket_view=True`` it takes the aminmax one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ddp_harness import run_ranks  # noqa: E402
from ddp_origin_worker import ITERATIONS, injections  # noqa: E402

WORKER = Path(__file__).with_name("ddp_origin_worker.py")

pytestmark = pytest.mark.slow


def _run(world_size: int, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp(f"origin{world_size}")
    return run_ranks(WORKER, out, world_size, [str(world_size)], timeout=300, what=f"{world_size}-rank")


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request, tmp_path_factory) -> list[dict]:
    """Run the N-rank worker once (bounded in time, whole process group killed on timeout)."""
    return _run(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> list[dict]:
    """The worker with 3 ranks: a world size that is not a power of two."""
    return _run(3, tmp_path_factory)


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


def test_at_a_power_of_two_world_size_without_a_user_hook_the_fused_path_is_taken(ranks):
    """DDP's own all-reduce at 2 and 4 ranks: the check rides its division, no aminmax pass over any bucket;
    a user's hook (even one that calls DDP's all-reduce) keeps the aminmax pass and the hook's own division."""
    for result in ranks:
        for name in ("origin", "clean_origin", "bf16_origin", "fp16_origin"):
            assert result[name]["fused"] is True, name
            assert result[name]["hook_aminmax_calls"] == 0, name
        user = result["user_hook"]
        assert user["fused"] is False and user["hook_aminmax_calls"] >= user["hook_calls"] >= ITERATIONS


def test_fused_training_is_bit_identical_gradient_for_gradient_including_the_skipped_steps(ranks):
    """Every iteration's reduced gradients (the skipped ones, holding inf/NaN, included) and the final weights
    are bit for bit those of DDP's built-in all-reduce and of DDP's allreduce_hook as a Python hook."""
    plan = injections(len(ranks))
    for result in ranks:
        origin = result["origin"]
        assert [finite for _, finite in origin["grads"]] == [i not in plan for i in range(ITERATIONS)]
        for reference in ("plain", "python_hook"):
            assert origin["grads"] == result[reference]["grads"], reference
            assert origin["bits"] == result[reference]["bits"], reference


def test_bf16_and_fp16_buckets_on_the_fused_path_reduce_bit_identically_and_name_the_origin(ranks):
    """bfloat16 and float16 weights, so bfloat16 and float16 gradient buckets (gloo all-reduces both).
    bfloat16 trains with the GradScaler; GradScaler refuses to unscale float16 gradients, so float16 runs a
    plain backward and SGD (the agent watching, the hook fused): there only the gradients and weights are
    compared."""
    plan = injections(len(ranks))
    for rank, result in enumerate(ranks):
        for dtype in ("bf16", "fp16"):
            origin = result[f"{dtype}_origin"]
            assert [finite for _, finite in origin["grads"]] == [i not in plan for i in range(ITERATIONS)], dtype
            for reference in ("plain", "python_hook"):
                assert origin["grads"] == result[f"{dtype}_{reference}"]["grads"], (dtype, reference)
                assert origin["bits"] == result[f"{dtype}_{reference}"]["bits"], (dtype, reference)
        bf16 = result["bf16_origin"]
        assert bf16["truth"] == bf16["reported"] == [i not in plan for i in range(ITERATIONS)]
        assert origin_iterations(bf16) == [i for i in sorted(plan) if rank in plan[i]]


def _assert_origins(run: dict, rank: int, plan: dict) -> None:
    assert run["truth"] == run["reported"] == [i not in plan for i in range(ITERATIONS)]
    assert origin_iterations(run) == [i for i in sorted(plan) if rank in plan[i]]
    assert [finite for _, finite in run["grads"]] == [i not in plan for i in range(ITERATIONS)]


def test_three_ranks_with_ddps_default_take_the_fused_path_and_train_bit_for_bit_as_ddps_builtin(three_ranks):
    """3 is not a power of two, but with gradient_as_bucket_view=False (DDP's default) DDP's built-in
    all-reduce multiplies every gradient by float32(1/3) while copying it into its bucket, and so does the
    fused kernel: no aminmax pass, the origin named, and every iteration's reduced gradients (the skipped
    ones included) and the final weights bit for bit the built-in's, in float32, bfloat16 and float16.
    (DDP's allreduce_hook divides by 3: in float32 its gradients differ from the built-in's here, which is
    what makes this comparison tell multiplying from dividing.)"""
    plan = injections(3)
    for rank, result in enumerate(three_ranks):
        for name in ("origin", "clean_origin", "bf16_origin", "fp16_origin"):
            assert result[name]["fused"] is True, name
            assert result[name]["hook_aminmax_calls"] == 0, name
        _assert_origins(result["origin"], rank, plan)
        _assert_origins(result["bf16_origin"], rank, plan)
        for prefix in ("", "bf16_", "fp16_"):
            origin, plain = result[f"{prefix}origin"], result[f"{prefix}plain"]
            assert [finite for _, finite in origin["grads"]] == [i not in plan for i in range(ITERATIONS)], prefix
            assert origin["grads"] == plain["grads"] and origin["bits"] == plain["bits"], prefix
        assert result["clean_origin"]["bits"] == result["clean_plain"]["bits"]
        assert result["clean_origin"]["syncs"] == result["clean_plain"]["syncs"]
    assert any(result["python_hook"]["grads"] != result["plain"]["grads"] for result in three_ranks)


def test_three_ranks_float64_buckets_are_multiplied_as_ddps_builtin_does_not_by_the_kernels_float32(three_ranks):
    """The fused kernel's reciprocal is float32; the built-in multiplies a float64 gradient by the float64
    1/3. So at 3 ranks a float64 bucket keeps one aminmax pass and is multiplied by 1/3 by the hook
    (``mul_``, the built-in's scalar), then all-reduced by it: the origin named, gradients and weights bit for
    bit the built-in's."""
    for rank, result in enumerate(three_ranks):
        _assert_aminmax_run(result["fp64_origin"], rank, fused=True, reference=result["fp64_plain"])


def test_three_ranks_with_gradient_as_bucket_view_take_the_aminmax_path_and_train_as_ddps_allreduce_hook(
        three_ranks):
    """With gradient_as_bucket_view=True DDP's built-in scales gradients two ways: it multiplies one by
    float32(1/3) while copying it into its bucket (the first iteration, and every iteration after
    ``zero_grad()``'s default ``set_to_none=True``) and divides in place, by 3, one that already is its bucket
    view (``zero_grad(set_to_none=False)``). A comm hook sees the bucket, not which of the two it would have
    been, so at 3 ranks the hook keeps its aminmax pass and DDP's allreduce_hook (which divides): the origin
    named, training bit for bit that of allreduce_hook as a Python hook without the agent, not always the
    built-in's."""
    for rank, result in enumerate(three_ranks):
        _assert_aminmax_run(result["view_origin"], rank, fused=False, reference=result["view_python_hook"])


def test_three_ranks_with_batched_grad_copy_take_the_aminmax_path_and_train_as_ddps_builtin(three_ranks):
    """With batched_grad_copy=True (torch 2.13) DDP's built-in divides each whole bucket by 3 once it is
    filled, as allreduce_hook does: at 3 ranks the hook keeps its aminmax pass and allreduce_hook, the origin
    named, and training is bit for bit the built-in's (the fused kernel's multiply would not be)."""
    if "batched_origin" not in three_ranks[0]:
        pytest.skip("this torch's DistributedDataParallel has no batched_grad_copy")
    for rank, result in enumerate(three_ranks):
        _assert_aminmax_run(result["batched_origin"], rank, fused=False, reference=result["batched_plain"])


def _assert_aminmax_run(run: dict, rank: int, *, fused: bool, reference: dict) -> None:
    """A 3-rank run whose buckets were noted by aminmax (every iteration): ``fused`` as said, the origin named
    on the injected rank only, every iteration's reduced gradients and the weights bit for bit ``reference``'s."""
    assert run["fused"] is fused and run["hook_aminmax_calls"] >= ITERATIONS
    _assert_origins(run, rank, injections(3))
    assert run["grads"] == reference["grads"] and run["bits"] == reference["bits"]
