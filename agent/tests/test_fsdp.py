"""Real FSDP2 (``fully_shard``) over gloo with 2 and 4 processes, with a GradScaler and without one.

One worker run per world size holds every scenario (``ampwatch_support.fsdp_worker``); each rank's ground truth
is its own shards' bits and gradients.
"""

from __future__ import annotations

import pytest

from ampwatch_support import fsdp_plain_first_worker as mixed
from ampwatch_support.ddp_harness import run_ranks
from ampwatch_support.fsdp_worker import FED, PLANTED, SAVE_AFTER, STEPS, UNSCALED_PLANTED, UNSCALED_SAVE_AFTER

WORKER = "ampwatch_support.fsdp_worker"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]  # the 4-rank run: about a minute, far more when loaded


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request, tmp_path_factory) -> list[dict]:
    """Run the N-rank worker once (bounded in time, whole process group killed on timeout)."""
    out = tmp_path_factory.mktemp(f"fsdp{request.param}")
    return run_ranks(WORKER, out, request.param, [str(request.param)], timeout=600, what=f"{request.param}-rank FSDP2")


def rows(rank: int, world_size: int, total: int = 16) -> str:
    """The slice of dimension 0 that ``rank`` holds of a ``total``-row parameter (FSDP2 shards dimension 0)."""
    size = total // world_size
    return f"{rank * size}:{(rank + 1) * size}"


def kinds(run: dict, kind: str) -> list[dict]:
    return [e for e in run["events"] if e["kind"] == kind]


def test_with_a_scaler_every_rank_reports_its_skips_and_backoffs_exactly(ranks):
    skipped = sorted([*FED, *PLANTED])
    for result in ranks:
        run = result["scaled"]
        assert run["reported"] == run["truth"] == [step not in skipped for step in range(STEPS)]
        assert [e["iteration"] for e in kinds(run, "skip")] == skipped
        counters = run["state"]["optimizers"]["net"]
        assert (counters["steps"], counters["skipped"], run["state"]["backoffs"]) == (STEPS - 2, 2, 2)
        assert run["state"]["delivery"]["agent_errors"] == 0  # the scan reads shards: no internal error


def test_a_skip_names_the_parameters_of_the_shards_that_held_the_inf(ranks):
    world_size = len(ranks)
    (planted_step, planter), = PLANTED.items()
    for rank, result in enumerate(ranks):
        fed, planted = kinds(result["scaled"], "skip")
        # Fed into a micro-batch without gradient sync: the reduce-scatter spreads it into every rank's shards.
        assert fed["iteration"] in FED and fed["params_total"] == 6
        assert f"0.weight shard [{rows(rank, world_size)}, 0:8]" in [p["name"] for p in fed["params"]]
        # Planted into one rank's shard: every rank skips (the scaler all-reduces found_inf), only it names.
        assert planted["iteration"] == planted_step
        if rank == planter:
            assert planted["params"] == [{"name": f"2.weight shard [{rows(rank, world_size)}, 0:16]",
                                          "inf": 1, "nan": 0}]
        else:
            assert planted["params"] == [] and planted["params_total"] == 0 and planted["inspected"]


def test_without_a_scaler_each_rank_reports_the_steps_its_own_shards_poisoned(ranks):
    world_size = len(ranks)
    (planted_step, planter), = UNSCALED_PLANTED.items()
    for rank, result in enumerate(ranks):
        run = result["unscaled"]
        truth = result["unscaled"]["poisoned"]
        # The planting rank's step is poisoned at once; the NaN weights reach every rank at the next all-gather.
        assert truth == list(range(planted_step if rank == planter else planted_step + 1, STEPS))
        assert run["state"]["optimizers"]["net"]["poisoned_steps"] == len(truth)
        events = kinds(run, "poisoned_step")
        assert [(e["iteration"], e["streak"]) for e in events] == [(truth[k - 1], k) for k in (1, 2, 4)
                                                                   if k <= len(truth)]
        if rank == planter:
            assert events[0]["params"] == [{"name": f"2.weight shard [{rows(rank, world_size)}, 0:16]",
                                            "inf": 1, "nan": 0}]
        assert run["scaler"]["kind"] == "none" and run["state"]["loss_scale"] is None
        assert run["state"]["delivery"]["agent_errors"] == 0


