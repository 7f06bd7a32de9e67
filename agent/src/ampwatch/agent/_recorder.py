"""Turn what the scaler did into cumulative counters and events (the protocol's ``state`` and ``events``)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Callable

import torch

from . import _device
from ._events import EventBuffer
from ._params import NonfiniteReport, ParameterNames, Part, scan_optimizers

__all__ = ["OptimizerRecord", "Recorder", "STREAK_LADDER"]

log = logging.getLogger("ampwatch.agent")

STREAK_LADDER = tuple(2 ** k for k in range(11))
"""Streak lengths counted in ``streaks_reached``: 1, 2, 4, ..., 1024 (docs/protocol.md)."""

_MAX_PENDING = 64  # device reads in flight before we wait for the oldest (only if the device lags far behind)


@dataclasses.dataclass(slots=True, eq=False)
class OptimizerRecord:
    """Counters and per-iteration flags of one watched optimizer."""

    name: str
    optimizer: torch.optim.Optimizer
    steps: int = 0
    skipped: int = 0
    consecutive: int = 0
    longest: int = 0
    streaks: int = 0
    streak_start: int = 0
    reached: list[int] = dataclasses.field(default_factory=lambda: [0] * len(STREAK_LADDER))
    scheduler_steps_after_skip: int = 0
    poisoned: int = 0
    last_stepped: bool | None = None
    last_step_iteration: int | None = None
    poison_reported_for: int | None = None  # step iteration already reported as poisoned
    last_streak_inspection: float = float("-inf")  # when the last naming scan at a streak start ended
    check_weights: bool = False  # a streak began this iteration: look at the weights its last step left
    # Per scaler.step call, written by the wrappers and the step pre-hook.
    hook_fired: bool = False
    found_inf: torch.Tensor | None = None
    stepped_this_iteration: bool = False
    # Fused optimizers on an asynchronous device: outcomes still on their way to the host.
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)

    def counters(self) -> dict[str, Any]:
        """Return this optimizer's protocol counters as plain values."""
        reached = list(self.reached)  # list copy is atomic under the GIL
        return {
            "steps": self.steps,
            "skipped": self.skipped,
            "consecutive_skipped": self.consecutive,
            "longest_streak": self.longest,
            "streaks": self.streaks,
            "streaks_reached": {str(n): c for n, c in zip(STREAK_LADDER, reached) if c},
            "scheduler_steps_after_skip": self.scheduler_steps_after_skip,
            "poisoned_steps": self.poisoned,
        }


