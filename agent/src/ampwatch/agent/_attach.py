"""Wrap one scaler's methods, hook its optimizers and schedulers; undo it all on ``detach``.

Two parts, so that nothing the agent keeps for the optimizers holds the scaler:
:class:`ScalerPatch` lives on the scaler (and can move to another one with
``Watch.rebind``); :class:`OptimizerHooks` lives on the optimizers and
schedulers, which outlive a scaler that a resume replaced.

Nothing put on an object holds that object (no reference cycle): a job the
user drops is freed by reference counting alone, without waiting for the
cyclic garbage collector, however much memory it holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ._arguments import peel
from ._compiled import outside_graphs
from ._record import OptimizerRecord
from ._recorder import Recorder

__all__ = ["OptimizerHooks", "ScalerPatch", "record_of"]

_MISSING = object()

_in_watched_step: set[int] = set()
"""Ids of the optimizers inside a watched scaler's ``step()`` right now, whichever watch watches it."""


def _weak(owner: Any) -> Callable[[], Any]:
    """Return a weak reference to ``owner`` (a strong one for the rare object that cannot have one)."""
    try:
        return weakref.ref(owner)
    except TypeError:
        return lambda: owner


def _held_weakly(owner: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """Return a callable that calls ``original`` without holding ``owner``, when ``original`` is bound to it.

    A wrapper kept in ``owner``'s instance dict that held ``owner``'s bound method
    would be a reference cycle. Costs one weak-reference lookup per call.
    """
    if getattr(original, "__self__", None) is not owner:
        return original
    function = getattr(original, "__func__", None) or getattr(type(owner), original.__name__)
    owner_ref, what = _weak(owner), f"{type(owner).__name__}.{original.__name__}"

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = owner_ref()
        if bound is None:
            raise ReferenceError(f"{what} was called after its {what.split('.')[0]} was garbage-collected")
        return function(bound, *args, **kwargs)

    return call


def record_of(by_id: dict[int, OptimizerRecord], optimizer: Any) -> OptimizerRecord | None:
    """Return the record watching ``optimizer`` (or a wrapper around it), else None.

    Records hold their optimizers weakly, so an id may have been reused by a new object: it counts only
    if the optimizer behind it is the record's.
    """
    record = by_id.get(id(optimizer))
    if record is None or optimizer is record.optimizer or peel(optimizer)[0] is record.optimizer:
        return record
    return None


class _Patches:
    """Instance attributes set on users' objects, with what was there before; nothing of it reaches their state.

    Only instance attributes are patched (never classes), so other objects are
    untouched. Each owner's ``__getstate__`` (pickle, deepcopy) and, where it
    copies the instance dict (LR schedulers), ``state_dict`` are wrapped too,
    so that checkpoints and copies hold a plain, unwatched object.
    """

    def __init__(self) -> None:
        # (owner, attribute, what was there, our wrapper): owners and wrappers held weakly, as the wrappers
        # that keep our state out of pickles hold this list.
        self._patched: list[tuple[Callable[[], Any], str, Any, Callable[[], Any]]] = []

    def set(self, owner: Any, attr: str, wrapper: Callable[..., Any]) -> None:
        """Set ``owner.attr = wrapper``, remembering what to restore."""
        previous = vars(owner).get(attr, _MISSING)
        setattr(owner, attr, wrapper)
        self._patched.append((_weak(owner), attr, previous, weakref.ref(wrapper)))

    def hide_from_state(self, owner: Any, *, state_dict: bool) -> None:
        """Keep our wrappers out of ``owner``'s pickles, deep copies and (if asked) ``state_dict()``."""
        if callable(getattr(owner, "__getstate__", None)):
            self.set(owner, "__getstate__", self._clean(owner, owner.__getstate__))
        if state_dict and callable(getattr(owner, "state_dict", None)):
            self.set(owner, "state_dict", self._clean(owner, owner.state_dict))

    def restore(self) -> None:
        """Put back what was there (left alone where someone patched again on top of us)."""
        for owner_ref, attr, previous, wrapper_ref in reversed(self._patched):
            owner, wrapper = owner_ref(), wrapper_ref()
            if owner is None or wrapper is None or vars(owner).get(attr) is not wrapper:
                continue  # patched again on top of us; our wrapper passes through once detached
            if previous is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, previous)
        self._patched.clear()

    def _clean(self, owner: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        doc, original, owner_ref = original.__doc__, _held_weakly(owner, original), _weak(owner)

        def clean(*args: Any, **kwargs: Any) -> Any:
            state = original(*args, **kwargs)
            if isinstance(state, dict):
                owner = owner_ref()
                ours = [(attr, previous) for patched_ref, attr, previous, wrapper_ref in self._patched
                        if patched_ref() is owner and state.get(attr) is wrapper_ref()]
                if ours:
                    state = dict(state)
                    for attr, previous in ours:
                        if previous is _MISSING:
                            del state[attr]
                        else:
                            state[attr] = previous
            return state

        clean.__doc__ = doc
        return clean


def _all_or_nothing(patches: _Patches, install: Callable[[], None], undo: Callable[[], None]) -> None:
    """Run ``install``; if it fails part-way, undo what it did and re-raise."""
    try:
        install()
    except BaseException:
        undo()
        patches.restore()
        raise


class ScalerPatch:
    """Route ``scaler.scale``, ``scaler.step``, ``scaler.update`` and ``scaler.load_state_dict`` to a Recorder.

    Whatever goes wrong inside the agent, the wrapped call still happens exactly once.
    """

    def __init__(self, scaler: Any, recorder: Recorder) -> None:
        self.scaler = scaler
        self.recorder = recorder
        self._patches = _Patches()

    def attach(self, by_id: dict[int, OptimizerRecord]) -> None:
        """Install the wrappers (all of them or, on failure, none)."""
        scaler, patches = self.scaler, self._patches

        def install() -> None:
            patches.set(scaler, "step", self._wrap_step(scaler, scaler.step, by_id))
            patches.set(scaler, "scale", self._wrap_scale(scaler, scaler.scale))
            patches.set(scaler, "update", self._wrap_update(scaler, scaler.update))
            patches.set(scaler, "load_state_dict", self._wrap_load_state_dict(scaler, scaler.load_state_dict))
            patches.hide_from_state(scaler, state_dict=False)  # GradScaler.state_dict() lists its keys

        _all_or_nothing(patches, install, lambda: None)

    def detach(self) -> None:
        """Restore the scaler's attributes."""
        self._patches.restore()

    def _wrap_step(self, scaler: Any, original: Callable[..., Any],
                   by_id: dict[int, OptimizerRecord]) -> Callable[..., Any]:
        recorder, doc, original = self.recorder, original.__doc__, _held_weakly(scaler, original)

        def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if not recorder.attached:
                return original(optimizer, *args, **kwargs)
            record = None
            try:
                # A disabled scaler steps straight on, and the optimizer's pre-hook checks the step (unscaled).
                if recorder.unscaled is None:
                    record = record_of(by_id, optimizer)
                    if record is None:
                        recorder.on_unknown_optimizer(optimizer)
                    else:
                        recorder.before_step(record)
            except Exception as error:  # noqa: BLE001 - the agent must never break the loop
                recorder.internal_error("scaler.step (before)", error)
                record = None
            _in_watched_step.add(id(optimizer))  # an older watch of the same optimizer: not "outside" (notebooks)
            try:
                result = original(optimizer, *args, **kwargs)
            except BaseException:
                recorder.active = None  # the scaler refused (misuse): record no outcome
                raise
            finally:
                _in_watched_step.discard(id(optimizer))
            if record is not None:
                try:
                    recorder.after_step(record)
                except Exception as error:  # noqa: BLE001
                    recorder.internal_error("scaler.step (after)", error)
            return result

        step.__doc__ = doc
        return step

    def _wrap_scale(self, scaler: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        # Called once per micro-batch: no call layer beyond the wrapper itself (``_then``'s and ``_held_weakly``'s
        # would add two). The scaler's own method is called here on the scaler, held weakly; once the scaler is
        # gone (or its scale() is not its own method), through ``_held_weakly``, which says so.
        recorder, doc, call = self.recorder, original.__doc__, _held_weakly(scaler, original)
        function = getattr(original, "__func__", None) if getattr(original, "__self__", None) is scaler else None
        scaler_ref = _weak(scaler)

        def scale(outputs: Any, *args: Any, **kwargs: Any) -> Any:
            owner = scaler_ref() if function is not None else None
            result = (function(owner, outputs, *args, **kwargs) if owner is not None  # type: ignore[misc]
                      else call(outputs, *args, **kwargs))
            began = recorder.began
            if began is not None and recorder.attached:
                try:
                    began.note_loss(outputs)  # kept as it is (no operator, no sync): _began.LossNotes
                except Exception as error:  # noqa: BLE001 - the agent must never break the loop
                    recorder.internal_error("scaler.scale", error)
            return result

        scale.__doc__ = doc
        return scale

    def _wrap_update(self, scaler: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self.recorder

        def account(args: tuple, kwargs: dict) -> None:
            new_scale = args[0] if args else kwargs.get("new_scale")
            recorder.after_update(manual=new_scale is not None)

        return self._then(scaler, original, "scaler.update", account)

    def _wrap_load_state_dict(self, scaler: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self.recorder

        def account(args: tuple, kwargs: dict) -> None:
            recorder.restored(args[0] if args else kwargs["state_dict"])

        return self._then(scaler, original, "scaler.load_state_dict", account)

    def _then(self, scaler: Any, original: Callable[..., Any], site: str,
              account: Callable[[tuple, dict], None]) -> Callable[..., Any]:
        """Wrap ``original`` so that ``account(args, kwargs)`` runs after it returns, failures counted."""
        recorder, doc, original = self.recorder, original.__doc__, _held_weakly(scaler, original)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if recorder.attached:
                try:
                    account(args, kwargs)
                except Exception as error:  # noqa: BLE001 - the agent must never break the loop
                    recorder.internal_error(site, error)
            return result

        wrapper.__doc__ = doc
        return wrapper


class OptimizerHooks:
    """Step pre-hooks on the watched optimizers and wrappers on their per-step LR schedulers.

    Without a scaler, or with a disabled one (``Recorder.unscaled``: looked up at each step, since
    ``Watch.rebind`` may change it), the pre-hooks go straight to the :class:`~._poison.PoisonCheck`, and
    an optimizer whose step is given a closure (which computes its gradients inside) gets a step post-hook too.

    Holds no reference to the scaler.
    """

    def __init__(self, recorder: Recorder, schedulers: list[tuple[OptimizerRecord, str, Any]]) -> None:
        self.recorder = recorder
        self._schedulers = schedulers
        self._handles: list[Any] = []
        self._patches = _Patches()

    def attach(self) -> None:
        """Register the hooks and wrap the schedulers (all of them or, on failure, none)."""
        def install() -> None:
            for record in self.recorder.records:
                self._handles.append(record.optimizer.register_step_pre_hook(self._pre_hook(record)))
            for record, label, scheduler in self._schedulers:
                step = _held_weakly(scheduler, scheduler.step)
                self._patches.set(scheduler, "step", self._wrap_scheduler_step(step, record, label))
            for scheduler in {id(s): s for _, _, s in self._schedulers}.values():
                self._patches.hide_from_state(scheduler, state_dict=True)

        _all_or_nothing(self._patches, install, self._remove_handles)

    def detach(self) -> None:
        """Remove the hooks and restore the schedulers."""
        self._remove_handles()
        self._patches.restore()

    def _remove_handles(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, record: OptimizerRecord) -> Callable[..., None]:
        # Holds nothing that holds the optimizer (``self`` holds the schedulers, which do): no reference cycle.
        recorder, handles = self.recorder, self._handles
        post_hook: list[Any] = []  # its handle, once registered

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            try:
                unscaled = recorder.unscaled
                if unscaled is None:
                    recorder.on_optimizer_step(record, in_watched_step=id(optimizer) in _in_watched_step)
                    return
                # Unscaled, whether the step was given a closure decides when its gradients are read (torch
                # passes the hook step()'s own arguments, the optimizer first: a closure is the second).
                closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
                if closure is not None and not post_hook:
                    # A step with a closure makes its gradients inside: read them in a post-hook, registered at
                    # the first such step (torch runs it after this very step), so that other jobs' steps pay
                    # for no second hook.
                    post_hook.append(optimizer.register_step_post_hook(_post_hook(recorder, record)))
                    handles.append(post_hook[0])
                unscaled.on_step(recorder, record, closure is not None)  # straight on: the recorder adds nothing
            except Exception as error:  # noqa: BLE001
                recorder.internal_error("optimizer step pre-hook", error)

        return outside_graphs(hook)  # a compiled step (torch.compile) must not trace it or compile what it calls

    def _wrap_scheduler_step(self, original: Callable[..., Any], record: OptimizerRecord,
                             label: str) -> Callable[..., Any]:
        recorder = self.recorder

        def step(*args: Any, **kwargs: Any) -> Any:
            if recorder.attached:
                try:
                    recorder.on_scheduler_step(record, label)
                except Exception as error:  # noqa: BLE001
                    recorder.internal_error("scheduler.step", error)
            return original(*args, **kwargs)

        return step


def _post_hook(recorder: Recorder, record: OptimizerRecord) -> Callable[..., None]:
    """Return the step post-hook that checks the gradients a step given a closure made (unscaled)."""
    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            unscaled = recorder.unscaled
            if unscaled is not None:
                unscaled.after_step(recorder, record)
        except Exception as error:  # noqa: BLE001
            recorder.internal_error("optimizer step post-hook", error)

    return outside_graphs(hook)  # as the pre-hook
