"""The ending of a watch: what one watch runs (:class:`Session`), the scalers watched now, the exit flush, and the
finalizer that ends a watch whose scaler was garbage-collected."""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

from ._attach import OptimizerHooks
from ._loader import Tap, close_taps
from ._recorder import Recorder
from ._sender import Sender, close_all_senders

__all__ = ["Session", "watched", "watched_lock", "register_exit_flush", "finalize_with", "NO_FINALIZER"]

watched: set[int] = set()  # ids of scalers with an open Watch
watched_lock = threading.Lock()
_open: weakref.WeakSet[Session] = weakref.WeakSet()  # for the exit flush; holds no watch alive


class Session:
    """What one watch runs, and its ending: recorder, optimizer hooks, sender. Holds no reference to the scaler.

    A scaler's finalizer may hold a session (see :func:`watch`), so that a watch
    whose scaler is garbage-collected ends too, without keeping the scaler alive.
    """

    def __init__(self, recorder: Recorder, hooks: OptimizerHooks, sender: Sender, scaler_id: int) -> None:
        self.recorder, self.hooks, self.sender, self.scaler_id = recorder, hooks, sender, scaler_id
        self.taps: list[Tap] = []  # the loaders this watch follows (watch(loader=), the integrations), the loss taps
        self.closed = False
        self._lock = threading.Lock()
        _open.add(self)

    def close(self, timeout: float | None = None, *, wait: bool = True) -> bool:
        """Detach, end open streaks, send the final batch; return False if it was already closed."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
        self.recorder.attached = False
        try:
            self.hooks.detach()
            self.close_taps()
            self.recorder.close()
        except Exception as error:  # noqa: BLE001 - closing must not fail the user's program
            self.recorder.internal_error("close", error)
        finally:
            watched.discard(self.scaler_id)
        self.sender.close(timeout, wait=wait)
        return True

    def scaler_collected(self) -> None:
        """End the watch of a scaler that was garbage-collected (a finalizer: sets flags, never blocks).

        The hooks stay on the optimizers, inert, to say once if they keep
        stepping (removing them here could break a loop iterating over them);
        the sender thread does the closing work and sends the final batch.
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.recorder.attached = False
        self.recorder.orphaned = True
        watched.discard(self.scaler_id)
        # The taps close on the sender thread, not in this finalizer: closing one takes a lock the collected
        # scaler's thread may hold. What the sender holds until then is the recorder and the taps, never the
        # session (its hooks hold the job's optimizers: they go with the trial, at once).
        taps, recorder, self.taps = self.taps, self.recorder, []

        def finish() -> None:
            close_taps(taps, recorder.errors)
            recorder.close()

        self.sender.close(wait=False, finish=finish)

    def close_taps(self) -> None:
        """Stop following every loader (each tap once; a failure is counted, the others still close)."""
        taps, self.taps = self.taps, []
        close_taps(taps, self.recorder.errors)


def _close_open_watches() -> None:
    """At exit: end every watch still open, then wait for all their final batches within one timeout."""
    for session in list(_open):
        try:
            session.close(wait=False)
        except Exception:  # noqa: BLE001 - exit must never fail because of the agent
            pass
    close_all_senders()


def register_exit_flush() -> None:
    """(Re-)register :func:`_close_open_watches` after the senders' exit flush: exit handlers run last-in first."""
    atexit.unregister(_close_open_watches)
    atexit.register(_close_open_watches)


class _NoFinalizer:
    """The finalizer of a watch without a scaler: nothing ends it but close() and the exit flush."""

    @staticmethod
    def detach() -> None:
        return None


NO_FINALIZER = _NoFinalizer()


def finalize_with(scaler: Any, session: Session) -> weakref.finalize:
    """End ``session`` when ``scaler`` is garbage-collected (not at exit: the exit flush does that)."""
    finalizer = weakref.finalize(scaler, session.scaler_collected)
    finalizer.atexit = False
    return finalizer
