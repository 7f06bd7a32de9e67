"""A rank's loss and gradient-norm spikes: each iteration's values read without a sync, judged, reported.

Two kinds of series, each judged by :class:`~._spikes.SpikeSeries` (docs/agent.md, "Spikes"):

- the loss: the sum of the losses noted in an iteration (``scaler.scale(loss)``, ``watch.loss(loss)``, the
  integrations), taken when the iteration's losses are assigned to it (:meth:`SpikeWatch.losses`);
- each optimizer's gradient norm (:meth:`SpikeWatch.note_norm`: ``watch.grad_norm()``, or computed in its step
  pre-hook with ``grad_norm=True``), judged once its step's outcome is known: a step the scaler skipped gives no
  value (its skip event reports it).

On CPU a value is read at once (``tolist``: no operator, no sync). On a device it is summed there and copied to
pinned memory without blocking (:func:`._device.read_later`), then read once it has landed, normally at the next
iteration's end; values are judged in the order they were taken. A spike is counted (``loss_spikes``,
``grad_norm_spikes``) and sent as an event at the rungs of its run (1st, 2nd, 4th, ... in consecutive
iterations), with the iteration's samples. Nothing here changes training.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ampwatch.contract.batch import GradNormSpikeEvent, LossSpikeEvent, RankState

from . import _device
from ._errors import AgentErrors
from ._events import EventBuffer
from ._poison import gradients
from ._samples import SampleLog
from ._spikes import Spike, SpikeSeries

__all__ = ["SpikeWatch", "grad_norm_of"]

_MAX_PENDING = 64  # reads in flight before we wait for the oldest (only if the device lags far behind)
_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
_LOSS = ""  # the loss series' key beside the optimizers' names (an optimizer's name is never empty)


class _Value:
    """One iteration's value on its way: a host part and the device parts still being copied."""

    __slots__ = ("key", "iteration", "host", "reads")

    def __init__(self, key: str, iteration: int, host: float, reads: list[_device.PendingRead]) -> None:
        self.key, self.iteration, self.host, self.reads = key, iteration, host, reads

    def done(self) -> bool:
        return all(read.done() for read in self.reads)

    def value(self) -> float:
        return self.host + sum(read.wait()[0] for read in self.reads)


