"""Follow one scaler's loss scale: growths, backoffs, manual sets and restores, without a sync on the hot path."""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from typing import Any

import torch

from ampwatch.contract.batch import ScaleCause, ScaleChangeEvent, ScalerDisabledEvent
from ampwatch.contract.protocol import NO_SCALER_KIND, is_rung

from . import _device
from ._events import EventBuffer

__all__ = ["LossScale", "as_float32"]

_MAX_PENDING = 64  # scale reads in flight before we wait for the oldest (only if the device lags far behind)


def as_float32(value: float) -> float:
    """Return ``value`` as the scaler holds it: rounded to float32 (0.1 -> 0.10000000149011612, 1e39 -> inf)."""
    return float(torch.tensor(float(value), dtype=torch.float32))


def _same(a: float, b: float) -> bool:
    """Tell whether two scale values are the same state (NaN is NaN: a NaN scale stays NaN)."""
    return a == b or (math.isnan(a) and math.isnan(b))


class LossScale:
    """The loss scale of one scaler and the transitions it went through (``state`` and ``scale_change`` events).

    Every value the float32 scale can hold is a state: 0.0 after a long run of
    backoffs, subnormals, inf and NaN included. A value set outside
    ``update()`` (``load_state_dict()`` on resume, a new scaler bound with
    ``Watch.rebind``) is a ``restored`` transition, never a growth or backoff.

    Backoffs in consecutive iterations (a skip storm) are folded like a skip
    streak: an event at the run's 1st, 2nd, 4th, 8th, ... backoff, and one for
    the rest when the run ends, each with ``count`` (the backoffs it stands
    for) when more than one, ``before`` the first of them and ``after`` the last.
    """

    def __init__(self, events: EventBuffer) -> None:
        self.events = events
        self.enabled = False
        self.value: float | None = None
        self.backoffs = self.growths = self.manual_sets = 0
        self.settings: dict[str, Any] = {}
        self._clean_iterations = 0  # since the last skip; growth is possible every growth_interval
        self._pending: collections.deque = collections.deque()
        self._source: torch.Tensor | None = None
        self._device: str | None = None
        # The current run of backoffs in consecutive iterations, and how much of it is already in events.
        self._run = self._run_sent = 0
        self._run_before = self._run_after = 0.0  # the scale before the first backoff not yet sent, after the last
        self._run_last = -2  # iteration of the run's latest backoff

    # ----- binding and restoring (rare: watch(), rebind(), load_state_dict()) -------------------

    def unscaled(self) -> None:
        """Say that there is no scaler at all (bf16, float32): no scale, no settings, never a transition."""
        self.enabled, self.value = False, None
        self.settings = {"enabled": False, "kind": NO_SCALER_KIND, "init_scale": None, "growth_factor": None,
                         "backoff_factor": None, "growth_interval": None}

    def bind(self, scaler: Any, iteration: int) -> None:
        """Take ``scaler``'s settings and scale; a value that differs from the last one is ``restored``.

        Reading a live scale on a GPU syncs once; this runs at ``watch()`` and
        ``rebind()`` only, never in the training loop.
        """
        self._resolve_pending()
        first = not self.settings
        was_disabled = self.settings.get("enabled") is False
        self.enabled = bool(scaler.is_enabled())
        self.settings = self._settings_of(scaler)
        self._source = self._device = None
        if not self.enabled:
            self._end_backoff_run()  # the old scaler's run of backoffs, if one was going on, is over
            self.value = None
            if not was_disabled:
                disabled: ScalerDisabledEvent = {"kind": "scaler_disabled", "iteration": iteration}
                self.events.append(disabled)
            return
        live = _device.scale_tensor(scaler)
        value = (_device.read_later(live).wait()[0] if live is not None
                 else as_float32(self.settings["init_scale"]))
        self._clean_iterations = _device.growth_tracker(scaler)
        if first:
            self.value = float(value)
        else:
            self._restore(float(value), iteration)

    def restored(self, scaler: Any, state_dict: Mapping[str, Any], iteration: int) -> None:
        """Account for ``scaler.load_state_dict(state_dict)`` that just returned (no device read)."""
        if not scaler.is_enabled():
            return  # load_state_dict() of a disabled scaler changes nothing
        self._resolve_pending()  # reads still in flight hold scales from before the restore
        self.settings = self._settings_of(scaler)
        self._clean_iterations = int(state_dict.get("_growth_tracker", 0) or 0)
        self._restore(as_float32(state_dict["scale"]), iteration)

    def _restore(self, after: float, iteration: int) -> None:
        self._end_backoff_run()
        before = self.value
        self.value = after
        if before is not None and not _same(after, before):
            event: ScaleChangeEvent = {"kind": "scale_change", "iteration": iteration, "cause": "restored",
                                       "before": before, "after": after}
            self.events.append(event)

    @staticmethod
    def _settings_of(scaler: Any) -> dict[str, Any]:
        # A disabled scaler has no scaling settings at all: report them as null.
        enabled = bool(scaler.is_enabled())
        return {
            "enabled": enabled,
            "kind": type(scaler).__name__,
            "init_scale": as_float32(_device.init_scale(scaler)) if enabled else None,
            "growth_factor": float(scaler.get_growth_factor()) if enabled else None,
            "backoff_factor": float(scaler.get_backoff_factor()) if enabled else None,
            "growth_interval": int(scaler.get_growth_interval()) if enabled else None,
        }

    def grew_since_skip(self) -> bool:
        """Tell whether the scale grew since the last skipped iteration: ``growth_interval`` clean updates in a row
        since then (GradScaler's growth tracker, followed on the host: no read). A skip now is the grown scale
        tried and backed off, the scaler settling (docs/agent.md#calibration)."""
        interval = self.settings.get("growth_interval") or 0
        return self.enabled and interval > 0 and self._clean_iterations >= interval

    # ----- after every update() (the hot path) ----------------------------------------------------

    def after_update(self, scaler: Any, iteration: int, *, manual: bool, skipped: bool) -> None:
        """Read the scale ``update()`` just wrote: at once on CPU, asynchronously on CUDA, rarely elsewhere."""
        if not self.enabled:
            return
        self._clean_iterations = 0 if skipped else self._clean_iterations + 1
        if not skipped and self._run and not self._pending:
            self._end_backoff_run()  # a clean update: the run is over (the CUDA path also ends it in _apply)
        live = _device.scale_tensor(scaler)
        if live is not self._source:  # look at the device once per scale tensor, not per iteration
            self._source = live
            self._device = None if live is None else live.device.type
        if self._device == "cpu":  # a device only for a tensor: live is one
            self._apply(_device.host_scalar(live), iteration, manual)  # type: ignore[arg-type]
            return
        if self._device == "cuda":
            self._pending.append((_device.read_later(live), iteration, manual))  # type: ignore[arg-type]
            while self._pending and self._pending[0][0].done():
                self._resolve(*self._pending.popleft())
            if len(self._pending) > _MAX_PENDING:
                self._resolve(*self._pending.popleft())
            return
        # No asynchronous path: read (one sync) only when a transition is possible.
        interval = max(1, self.settings["growth_interval"] or 1)
        if manual or skipped or self._clean_iterations % interval == 0:
            value = float(scaler.get_scale()) if live is None else float(_device.read_later(live).wait()[0])
            self._apply(value, iteration, manual)

    def close(self) -> None:
        """Resolve the reads still on their way (may sync once on a GPU); report a run of backoffs in progress."""
        self._resolve_pending()
        self._end_backoff_run()

    def _resolve_pending(self) -> None:
        while self._pending:
            self._resolve(*self._pending.popleft())

    def _resolve(self, read: _device.PendingRead, iteration: int, manual: bool) -> None:
        self._apply(float(read.wait()[0]), iteration, manual)

    def _apply(self, after: float, iteration: int, manual: bool) -> None:
        before = self.value
        self.value = after
        backoff = before is not None and not manual and after < before
        if self._run and (not backoff or iteration != self._run_last + 1):
            self._end_backoff_run()  # the run of backoffs is over: what is left of it goes out first
        if before is None or _same(after, before):
            return  # unchanged: no transition, not even for update(new_scale=<the same value>)
        cause: ScaleCause
        if manual:
            cause = "manual"
            self.manual_sets += 1
        elif after < before:
            self.backoffs += 1
            self._backoff(before, iteration)
            return
        elif after > before:
            cause = "growth"
            self.growths += 1
        else:
            return  # to or from NaN outside a manual set: update() cannot do that; nothing to count
        event: ScaleChangeEvent = {"kind": "scale_change", "iteration": iteration, "cause": cause,
                                   "before": before, "after": after}
        self.events.append(event)

    def _backoff(self, before: float, iteration: int) -> None:
        if not self._run:
            self._run_before = before
        self._run += 1
        self._run_last, self._run_after = iteration, self.value  # type: ignore[assignment] # a backoff was read
        if is_rung(self._run):  # the 1st, 2nd, 4th, ... backoff of the run
            self._send_backoffs()

    def _end_backoff_run(self) -> None:
        if self._run:
            self._send_backoffs()
            self._run = self._run_sent = 0

    def _send_backoffs(self) -> None:
        count = self._run - self._run_sent
        if not count:
            return
        event: ScaleChangeEvent = {"kind": "scale_change", "iteration": self._run_last, "cause": "backoff",
                                   "before": self._run_before, "after": self._run_after}
        if count > 1:
            event["count"] = count
        self.events.append(event)
        self._run_sent = self._run
        self._run_before = self._run_after
