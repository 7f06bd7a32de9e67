"""Summary, description and runbook link of each built-in alert, worded like the Prometheus rules' annotations."""

from __future__ import annotations

from typing import Mapping

__all__ = ["annotations_for", "RUNBOOK_BASE"]

RUNBOOK_BASE = "https://github.com/ampwatch/ampwatch/blob/main/docs/alerts.md#"
"""Runbook sections live in docs/alerts.md, as the Prometheus rules link them; the anchor is the lower-cased name."""

# {run}, {rank}, {optimizer} and {value} are filled from the alert's labels and value.
_TEXT: Mapping[str, tuple[str, str]] = {
    "AmpConsecutiveSkippedSteps": (
        "Optimizer {optimizer} skipped {threshold} or more steps in a row on rank {rank} of run {run}",
        "GradScaler skipped scaler.step({optimizer}) at least {threshold} consecutive times on rank {rank} "
        "of run {run} (current streak: {value:g}): its unscaled gradients hold inf/NaN and the parameters "
        "are not updated."),
    "AmpSustainedLossScaleBackoff": (
        "Loss scale keeps backing off on {value:.0%} of the ranks of run {run}",
        "{value:.0%} of the open ranks of run {run} backed off the loss scale repeatedly with no growth: "
        "overflows are not a start-up calibration any more."),
    "AmpLossScaleCollapsed": (
        "Loss scale collapsed to {value:g} on rank {rank} of run {run}",
        "The loss scale of rank {rank} of run {run} is {value:g}, below the collapse threshold: "
        "gradients overflow even unscaled; look for a real numerical problem (LR, data, loss)."),
    "AmpLossScaleDesync": (
        "Ranks of run {run} disagree on the loss scale (x{value:g})",
        "The largest loss scale of run {run} is {value:g} times its smallest: ranks are not "
        "backing off together; check that every rank all-reduces its gradients."),
    "AmpHighSkippedStepRatio": (
        "Optimizer {optimizer} skips {value:.1%} of its steps on rank {rank} of run {run}",
        "scaler.step({optimizer}) was skipped in {value:.1%} of the calls of the window on rank {rank} "
        "of run {run}."),
    "AmpRankSilent": (
        "Rank {rank} of run {run} stopped reporting",
        "No batch from rank {rank} of run {run} for {value:.0f} s and it did not close: the process "
        "may have died or hung, or cannot reach the collector."),
    "AmpSchedulerStepsOnSkipped": (
        "LR scheduler stepped after skipped steps of {optimizer} on rank {rank} of run {run}",
        "An LR scheduler stepped right after scaler.step({optimizer}) skipped on rank {rank} of run {run} "
        "({value:g} times so far): gate it with watch.stepped({optimizer})."),
    "AmpPoisonedStep": (
        "Optimizer {optimizer} updated with non-finite gradients on rank {rank} of run {run}",
        "Optimizer {optimizer} on rank {rank} of run {run} updated parameters with non-finite gradients or "
        "left them non-finite ({value:g} poisoned steps so far): clip per optimizer after unscale_."),
}


def annotations_for(name: str, labels: Mapping[str, str], value: float, threshold: object = "") -> dict[str, str]:
    """Return the summary, description and runbook_url of alert ``name``."""
    summary, description = _TEXT[name]
    fields = {"run": "", "rank": "", "optimizer": "", **labels, "value": value, "threshold": threshold}
    return {
        "summary": summary.format(**fields),
        "description": description.format(**fields),
        "runbook_url": RUNBOOK_BASE + name.lower(),
    }