def test_training_is_bit_identical_with_and_without_the_agent(ranks):
    for result in ranks:
        # The spike watch was on (loss, and each step's gradient norm: grad_norm=True) and read its values.
        scaled = result["scaled"]["state"]
        assert "loss" in scaled and "grad_norm" in scaled["optimizers"]["net"]
        assert "grad_norm" in result["unscaled"]["state"]["optimizers"]["net"]
        assert result["scaled"]["bits"] == result["scaled_plain"]["bits"]
        assert result["scaled"]["scales"] == result["scaled_plain"]["scales"]
        assert result["unscaled"]["bits"] == result["unscaled_plain"]["bits"]


def test_a_distributed_checkpoint_saved_while_watched_holds_nothing_of_ours_and_resumes_exactly(ranks):
    for result in ranks:
        assert result["checkpoint_keys"]["watched"] == result["checkpoint_keys"]["plain"]
        resumed, run = result["restored"], result["scaled"]
        assert resumed["bits"] == run["bits"] and resumed["scale"] == run["scales"][-1]
        assert resumed["reported"] == run["truth"][SAVE_AFTER:]
        (restore,) = [e for e in resumed["events"] if e.get("cause") == "restored"]
        assert restore["after"] == run["scales"][SAVE_AFTER - 1]
        assert resumed["state"]["delivery"]["agent_errors"] == 0


def test_a_scaler_less_run_checkpointed_while_watched_holds_nothing_of_ours_and_resumes_exactly(ranks):
    (_, planter), = UNSCALED_PLANTED.items()
    for rank, result in enumerate(ranks):
        assert result["checkpoint_keys"]["unscaled-watched"] == result["checkpoint_keys"]["unscaled-plain"]
        run, resumed = result["unscaled"], result["unscaled_restored"]
        # Trained on from the checkpoint by a new process's objects: the same shards, bit for bit, as the run
        # that never stopped, and the same poisoned steps, counted and reported by the new watch.
        assert resumed["bits"] == run["bits"] == result["unscaled_plain"]["bits"]
        assert resumed["poisoned"] == [s for s in run["poisoned"] if s >= UNSCALED_SAVE_AFTER] != []
        assert resumed["state"]["optimizers"]["net"]["poisoned_steps"] == len(resumed["poisoned"])
        # Its first poisoned step is the uninterrupted run's, with the same parameters named.
        first, uninterrupted = kinds(resumed, "poisoned_step")[0], kinds(run, "poisoned_step")[0]
        assert first["streak"] == 1 and first["params"] == uninterrupted["params"] != []
        if rank == planter:
            assert first["params"] == [{"name": f"2.weight shard [{rows(rank, len(ranks))}, 0:16]", "inf": 1, "nan": 0}]
        assert resumed["scaler"]["kind"] == "none" and resumed["state"]["loss_scale"] is None
        assert resumed["state"]["delivery"]["agent_errors"] == 0


@pytest.fixture(scope="module")
def plain_first(tmp_path_factory) -> list[dict]:
    """Run the worker whose first layer keeps plain gradients before the DTensor ones (2 ranks)."""
    out = tmp_path_factory.mktemp("fsdp-plain-first")
    return run_ranks(mixed.__name__, out, mixed.WORLD_SIZE, timeout=600,
                     what="2-rank FSDP2 with a plain gradient first")


@pytest.mark.parametrize("layout", mixed.LAYOUTS)
@pytest.mark.parametrize("watched", ["none", "disabled"], ids=["watch(None)", "disabled-scaler"])
def test_a_plain_gradient_before_the_dtensor_ones_is_checked_by_its_own_type(plain_first, layout, watched):
    """A step poisoned in a plain gradient and one poisoned in a DTensor shard are each reported, no error."""
    for rank, result in enumerate(plain_first):
        run, unwatched = result[f"{layout}/{watched}"], result[f"{layout}/plain"]
        assert run["grad_types"][:2] == ["Tensor", "Tensor"] and set(run["grad_types"][2:]) == {"DTensor"}
        (step, (_, name)), = [(s, p) for s, p in mixed.PLANTED.items() if p[0] == rank]
        assert run["poisoned"] == unwatched["poisoned"] == [step]  # ground truth: this rank's own planted step
        assert run["state"]["delivery"]["agent_errors"] == 0
        assert run["state"]["optimizers"]["net"]["poisoned_steps"] == len(run["poisoned"])
        (event,) = kinds(run, "poisoned_step")
        named = name if rank == 0 else f"{name} shard [{rows(rank, mixed.WORLD_SIZE)}, 0:16]"
        assert (event["iteration"], event["params"]) == (step, [{"name": named, "inf": 1, "nan": 0}])
        assert run["bits"] == unwatched["bits"]  # bit-identical to the unwatched twin
