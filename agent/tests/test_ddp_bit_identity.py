"""watch(..., ddp=model) never changes training: every DDP configuration, watched and unwatched, bit for bit.

Four gloo processes; the matrix of ``ampwatch_support.ddp_matrix_worker`` runs over a process group of 2, of 3
and of all 4 of them, one group per world size: ``gradient_as_bucket_view`` x ``static_graph`` x
``find_unused_parameters`` x ``join()`` (none, and ``divide_by_initial_world_size`` both ways, the last rank
out of inputs early) x the job's own comm hook (none, ``allreduce_hook``, ``fp16_compress_hook``,
``bf16_compress_hook``, PowerSGD), each watched until its watch closes mid-run and trained on after, beside
the same job never watched; gradient accumulation with and without ``no_sync()``; at 2 ranks
``torch.compile`` (aot_eager) under both ``optimize_ddp`` modes. The weights after the close and at the
end must be the twin's bit for bit, and every skip before the close must name as origin exactly the rank
whose input held the inf. Configurations torch itself cannot train are listed in ``UNSUPPORTED``.
"""

from __future__ import annotations

import pytest

from ampwatch_support.ddp_harness import run_ranks
from ampwatch_support.ddp_matrix_worker import CLOSE_AT, COMPILED_AT, WORLD_SIZES, eager_configurations

WORKER = "ampwatch_support.ddp_matrix_worker"

# The matrix runs once, in the first test's set-up: its own deadline (run_ranks) bounds it, not the default 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1300)]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, list[dict]]:
    """Run the matrix once (bounded in time, whole process group killed on timeout): world size -> each rank's."""
    ranks = run_ranks(WORKER, tmp_path_factory.mktemp("matrix"), max(WORLD_SIZES), timeout=1200, what="matrix")
    return {size: [ranks[r][str(size)] for r in range(size)] for size in WORLD_SIZES}


@pytest.fixture(params=WORLD_SIZES, ids=[f"{n}-ranks" for n in WORLD_SIZES])
def matrix(request, worlds) -> list[dict]:
    """One world size's results, per rank: ``{configuration: {"watched": ..., "twin": ...}}``."""
    return worlds[request.param]


def _runs(matrix: list[dict]):
    for name in matrix[0]:
        for rank, results in enumerate(matrix):
            runs = results[name]
            yield name, rank, runs["watched"], runs["twin"]


def test_the_matrix_covers_every_configuration_torch_trains(matrix):
    names = set(matrix[0])
    assert set(eager_configurations()) == names - {"compiled=ddp_optimizer", "compiled=python_reducer"}
    assert len(names) >= 88
    if len(matrix) == COMPILED_AT:
        assert {"compiled=ddp_optimizer", "compiled=python_reducer"} <= names


def test_every_configuration_trains_bit_for_bit_as_its_unwatched_twin_before_and_after_close(matrix):
    differ = [(name, rank, when) for name, rank, watched, twin in _runs(matrix) for when in ("at_close", "final")
              if watched[when] != twin[when]]
    assert not differ


def test_every_skip_before_the_close_names_the_rank_fed_the_inf_and_no_other(matrix):
    """Each planted iteration skipped on every rank; only the planted rank is its origin, and the rank that started
    the first skip is not named origin of the second, started elsewhere (the notes start afresh each iteration)."""
    wrong = []
    for name, rank, watched, _ in _runs(matrix):
        planted = {int(i): r for i, r in watched["planted"].items()}
        origins = {i: origin for i, origin, _ in watched["skips"]}
        expected = {i: planted.get(i) == rank for i in origins}
        if origins != expected or not set(planted) <= set(origins) or any(i >= CLOSE_AT for i in origins):
            wrong.append((name, rank, origins, planted))
    assert not wrong


def test_an_origin_names_the_parameters_whose_own_gradients_held_the_inf(matrix):
    for name, rank, watched, _ in _runs(matrix):
        for _, origin, params in watched["skips"]:
            assert bool(params) is origin, (name, rank)
            assert set(params) <= {"body.weight", "body.bias", "head.weight", "head.bias"}, (name, rank, params)


def test_nothing_of_the_agent_stays_on_the_model_after_close_and_nothing_failed(matrix):
    for name, rank, watched, _ in _runs(matrix):
        assert watched["hooks_left"] == 0 and watched["errors"] == 0, (name, rank)


def test_accumulating_without_no_sync_names_only_the_rank_whose_micro_batch_held_the_inf(matrix):
    """Two micro-batches per step, each backward all-reducing (no ``no_sync()``): the inf of the first micro-batch
    is averaged into every rank's ``.grad`` before the second backward, so what every rank's second bucket holds
    is not what started it; only the rank whose own micro-batch held it is the origin. With ``no_sync()`` too."""
    for name in ("accumulate=sync", "accumulate=no_sync"):
        for rank, results in enumerate(matrix):
            watched = results[name]["watched"]
            planted = {int(i): r for i, r in watched["planted"].items()}
            origins = {i: origin for i, origin, _ in watched["skips"]}
            assert origins == {i: planted[i] == rank for i in planted}, (name, rank)
