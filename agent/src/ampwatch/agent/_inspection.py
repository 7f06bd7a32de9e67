"""Look at the parameters when an optimizer skips: name the offending ones, find poisoned steps.

The recorder counts every step and skip on the training thread (its hot path, no device reads);
what lives here runs only on an iteration where some optimizer skipped, and holds every parameter
scan the agent makes, so their device syncs are in one place (docs/agent.md: "How a skip is
detected, and what it costs").
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from ampwatch.contract.batch import PoisonedStepEvent, PoisonReason, SkipEvent
from ampwatch.contract.protocol import is_rung

from ._errors import AgentErrors
from ._events import EventBuffer
from ._params import NonfiniteReport, ParameterNames, Part, scan_optimizers
from ._samples import SampleLog

if TYPE_CHECKING:  # the recorder imports this module
    from ._began import BeganFinder
    from ._record import OptimizerRecord

__all__ = ["SkipInspection"]


class SkipInspection:
    """Scan the parameters around a skip: the offenders named in its event, and poisoned steps.

    Naming is rate-limited (a streak's rungs; a streak start at most once per
    ``interval`` seconds per optimizer); the poisoned-step check runs on every
    skipped iteration. A failing scan is counted in ``errors``, never raised:
    the skip itself is still reported.
    """

    def __init__(self, names: ParameterNames, events: EventBuffer, errors: AgentErrors,
                 interval: float = 1.0) -> None:
        self.names = names
        self.events = events
        self.errors = errors
        self.interval = interval  # seconds between naming scans at streak starts, per optimizer
        self.samples: SampleLog | None = None  # the recorder's, once the job records sample ids
        self.scanned: NonfiniteReport | None = None  # the gradients the last naming scan flagged (None: no scan)
        self.began: BeganFinder | None = None  # set by watch(): where each event's inf/NaN began

    def name_offenders(self, record: OptimizerRecord, position: int, event: SkipEvent,
                       check_weights: bool) -> tuple[NonfiniteReport | None, bool]:
        """Name the parameters whose gradients hold inf/NaN in the skip ``event``, when the rate limit allows.

        With ``check_weights`` (a streak starts), the same scan looks at the weights
        the optimizer's last step left. Return that weights report (None when not
        scanned) and whether the weights still need a look (in :meth:`check_poisoned_steps`).
        Costs 2 device syncs when it names; a streak start the rate limit leaves unnamed still has its
        gradients flagged (for ``began``, :attr:`scanned`), with its weights, in one.
        """
        self.scanned = None
        # Naming is the only rate-limited part: exponentially spaced positions within a streak, and
        # streak starts at most once per interval per optimizer, counted from the END of the previous
        # naming scan, so a scan longer than the interval cannot run at every streak start.
        if not is_rung(position):
            return None, check_weights
        limited = position == 1 and time.monotonic() - record.last_streak_inspection < self.interval
        if limited and self.began is None:
            return None, check_weights
        weights = None
        targets: list[tuple[torch.optim.Optimizer, Part]] = [(record.optimizer, "grads")]
        if check_weights:
            targets.append((record.optimizer, "weights"))
        try:
            # Rate-limited, the gradients are only flagged, for began (docs/agent.md#where-it-began), in the
            # one copy that checks the weights anyway: no name, no count, no second copy.
            grads, *checked = scan_optimizers(targets, self.names, unnamed=(limited,))
            self.scanned = grads
            if limited:
                return (checked[0] if checked else None), False
            event["params"], event["params_total"], event["inspected"] = grads.params, grads.total, True
            weights = checked[0] if checked else None
            check_weights = False
        except Exception as error:  # noqa: BLE001 - the skip itself is still reported
            self.errors.report("parameter scan", error)
        if position == 1:
            record.last_streak_inspection = time.monotonic()
        return weights, check_weights

    # ----- poisoned steps -------------------------------------------------------------------

    def check_poisoned_steps(self, records: list[OptimizerRecord], iteration: int) -> None:
        """Report the poisoned steps of a skipped ``iteration``: one scan of every optimizer that needs a look."""
        # On every iteration where some optimizer skipped, never rate-limited: an optimizer that stepped
        # may have been handed gradients that became non-finite after its own check (e.g. whole-model
        # clipping), or have stepped into non-finite weights; and an optimizer whose skips began now may
        # find its weights already non-finite: its last step poisoned them. One scan for all of them.
        stepped = [r for r in records if r.stepped_this_iteration]
        started = [r for r in records if r.check_weights]
        for record in started:
            record.check_weights = False
        targets: list[tuple[torch.optim.Optimizer, Part]] = [
            (r.optimizer, part) for r in stepped for part in ("grads", "weights")]
        targets += [(r.optimizer, "weights") for r in started]
        if not targets:
            return
        try:
            reports = scan_optimizers(targets, self.names)
        except Exception as error:  # noqa: BLE001 - the rest of update() must still be accounted
            self.errors.report("parameter scan", error)
            return
        for k, record in enumerate(stepped):
            grads, weights = reports[2 * k], reports[2 * k + 1]
            if grads.total:
                self.report_poisoned(record, iteration, grads, "nonfinite_grad", current=True)
            elif weights.total:
                self.report_poisoned(record, iteration, weights, "nonfinite_param", current=True)
        for record, weights in zip(started, reports[2 * len(stepped):], strict=True):
            if weights.total and record.last_step_iteration is not None:
                self.report_poisoned(record, record.last_step_iteration, weights, "nonfinite_param")

    def report_poisoned(self, record: OptimizerRecord, iteration: int, report: NonfiniteReport,
                        reason: PoisonReason, *, current: bool = False, **fields: Any) -> None:
        """Count and emit a ``poisoned_step`` of ``record`` at ``iteration``, once per step.

        ``fields`` go into the event as they are (a watch without a scaler: ``streak``, ``exact``, and with
        ``ddp=`` the origin fields). ``current``: the iteration's gradients are still there (for ``began``).
        """
        if record.poison_reported_for == iteration:
            return
        # The first of a run: an unscaled run's first step (streak 1), else not the step right after the last one.
        first = fields["streak"] == 1 if "streak" in fields else record.poison_reported_for != iteration - 1
        record.poison_reported_for = iteration
        record.poisoned += 1
        event: PoisonedStepEvent = {"kind": "poisoned_step", "optimizer": record.name, "iteration": iteration,
                                    "params": report.params, "params_total": report.total, "reason": reason,
                                    **fields}  # type: ignore[typeddict-item]
        self.explain(event, iteration, current=current, first=first, ids_assigned=True,
                     flagged=report.flagged if reason == "nonfinite_grad" else None)
        self.events.append(event)

    def explain(self, event: SkipEvent | PoisonedStepEvent, iteration: int, *, current: bool, first: bool,
                flagged: Any, ids_assigned: bool = False) -> None:
        """Add to a skip or poisoned step where its inf/NaN began (``flagged``: the gradients a scan of this
        iteration flagged, or None) and the iteration's samples (with those before, for the ``first`` of a run),
        as far as the watch records them. ``ids_assigned``: the iteration's ids were already given to it."""
        if self.samples is not None:
            self.samples.describe(event, iteration, current=current and not ids_assigned, first=first)
        if self.began is not None:
            self.began.add_to(event, iteration, current, flagged)
