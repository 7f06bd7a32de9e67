"""Wrap one scaler's ``step``/``update``, hook its optimizers and schedulers; undo it all on :meth:`detach`."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._recorder import OptimizerRecord, Recorder

__all__ = ["Attachment"]

_MISSING = object()


class Attachment:
    """Route ``scaler.step``, ``scaler.update``, optimizer step pre-hooks and scheduler steps to a Recorder.

    Only instance attributes are patched (never the classes), so other scalers
    are untouched; :meth:`detach` restores whatever was there before. Whatever
    goes wrong inside the agent, the wrapped call still happens exactly once.
    """

    def __init__(self, scaler: Any, recorder: Recorder,
                 schedulers: list[tuple[OptimizerRecord, str, Any]]) -> None:
        self.scaler = scaler
        self.recorder = recorder
        self.attached = False
        self._by_id = {id(r.optimizer): r for r in recorder.records}
        self._patched: list[tuple[Any, str, Any, Callable[..., Any]]] = []
        self._hook_handles: list[Any] = []
        self._schedulers = schedulers

    def attach(self) -> None:
        """Install the wrappers and hooks."""
        self._patch(self.scaler, "step", self._wrap_step(self.scaler.step))
        self._patch(self.scaler, "update", self._wrap_update(self.scaler.update))
        for record in self.recorder.records:
            self._hook_handles.append(
                record.optimizer.register_step_pre_hook(self._pre_hook(record)))
        for record, label, scheduler in self._schedulers:
            self._patch(scheduler, "step", self._wrap_scheduler_step(scheduler.step, record, label))
        for owner in {id(o): o for o, *_ in self._patched}.values():
            if callable(getattr(owner, "__getstate__", None)):
                self._patch(owner, "__getstate__", self._wrap_getstate(owner, owner.__getstate__))
        self.attached = True

    def detach(self) -> None:
        """Remove hooks and restore patched attributes (left alone if someone re-patched them since)."""
        self.attached = False
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        for owner, attr, previous, wrapper in reversed(self._patched):
            if vars(owner).get(attr) is not wrapper:
                continue  # patched again on top of us; our wrapper passes through once detached
            if previous is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, previous)
        self._patched.clear()

    def _patch(self, owner: Any, attr: str, wrapper: Callable[..., Any]) -> None:
        previous = vars(owner).get(attr, _MISSING)
        setattr(owner, attr, wrapper)
        self._patched.append((owner, attr, previous, wrapper))

    def _wrap_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder, by_id = self.recorder, self._by_id

        def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if not self.attached:
                return original(optimizer, *args, **kwargs)
            record = by_id.get(id(optimizer))
            try:
                if record is None:
                    recorder.on_unknown_optimizer(optimizer)
                else:
                    recorder.before_step(record)
            except Exception as error:  # noqa: BLE001 - the agent must never break the loop
                recorder.internal_error("scaler.step (before)", error)
                record = None
            try:
                result = original(optimizer, *args, **kwargs)
            except BaseException:
                recorder.active = None  # the scaler refused (misuse): record no outcome
                raise
            if record is not None:
                try:
                    recorder.after_step(record)
                except Exception as error:  # noqa: BLE001
                    recorder.internal_error("scaler.step (after)", error)
            return result

        step.__wrapped__ = original  # type: ignore[attr-defined]
        step.__doc__ = original.__doc__
        return step

    def _wrap_update(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self.recorder

        def update(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if self.attached:
                try:
                    new_scale = args[0] if args else kwargs.get("new_scale")
                    recorder.after_update(manual=new_scale is not None)
                except Exception as error:  # noqa: BLE001
                    recorder.internal_error("scaler.update", error)
            return result

        update.__wrapped__ = original  # type: ignore[attr-defined]
        update.__doc__ = original.__doc__
        return update

    def _wrap_getstate(self, owner: Any, original: Callable[[], Any]) -> Callable[[], Any]:
        # A pickled or deep-copied scaler/scheduler must be a plain, unwatched one: leave our wrappers out.
        def getstate() -> Any:
            state = original()
            if isinstance(state, dict):
                state = dict(state)
                for patched_owner, attr, previous, wrapper in self._patched:
                    if patched_owner is owner and state.get(attr) is wrapper:
                        if previous is _MISSING:
                            del state[attr]
                        else:
                            state[attr] = previous
            return state

        return getstate

    def _pre_hook(self, record: OptimizerRecord) -> Callable[..., None]:
        recorder = self.recorder

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            try:
                recorder.on_optimizer_step(record)
            except Exception as error:  # noqa: BLE001
                recorder.internal_error("optimizer step pre-hook", error)

        return hook

    def _wrap_scheduler_step(self, original: Callable[..., Any], record: OptimizerRecord,
                             label: str) -> Callable[..., Any]:
        recorder = self.recorder

        def step(*args: Any, **kwargs: Any) -> Any:
            if self.attached:
                try:
                    recorder.on_scheduler_step(record, label)
                except Exception as error:  # noqa: BLE001
                    recorder.internal_error("scheduler.step", error)
            return original(*args, **kwargs)

        step.__wrapped__ = original  # type: ignore[attr-defined]
        return step