class SpikeWatch:
    """The spike series of one rank: its loss, and each optimizer's gradient norm.

    ``samples``: returns the rank's :class:`~._samples.SampleLog` (None: no ids recorded), read when an event is
    built. ``compute``: with ``grad_norm=True``, each step computes its optimizer's gradient norm itself. What
    the recorder's hooks call never raises: a failure is counted in ``errors`` and the step's accounting goes on.
    """

    def __init__(self, events: EventBuffer, window: int, sigma: float, samples: Callable[[], SampleLog | None],
                 compute: bool = False, errors: AgentErrors | None = None) -> None:
        self.events = events
        self.errors = errors if errors is not None else AgentErrors()
        self.window, self.sigma = window, sigma
        self.samples = samples
        self.compute = compute
        self.series: dict[str, SpikeSeries] = {}  # _LOSS and the optimizers' names, made at their first value
        self._last: dict[str, int] = {}  # the last iteration each series judged
        self._loss_taken: int | None = None  # the last iteration whose loss was taken (it may still be on its way)
        self._noted: dict[str, collections.deque[tuple[int, Any]]] = {}  # norms waiting for their step's outcome
        self._outcome: dict[str, tuple[int, bool]] = {}  # each optimizer's latest outcome: (iteration, stepped)
        self._pending: collections.deque[_Value] = collections.deque()

    # ----- the loss ------------------------------------------------------------------------

    def losses(self, iteration: int, losses: Sequence[Any], folded: Sequence[Any] = (), whole: bool = True) -> None:
        """Take the loss of ``iteration``: the sum of ``losses`` (0-d tensors and numbers, as noted; finite flags
        of losses folded away are passed over) and of ``folded`` (those losses' sums). No value unless ``whole``
        (a loss of more than one element is kept only as a flag)."""
        if self._loss_taken == iteration:
            return  # an iteration's losses are taken once (a closure's, after its step's)
        self._loss_taken = iteration
        if not whole:
            self._judge(_LOSS, iteration, None, current=True)
            return
        host = 0.0
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        boolean = torch.bool
        for loss in (*losses, *folded) if folded else losses:
            if type(loss) is float:
                host += loss
            elif loss.dtype is boolean:
                continue
            elif loss.is_cpu:
                host += loss.tolist()  # a 0-d CPU tensor: a float, read without an operator
            else:
                by_device.setdefault(loss.device, []).append(loss)
        self._take(_LOSS, iteration, host, by_device)

    # ----- the gradient norms --------------------------------------------------------------

    def note_norm(self, name: str, iteration: int, norm: Any) -> None:
        """Note ``norm`` (a tensor or a number) as optimizer ``name``'s gradient norm in ``iteration``: judged at
        its step's outcome, or now when that is known already (the norm was handed over after the step)."""
        outcome = self._outcome.get(name)
        if outcome is not None and outcome[0] == iteration:
            self._norm(name, norm, iteration, outcome[1])
            return
        noted = self._noted.get(name)
        if noted is None:
            noted = self._noted[name] = collections.deque(maxlen=_MAX_PENDING)
        if noted and noted[-1][0] == iteration:
            noted.pop()  # handed over twice in one iteration: the later one
        noted.append((iteration, norm))

    def outcome(self, name: str, stepped: bool, iteration: int) -> None:
        """Optimizer ``name``'s step in ``iteration`` went through (``stepped``) or was skipped."""
        self._outcome[name] = (iteration, stepped)
        noted = self._noted.get(name)
        if noted:
            while noted and noted[0][0] < iteration:
                noted.popleft()  # a step that never came (its outcome went elsewhere): no value
            if noted and noted[0][0] == iteration:
                try:
                    self._norm(name, noted.popleft()[1], iteration, stepped)
                except Exception as error:  # noqa: BLE001 - the step is still counted
                    self.errors.report("grad_norm spike", error)

    def compute_norm(self, name: str, iteration: int, optimizer: torch.optim.Optimizer) -> None:
        """``grad_norm=True``: note the norm of the gradients ``optimizer`` is about to apply (its step pre-hook;
        a fused optimizer's, still scaled there, divided by the scale it was handed)."""
        try:
            grads, _ = gradients(optimizer)
            scale = getattr(optimizer, "grad_scale", None)
            norm = grad_norm_of(grads, scale if isinstance(scale, torch.Tensor) else None)
            if norm is not None:
                self.note_norm(name, iteration, norm)
        except Exception as error:  # noqa: BLE001 - the step goes on, and is counted
            self.errors.report("grad_norm", error)

    def _norm(self, name: str, norm: Any, iteration: int, stepped: bool) -> None:
        if not stepped:
            self._judge(name, iteration, None, current=True)  # row 1: a skipped step's norm is never judged
        elif isinstance(norm, torch.Tensor):
            if norm.is_cpu:
                self._take(name, iteration, _device.host_scalar(norm), {})
            else:
                self._take(name, iteration, 0.0, {norm.device: [norm.reshape(())]})
        else:
            self._take(name, iteration, float(norm), {})

    # ----- reading and judging -------------------------------------------------------------

    def _take(self, key: str, iteration: int, host: float, by_device: dict[torch.device, list[torch.Tensor]]
              ) -> None:
        if not by_device and not self._pending:
            self._judge(key, iteration, host, current=True)  # on the host already: now, in the fewest calls
            return
        reads = [_device.read_later(_summed(tensors)) for tensors in by_device.values()]
        self._pending.append(_Value(key, iteration, host, reads))
        self.resolve()
        if len(self._pending) > _MAX_PENDING:
            value = self._pending.popleft()
            self._judge(value.key, value.iteration, value.value())

    def resolve(self, wait: bool = False) -> None:
        """Judge the values that have landed, in order (``wait``: all of them, waiting for the device)."""
        pending = self._pending
        while pending and (wait or pending[0].done()):
            value = pending.popleft()
            self._judge(value.key, value.iteration, value.value())

    def _judge(self, key: str, iteration: int, value: float | None, current: bool = False) -> None:
        """Judge ``iteration``'s value of series ``key``; ``current``: it is the iteration in progress (its sample
        ids recorded so far are its)."""
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = SpikeSeries(self.window, self.sigma)
        last = self._last.get(key)
        if last is not None and iteration > last + 1:
            series.observe(None)  # iterations without a value in between: a run of spikes ends
        self._last[key] = iteration
        spike = series.observe(value)
        if spike is not None and spike.rung:
            self._report(key, iteration, spike, current)

    def _report(self, key: str, iteration: int, spike: Spike, current: bool) -> None:
        event: LossSpikeEvent | GradNormSpikeEvent
        if key == _LOSS:
            event = {"kind": "loss_spike", "iteration": iteration, "value": spike.value, "mean": spike.mean,
                     "std": spike.std, "z": spike.z, "streak": spike.streak}
        else:
            event = {"kind": "grad_norm_spike", "iteration": iteration, "optimizer": key, "local": False,
                     "value": spike.value, "mean": spike.mean, "std": spike.std, "z": spike.z, "streak": spike.streak}
        samples = self.samples()
        if samples is not None:
            samples.describe(event, iteration, current=current, first=False)
        self.events.append(event)

    # ----- state ---------------------------------------------------------------------------

    def add_to(self, state: RankState) -> None:
        """Put the spike counters and levels in ``state`` (the sender thread; only what is nonzero or present)."""
        try:
            self._add_to(state)
        except Exception as error:  # noqa: BLE001 - the rest of the state is still sent
            self.errors.report("spike state", error)

    def _add_to(self, state: RankState) -> None:
        for key, one in list(self.series.items()):
            counters: Any = state if key == _LOSS else state["optimizers"].get(key)
            if counters is None:
                continue
            if one.spikes:
                counters["loss_spikes" if key == _LOSS else "grad_norm_spikes"] = one.spikes
            level = one.level()
            if level is not None:
                counters["loss" if key == _LOSS else "grad_norm"] = level

    def close(self) -> None:
        """Judge every value still on its way (may wait for the device once)."""
        try:
            self.resolve(wait=True)
        except Exception as error:  # noqa: BLE001 - the watch still closes
            self.errors.report("spike close", error)
        self._noted.clear()


def _summed(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One 0-d tensor: the sum of ``tensors`` (0-d, one device), on the device; one kernel for several."""
    if len(tensors) == 1:
        return tensors[0]
    try:
        return torch.stack(tensors).sum()
    except (RuntimeError, TypeError):  # mixed dtypes
        return torch.stack([t.float() for t in tensors]).sum()


def grad_norm_of(gradients: list[torch.Tensor], grad_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """The total L2 norm of ``gradients`` (one device each group; no sync), divided by ``grad_scale`` (a fused
    optimizer's, whose gradients are still scaled in its pre-hook); None when there are none.

    ``torch.nn.utils.get_total_norm`` (``torch._foreach_norm`` per device and dtype, and one norm of those), as
    ``clip_grad_norm_`` computes it.
    """
    if not gradients:
        return None
    with torch.no_grad():
        if _total_norm is not None:
            norm = _total_norm(gradients, foreach=None)
        else:  # torch before 2.6: one norm per gradient, then one of those
            first = gradients[0].device
            norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g).to(first, torch.float32) for g in gradients]))
        if grad_scale is not None:
            norm = norm / grad_scale.to(norm.device).reshape(())
    return norm
