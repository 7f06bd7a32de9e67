"""With ``ddp=``: each rank's own gradient norm before DDP's all-reduce, judged by the spike rule.

Three real ranks over gloo; rank 1's gradients are multiplied by 1,000 by a tensor hook at three iterations
(``ampwatch_support.local_norm_worker``), with a GradScaler (bf16 autocast) and in bf16 without one (two
micro-batches per iteration, three at those three: the norm, the infinity norm, is the largest absolute value of
all their gradients). DDP averages them into every rank's ``.grad``: only the rank's own norm tells which rank it
was. The truth is taken in the job by a tensor hook of its own.

| # | case | expected |
|---|---|---|
| 1 | rank 1 at the chosen iterations | a `grad_norm_spike`, `local: true`, at exactly those: its own norm, |
|   |                                  | streak 1, the iteration's samples |
| 2 | the other ranks, and rank 1 elsewhere | no local spike (without a scaler, the row of the spiked iterations' |
|   |                                       | third micro-batch, not written after them, does not count) |
| 3 | rank 0's input holds an inf (with the GradScaler): every rank skips | no value: no local spike on rank 0 |
| 4 | a NaN in rank 1's own gradients at the last iteration, without a scaler (its step goes through) | a local |
|   |                                                                                   | spike, value NaN, z null |
| 5 | the level in state | `optimizers[name].local_grad_norm`: mean and std of the window's own norms |

The window is `AMPWATCH_SPIKE_WINDOW=32`, so that the three spikes, a window apart, take 130 iterations.
"""

from __future__ import annotations

import math

import pytest

from ampwatch.agent._spikes import SpikeSeries
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS
from ampwatch_support.ddp_harness import run_ranks

pytestmark = pytest.mark.slow

WORKER = "ampwatch_support.local_norm_worker"
SPIKED_RANK = 1
MODES = ("scaled", "unscaled")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run the three-rank worker once (bounded in time, whole process group killed on timeout)."""
    return run_ranks(WORKER, tmp_path_factory.mktemp("local-norm"), 3, timeout=300, what="three-rank")


@pytest.mark.parametrize("mode", MODES)
def test_one_rank_s_own_gradients_x1000_are_a_local_spike_on_that_rank_only_at_those_iterations(ranks, mode):
    spiked_at = ranks[0]["spiked_at"]
    assert len(spiked_at) == 3
    for rank, result in enumerate(ranks):
        run = result[mode]
        events = run["events"]
        if mode == "scaled":  # a skipped step's norm is of gradients never applied: not judged
            assert run["skipped"] == [result["skipped_at"]]
            assert (not math.isfinite(run["norms"][result["skipped_at"]])) == (rank == 0)
        if rank != SPIKED_RANK:
            assert events == [], f"rank {rank} had a local spike it did not have"
            continue
        nan_at = [result["nan_at"]] if mode == "unscaled" else []
        assert [e["iteration"] for e in events] == spiked_at + nan_at
        for event in events:
            truth = run["norms"][event["iteration"]]
            assert event["optimizer"] == "net" and event["local"] is True and event["streak"] == 1
            if event["iteration"] in nan_at:  # NaN stays NaN: a spike, no z
                assert math.isnan(event["value"]) and math.isnan(truth) and event["z"] is None, event
            else:
                assert math.isclose(event["value"], truth, rel_tol=1e-4), (event["value"], truth)
                assert event["z"] >= DEFAULT_THRESHOLDS.spike_sigma
            first = 1000 * rank + 8 * event["iteration"]
            assert event["samples"]["ids"] == list(range(first, first + 8)), "the iteration's samples"


@pytest.mark.parametrize("mode", MODES)
def test_the_local_level_in_state_is_the_window_s_own_unscaled_gradient_norm(ranks, mode):
    for result in ranks:
        window = result["window"]
        run = result[mode]
        level = run["state"]["optimizers"]["net"]["local_grad_norm"]
        assert window < len(run["norms"]) - 1
        # The truth: the norms the hook in the job saw, through the rule's own window (a spike enters it clipped).
        truth = SpikeSeries(window, DEFAULT_THRESHOLDS.spike_sigma)
        for iteration, norm in enumerate(run["norms"]):
            truth.observe(None if iteration in run.get("skipped", ()) else norm)
        expected = truth.level()
        assert math.isclose(level["mean"], expected["mean"], rel_tol=1e-3), (level, expected)
        assert math.isclose(level["std"], expected["std"], rel_tol=1e-3), (level, expected)