class Recorder:
    """Count steps, skips, streaks and scale transitions of one scaler, and emit events.

    The training thread calls the ``on_*`` methods (through the wrappers in
    ``_attach``); the sender thread calls :meth:`snapshot`, which only copies
    plain Python values.
    """

    def __init__(self, scaler: Any, records: list[OptimizerRecord], names: ParameterNames,
                 events: EventBuffer, *, on_streak_start: Callable[[], None] = lambda: None,
                 inspect_interval: float = 1.0) -> None:
        self.scaler = scaler
        self.records = records
        self.names = names
        self.events = events
        self.on_streak_start = on_streak_start
        self.inspect_interval = inspect_interval
        self.enabled = bool(scaler.is_enabled())
        self.iteration = 0
        self.backoffs = self.growths = self.manual_sets = 0
        self.agent_errors = 0
        self.active: OptimizerRecord | None = None  # the record inside scaler.step right now
        # A disabled scaler has no scaling settings at all: report them as null.
        self.scaler_info = {
            "enabled": self.enabled,
            "kind": type(scaler).__name__,
            "init_scale": _device.init_scale(scaler) if self.enabled else None,
            "growth_factor": float(scaler.get_growth_factor()) if self.enabled else None,
            "backoff_factor": float(scaler.get_backoff_factor()) if self.enabled else None,
            "growth_interval": int(scaler.get_growth_interval()) if self.enabled else None,
        }
        self._skipped_this_iteration = False
        self._inspected_this_iteration = False
        self._clean_iterations = 0  # since the last skip; growth is possible every growth_interval
        self._scale_pending: collections.deque = collections.deque()
        self._scale_source: torch.Tensor | None = None
        self._scale_device: str | None = None
        self._error_sites: set[str] = set()
        self._warned: set[int] = set()
        self.loss_scale: float | None = None
        if self.enabled:
            live = _device.scale_tensor(scaler)
            # Reading a live scale at attach time may sync once; the hot path never does.
            self.loss_scale = (_device.read_later(live).wait()[0] if live is not None
                               else self.scaler_info["init_scale"])
        else:
            self.events.append({"kind": "scaler_disabled", "iteration": 0})

    # ----- hooks called from the training thread -------------------------------------------

    def before_step(self, record: OptimizerRecord) -> None:
        """Mark that ``scaler.step(record.optimizer)`` is starting."""
        record.hook_fired = False
        record.found_inf = None
        self.active = record

    def on_optimizer_step(self, record: OptimizerRecord) -> None:
        """Note that ``optimizer.step()`` is being called (step pre-hook)."""
        if self.active is record:
            record.hook_fired = True
            # AMP-aware (fused) optimizers are stepped even on a skip; the scaler hands them found_inf.
            record.found_inf = _device.fused_found_inf(record.optimizer)

    def after_step(self, record: OptimizerRecord) -> None:
        """Decide whether the ``scaler.step`` that just returned updated ``record``'s parameters."""
        self.active = None
        if record.pending:
            self._resolve_ready(record)
        if not self.enabled:
            self._outcome(record, True, self.iteration)
            return
        found_inf = record.found_inf
        record.found_inf = None
        if found_inf is None and record.hook_fired and _device.steps_with_amp_scaling(record.optimizer):
            found_inf = _device.found_inf_from_scaler(self.scaler, record.optimizer)
        if found_inf is None:
            # Non-fused: the scaler calls optimizer.step() only when found_inf is 0 (it already synced).
            self._outcome(record, record.hook_fired, self.iteration)
            return
        if not record.pending and found_inf.device.type == "cpu":
            # Already on the host: read it now (no sync) and skip the deferred-read bookkeeping.
            self._outcome(record, not _device.host_scalar(found_inf), self.iteration)
            return
        read = _device.read_later(found_inf)
        record.pending.append((read, self.iteration))
        self._resolve_ready(record)
        if len(record.pending) > _MAX_PENDING:
            self._resolve_oldest(record)

    def after_update(self, manual: bool) -> None:
        """Account for one ``scaler.update()``: scale transition, poisoned-step check, next iteration."""
        iteration = self.iteration
        for record in self.records:
            if record.pending:  # fused outcomes that have landed count toward the iteration they belong to
                self._resolve_ready(record)
        if self._skipped_this_iteration:
            self._clean_iterations = 0
            self._check_poisoned_steps(iteration)  # whatever the naming rate limit did
        else:
            self._clean_iterations += 1
        if self.enabled:
            self._read_scale(iteration, manual)
        for record in self.records:
            record.stepped_this_iteration = False
        self._skipped_this_iteration = False
        self.iteration = iteration + 1

    def on_scheduler_step(self, record: OptimizerRecord, scheduler: str) -> None:
        """Count an LR scheduler step taken right after ``record``'s optimizer skipped."""
        if record.pending:
            self._resolve_oldest(record, all_of_them=True)  # rare: fused optimizer on a device
        if record.last_stepped is False:
            record.scheduler_steps_after_skip += 1
            self.events.append({"kind": "scheduler_after_skip", "iteration": self.iteration,
                                "optimizer": record.name, "scheduler": scheduler})

    def on_unknown_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn once per optimizer that ``scaler.step`` was called with one that is not watched."""
        if id(optimizer) in self._warned:
            return
        self._warned.add(id(optimizer))
        message = (f"scaler.step() was called with a {type(optimizer).__name__} that was not passed to "
                   "ampwatch.agent.watch(); its skips are not reported. Pass every optimizer to watch().")
        log.warning("ampwatch: %s", message)
        self.events.append({"kind": "warning", "iteration": self.iteration,
                            "code": "stepped_unknown_optimizer", "message": message})

    def stepped(self, record: OptimizerRecord) -> bool | None:
        """Return whether the last ``scaler.step`` of ``record`` updated parameters (None before any)."""
        if record.pending:
            self._resolve_oldest(record, all_of_them=True)  # one device sync, only when asked
        return record.last_stepped

    def internal_error(self, site: str, error: BaseException) -> None:
        """Count an agent failure and log it once per site; never raise."""
        self.agent_errors += 1
        if site not in self._error_sites:
            self._error_sites.add(site)
            log.error("ampwatch: internal error in %s (training continues; further ones are only counted)",
                      site, exc_info=error)

    def close(self) -> None:
        """Resolve what is still pending, end open streaks and emit ``close``."""
        for record in self.records:
            if record.pending:
                self._resolve_oldest(record, all_of_them=True)
        while self._scale_pending:
            self._resolve_scale(*self._scale_pending.popleft())
        for record in self.records:
            if record.consecutive:
                self._end_streak(record)
        self.events.append({"kind": "close", "iteration": self.iteration})

    # ----- read from the sender thread ----------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Return ``{"scaler": ..., "state": ...}`` as in docs/protocol.md (plain values only)."""
        return {
            "scaler": dict(self.scaler_info),
            "state": {
                "iteration": self.iteration,
                "loss_scale": self.loss_scale if self.enabled else None,
                "backoffs": self.backoffs,
                "growths": self.growths,
                "manual_sets": self.manual_sets,
                "optimizers": {r.name: r.counters() for r in self.records},
                # Partial: the sender adds its own delivery counters to this one.
                "delivery": {"agent_errors": self.agent_errors},
            },
        }

    # ----- outcomes ------------------------------------------------------------------------

    def _resolve_ready(self, record: OptimizerRecord) -> None:
        while record.pending and record.pending[0][0].done():
            read, iteration = record.pending.popleft()
            self._outcome(record, not read.wait()[0], iteration)

    def _resolve_oldest(self, record: OptimizerRecord, all_of_them: bool = False) -> None:
        while record.pending:
            read, iteration = record.pending.popleft()
            self._outcome(record, not read.wait()[0], iteration)
            if not all_of_them:
                break

    def _outcome(self, record: OptimizerRecord, stepped: bool, iteration: int) -> None:
        record.last_stepped = stepped
        if stepped:
            record.steps += 1
            record.last_step_iteration = iteration
            record.stepped_this_iteration = iteration == self.iteration
            if record.consecutive:
                self._end_streak(record, iteration)
            return
        record.skipped += 1
        record.consecutive += 1
        position = record.consecutive
        if position == 1:
            record.streaks += 1
            record.streak_start = iteration
        if position > record.longest:
            record.longest = position
        if position & (position - 1) == 0 and position <= STREAK_LADDER[-1]:
            record.reached[position.bit_length() - 1] += 1
        if iteration == self.iteration:
            self._skipped_this_iteration = True
        self._report_skip(record, position, iteration)
        if position == 1:
            self.on_streak_start()

    def _end_streak(self, record: OptimizerRecord, iteration: int | None = None) -> None:
        self.events.append({"kind": "streak_end", "optimizer": record.name,
                            "iteration": self.iteration if iteration is None else iteration,
                            "start_iteration": record.streak_start, "length": record.consecutive})
        record.consecutive = 0

    def _may_name(self, record: OptimizerRecord, position: int) -> bool:
        # Naming is the only rate-limited part: exponentially spaced positions within a streak, and
        # streak starts at most once per interval per optimizer, counted from the END of the previous
        # naming scan, so a scan longer than the interval cannot run at every streak start.
        if position & (position - 1):
            return False
        return position > 1 or time.monotonic() - record.last_streak_inspection >= self.inspect_interval

    def _report_skip(self, record: OptimizerRecord, position: int, iteration: int) -> None:
        event: dict[str, Any] = {"kind": "skip", "iteration": iteration, "optimizer": record.name,
                                 "streak": position, "params": [], "params_total": None,
                                 "inspected": False}
        # Gradients and weights of a deferred (fused, on-device) outcome may already belong to a later iteration.
        current = iteration == self.iteration
        # A streak start looks at the weights its optimizer's last step left: in this scan when it names,
        # else in update(), with the optimizers that stepped (one scan, one copy, either way).
        check_weights = current and position == 1 and record.last_step_iteration is not None
        weights = None
        if current and self._may_name(record, position):
            targets: list[tuple[torch.optim.Optimizer, Part]] = [(record.optimizer, "grads")]
            if check_weights:
                targets.append((record.optimizer, "weights"))
            try:
                grads, *checked = scan_optimizers(targets, self.names)
                event.update(params=grads.params, params_total=grads.total, inspected=True)
                weights = checked[0] if checked else None
                check_weights = False
            except Exception as error:  # noqa: BLE001 - the skip itself is still reported
                self.internal_error("parameter scan", error)
            if position == 1:
                record.last_streak_inspection = time.monotonic()
        record.check_weights = check_weights
        self.events.append(event)
        if weights is not None and weights.total:
            self._report_poisoned(record, record.last_step_iteration, weights, "nonfinite_param")

    # ----- poisoned steps (issue 8) ---------------------------------------------------------

    def _check_poisoned_steps(self, iteration: int) -> None:
        # On every iteration where some optimizer skipped, never rate-limited: an optimizer that stepped
        # may have been handed gradients that became non-finite after its own check (e.g. whole-model
        # clipping), or have stepped into non-finite weights; and an optimizer whose skips began now may
        # find its weights already non-finite: its last step poisoned them. One scan for all of them.
        stepped = [r for r in self.records if r.stepped_this_iteration]
        started = [r for r in self.records if r.check_weights]
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
            self.internal_error("parameter scan", error)
            return
        for k, record in enumerate(stepped):
            grads, weights = reports[2 * k], reports[2 * k + 1]
            if grads.total:
                self._report_poisoned(record, iteration, grads, "nonfinite_grad")
            elif weights.total:
                self._report_poisoned(record, iteration, weights, "nonfinite_param")
        for record, weights in zip(started, reports[2 * len(stepped):]):
            if weights.total and record.last_step_iteration is not None:
                self._report_poisoned(record, record.last_step_iteration, weights, "nonfinite_param")

    def _report_poisoned(self, record: OptimizerRecord, iteration: int,
                         report: NonfiniteReport, reason: str) -> None:
        if record.poison_reported_for == iteration:
            return
        record.poison_reported_for = iteration
        record.poisoned += 1
        self.events.append({"kind": "poisoned_step", "optimizer": record.name, "iteration": iteration,
                            "params": report.params, "params_total": report.total, "reason": reason})

    # ----- loss scale ----------------------------------------------------------------------

    def _read_scale(self, iteration: int, manual: bool) -> None:
        live = _device.scale_tensor(self.scaler)
        if live is not self._scale_source:  # look at the device once per scale tensor, not per iteration
            self._scale_source = live
            self._scale_device = None if live is None else live.device.type
        if self._scale_device == "cpu":
            self._apply_scale(_device.host_scalar(live), iteration, manual)
            return
        if self._scale_device == "cuda":
            self._scale_pending.append((_device.read_later(live), iteration, manual))
            while self._scale_pending and self._scale_pending[0][0].done():
                self._resolve_scale(*self._scale_pending.popleft())
            if len(self._scale_pending) > _MAX_PENDING:
                self._resolve_scale(*self._scale_pending.popleft())
            return
        # No asynchronous path: read (one sync) only when a transition is possible.
        rare = (manual or self._skipped_this_iteration
                or self._clean_iterations % max(1, self.scaler_info["growth_interval"] or 1) == 0)
        if rare:
            value = (float(self.scaler.get_scale()) if live is None
                     else float(_device.read_later(live).wait()[0]))
            self._apply_scale(value, iteration, manual)

    def _resolve_scale(self, read: _device.PendingRead, iteration: int, manual: bool) -> None:
        self._apply_scale(float(read.wait()[0]), iteration, manual)

    def _apply_scale(self, after: float, iteration: int, manual: bool) -> None:
        before = self.loss_scale
        self.loss_scale = after
        if before is None or after == before:
            return  # unchanged: no transition, not even for update(new_scale=<the same value>)
        if manual:
            cause = "manual"
            self.manual_sets += 1
        elif after < before:
            cause = "backoff"
            self.backoffs += 1
        else:
            cause = "growth"
            self.growths += 1
        self.events.append({"kind": "scale_change", "iteration": iteration, "cause": cause,
                            "before": before, "after": after})
