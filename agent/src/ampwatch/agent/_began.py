"""Where a skipped or poisoned iteration's inf/NaN began on this rank: the ``began`` of its events.

Three answers, each found only on an iteration that skipped or was poisoned, where the agent reads the
device anyway (docs/agent.md, "Where it began"):

- the loss: every loss that goes through ``scaler.scale(loss)`` (or ``watch.loss(loss)``) is noted as it is
  (no operator, no sync: :class:`LossNotes`), and read only for such an iteration;
- a finite loss (``backward``): the first parameter, in the order backward produced the gradients, whose
  gradient held inf/NaN. The order is learned by :class:`BackwardOrder` (a tensor hook per parameter for
  one backward, then taken off), again when an offending parameter is missing from it;
- a non-finite loss (``forward``): the forward probes (:mod:`._probes`), armed at such an event, name the
  first module whose output held inf/NaN at the next occurrence.
"""

from __future__ import annotations

import collections
import math
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ampwatch.contract.batch import Began

from . import _device
from ._config import PROBE_ITERATIONS
from ._params import ParameterNames, scan_optimizers
from ._probes import ForwardProbes

__all__ = ["BackwardOrder", "BeganFinder", "LossNotes", "PROBE_ITERATIONS", "find_where_it_began"]

_KEPT_ITERATIONS = 8  # iterations whose losses stay readable (a fused optimizer's outcome may land a little late)
_MAX_LOSSES = 64  # losses kept per iteration as they are; more (many micro-batches) are folded into one flag
_KNOWN = 16  # iterations whose answer is kept, shared by the events of one iteration
_TENSOR = torch.Tensor


class LossNotes:
    """The losses of the iterations not yet judged, a bounded number of each: those of the open iteration as they
    were given (the job holds them as long, until its next iteration), earlier ones detached."""

    def __init__(self) -> None:
        self.open: list[torch.Tensor | float] = []
        self.folded: list[torch.Tensor] = []  # sums of the open iteration's losses folded into one flag
        self.whole = True  # the open iteration's losses are all kept as values (none larger than 0-d)
        self._kept: collections.deque[tuple[int, list[torch.Tensor | float]]] = \
            collections.deque(maxlen=_KEPT_ITERATIONS)

    def note(self, loss: Any) -> None:
        """Keep ``loss`` (a tensor, an iterable of them, or a number) for the open iteration. A 0-d tensor is
        kept as it is (no operator); a larger one as its finite flag (two small kernels)."""
        if isinstance(loss, torch.Tensor):
            self._keep(loss)
        elif isinstance(loss, (int, float)):
            self.open.append(float(loss))
        elif isinstance(loss, Iterable) and not isinstance(loss, (str, bytes)):
            for item in loss:
                if isinstance(item, torch.Tensor):
                    self._keep(item)

    def _keep(self, loss: torch.Tensor) -> None:
        # No ``no_grad``: entering and leaving it costs more than what it guards, and nothing here records a graph.
        if loss.ndim != 0:
            self.whole = False  # kept as a flag: the iteration's loss has no value for the spike watch
        self.open.append(loss if loss.ndim == 0 else torch.isfinite(loss.detach()).all())
        self.fold()

    def fold(self) -> None:
        """Past :data:`_MAX_LOSSES` losses in the open iteration (many micro-batches), keep one flag for them."""
        opened = self.open
        if len(opened) > _MAX_LOSSES:
            values = [t.detach().float() for t in opened if isinstance(t, torch.Tensor) and t.dtype != torch.bool]
            if values:  # their sum, for the spike watch (one stack and sum per _MAX_LOSSES losses)
                try:
                    self.folded.append(torch.stack(values).sum())
                except RuntimeError:  # losses on several devices: no value this iteration
                    self.whole = False
            self.open = [_all_finite([t for t in opened if isinstance(t, torch.Tensor)]),
                         *[t for t in opened if not isinstance(t, torch.Tensor)]]

    def assign(self, iteration: int, keep: bool) -> None:
        """The losses noted so far belong to ``iteration``: kept, detached, while it may still be asked about
        (``keep``), else let go."""
        opened, self.open = self.open, []
        if self.folded or not self.whole:
            self.folded, self.whole = [], True
        if not keep:
            return
        detached = [loss.detach() if isinstance(loss, torch.Tensor) else loss for loss in opened]
        if self._kept and self._kept[-1][0] == iteration:
            self._kept[-1][1].extend(detached)
        else:
            self._kept.append((iteration, detached))

    def finite(self, iteration: int, current: bool) -> bool | None:
        """Whether every loss of ``iteration`` was finite (None: none noted). One device-to-host copy per device."""
        losses = [loss for i, kept in self._kept if i == iteration for loss in kept]
        if current:
            losses += self.open
        if not losses:
            return None
        numbers = [loss for loss in losses if not isinstance(loss, torch.Tensor)]
        if not all(math.isfinite(n) for n in numbers):
            return False
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for loss in losses:
            if isinstance(loss, torch.Tensor):
                by_device.setdefault(loss.device, []).append(loss)
        return all(_device.read_later(_all_finite(tensors)).wait()[0] for tensors in by_device.values())

    def close(self) -> None:
        self.open, self._kept = [], collections.deque(maxlen=_KEPT_ITERATIONS)


def _all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One 0-d bool: whether every tensor (a detached loss, or a flag already) holds only finite values."""
    flags = [t if t.dtype == torch.bool else torch.isfinite(t.detach()).all() for t in tensors]
    return flags[0] if len(flags) == 1 else torch.stack(flags).all()


class BackwardOrder:
    """The order backward produced the parameters' gradients, learned with hooks that come off again.

    :meth:`learn` puts a tensor hook on each parameter that takes a gradient; each notes its parameter's
    position the first time it fires (several micro-batches: the first backward's order) and returns
    nothing, so the gradient goes on unchanged. :meth:`settle`, at the end of an iteration in which they
    fired, takes them off and keeps the order.
    """

    def __init__(self, errors: Any) -> None:
        self.errors = errors
        self.learning = False
        self._position: dict[int, int] = {}  # id(parameter) -> its position in the learned order
        self._fresh: dict[int, int] = {}  # the order being learned
        self._handles: list[Any] = []
        self._bare: list[weakref.ref] = []  # parameters that had no tensor hook before ours

    def learn(self, params: Iterable[torch.Tensor]) -> None:
        """Put the hooks on (once; parameters frozen now are left out: a later :meth:`first` learns again)."""
        if self.learning:
            return
        fresh: dict[int, int] = {}
        self._fresh = fresh
        try:
            for param in params:
                if param.requires_grad:
                    if param._backward_hooks is None:
                        self._bare.append(weakref.ref(param))
                    self._handles.append(param.register_hook(_noter(fresh, id(param))))
            self.learning = True
        except Exception as error:  # noqa: BLE001 - without the order, no parameter is named
            self.errors.report("backward order", error)
            self._remove()

    def settle(self) -> None:
        """Keep the order learned, if some backward ran, and take the hooks off (Python only)."""
        if self.learning and self._fresh:
            self._position = self._fresh
            self._fresh = {}
            self._remove()

    def first(self, offenders: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Return the offender whose gradient backward produced first; None when one of them is not in the order
        (the graph changed since it was learned: it is learned again at the next backward)."""
        position = self._fresh if self.learning and self._fresh else self._position
        first: tuple[int, torch.Tensor] | None = None
        for param in offenders:
            rank = position.get(id(param))
            if rank is None:
                return None
            if first is None or rank < first[0]:
                first = (rank, param)
        return first[1] if first is not None else None

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        # A removed hook leaves its tensor's (private) hook dict in place, and autograd then calls into Python
        # for it at every backward (about 0.3 us per parameter): a parameter that had none gets none back.
        for ref in self._bare:
            param = ref()
            if param is not None and not param._backward_hooks:
                param._backward_hooks = None
        self._bare.clear()
        self.learning = False

    def close(self) -> None:
        self._remove()
        self._position, self._fresh = {}, {}


def _noter(positions: dict[int, int], key: int) -> Any:
    """A gradient hook that notes ``key``'s position the first time it fires; holds no parameter (no cycle)."""
    @torch.utils.hooks.unserializable_hook
    def note(grad: torch.Tensor) -> None:
        if key not in positions:
            positions[key] = len(positions)
    return note


class BeganFinder:
    """Find the ``began`` of one rank's skipped or poisoned iterations (one answer per iteration, shared by its
    events).

    ``optimizers``: a callable returning the watched optimizers (their parameters are the ones judged);
    ``model``: the module that names parameters' owners and takes the forward probes (None: neither);
    ``origin``: the :class:`~._origin.LocalGradients` of ``watch(ddp=)`` (set by ``watch()``), whose notes are
    this rank's own gradients.
    """

    def __init__(self, optimizers: Any, names: ParameterNames, model: torch.nn.Module | None, errors: Any,
                 probe_iterations: int = PROBE_ITERATIONS) -> None:
        self.optimizers = optimizers
        self.names = names
        self.errors = errors
        self.origin: Any = None
        self.losses = LossNotes()
        self.spikes: Any = None  # set by watch(): the SpikeWatch that takes each iteration's loss
        self.order = BackwardOrder(errors)
        self.probes = ForwardProbes(model, errors, probe_iterations)
        self._owners: dict[int, tuple[str, str]] = {}  # id(parameter) -> (owning module's path, class name)
        if model is not None:
            for path, module in model.named_modules():
                for param in module.parameters(recurse=False):
                    self._owners.setdefault(id(param), (path, type(module).__name__))
        self._known: dict[int, Began] = {}
        self._ordering = False  # the order was learned, or is being learned

    def note_loss(self, loss: Any) -> None:
        """Note a loss of the open iteration (``scaler.scale`` or ``watch.loss``): Python only, no kernel for a
        0-d loss. The first one puts the order-learning hooks on, for the backward that follows it."""
        if type(loss) is _TENSOR and loss.ndim == 0:  # the usual loss, at the fewest calls: kept as it is
            opened = self.losses.open
            opened.append(loss)
            if len(opened) > _MAX_LOSSES:
                self.losses.fold()
        else:
            self.losses.note(loss)
        if not self._ordering:
            self._learn()

    def assign(self, iteration: int, keep: bool = True) -> None:
        """What was noted so far belongs to ``iteration`` (its end with a scaler; each step without one); ``keep``:
        its losses may still be asked about (a check or outcome still to come), else they are let go.
        A healthy iteration with a scaler: a few attribute reads."""
        losses = self.losses
        if losses.open:
            if self.spikes is not None:
                try:
                    self.spikes.losses(iteration, losses.open, losses.folded, losses.whole)
                except Exception as error:  # noqa: BLE001 - the loss's spike is not judged, the rest goes on
                    self.errors.report("loss spike", error)
            losses.assign(iteration, keep)
        probes = self.probes
        if probes.on or probes.open:
            probes.assign(iteration)
        if self.order.learning:
            self.order.settle()
        elif not self._ordering:  # a job that passes no loss: learn the order in the next iteration's backward
            self._learn()

    def _learn(self) -> None:
        self._ordering = True
        self.order.learn(self._params())

    def add_to(self, event: Any, iteration: int, current: bool,
               offenders: Sequence[torch.Tensor] | None = None) -> None:
        """Put ``began`` in a skip or poisoned-step ``event`` of ``iteration``; failures counted, never raised.

        ``current``: the iteration's gradients are still there. ``offenders``: the parameters whose gradients
        held inf/NaN, when a scan of the caller already knows them (else found here: with ``ddp=`` from this
        rank's own gradients, else one scan when ``current``).
        """
        try:
            began = self._known.get(iteration)
            if began is None:
                began = self._find(iteration, current, offenders)
                self._known[iteration] = began
                while len(self._known) > _KNOWN:
                    del self._known[next(iter(self._known))]
            event["began"] = dict(began)
        except Exception as error:  # noqa: BLE001 - the event itself is still reported
            self.errors.report("began", error)

    def _find(self, iteration: int, current: bool, offenders: Sequence[torch.Tensor] | None) -> Began:
        finite = self.losses.finite(iteration, current)
        began: Began = {"loss_finite": finite}
        if finite is False:
            began["stage"] = "forward"
            self._forward(began, iteration, current)
            return began
        if finite:
            began["stage"] = "backward"
        bad = self._offenders(iteration, current, offenders)
        if not bad:
            return began
        first = self.order.first(bad)
        if first is None:  # the graph changed (a branch, a parameter unfrozen): learn the order again
            self.order.learn(self._params())
            return began
        began["param"] = self._name(first)
        owner = self._owners.get(id(first))
        if owner is not None:
            began["module"], began["module_type"] = owner
        return began

    def _forward(self, began: Began, iteration: int, current: bool) -> None:
        probes = self.probes
        if not probes.available:
            began["probe"] = "unavailable"
            return
        if probes.noted(iteration, current):  # they saw this forward
            found = probes.first_nonfinite(iteration, current)
            probes.disarm()
            began["probe"] = "found"
            if found is not None:
                began["module"], began["module_type"] = found
            return
        if probes.on and iteration > probes.armed_at:
            # On for this whole iteration, they saw none of its forward: it ran where they cannot look (compiled
            # by a torch.compile the watch was not given): never armed again for this model.
            probes.close()
            began["probe"] = "unavailable"
            return
        began["probe"] = "armed" if probes.arm(iteration) else "unavailable"

    def _offenders(self, iteration: int, current: bool,
                   offenders: Sequence[torch.Tensor] | None) -> Sequence[torch.Tensor]:
        origin = self.origin
        if origin is not None:
            report, _ = origin.report(iteration, current)  # kept from the event's own origin read: no second sync
            if report is not None:
                return [origin.parameters[slot] for slot in report.slots]
        if offenders:
            return offenders
        if not current:
            return []
        # One flags-only scan of every watched optimizer (a sharded gradient in this rank's shard: no collective).
        optimizers = self.optimizers()
        reports = scan_optimizers([(o, "grads") for o in optimizers], self.names, unnamed=[True] * len(optimizers))
        return [param for report in reports for param in report.flagged]

    def _params(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for optimizer in self.optimizers():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    seen.setdefault(id(param), param)
        return list(seen.values())

    def _name(self, param: torch.Tensor) -> str:
        """The parameter's name as ``params[]`` names it (a sharded one with its shard)."""
        for optimizer in self.optimizers():
            for g, group in enumerate(optimizer.param_groups):
                for i, p in enumerate(group["params"]):
                    if p is param:  # ParameterNames' own function: a name, not a naming scan (tests time those)
                        return ParameterNames.name(self.names, param, g, i)
        known = self.names.known(param)  # a DDP parameter no watched optimizer holds
        return known if known is not None else f"parameter {list(param.shape)}"

    def close(self) -> None:
        """Take every hook off and let go of every tensor."""
        self.order.close()
        self.probes.close()
        self.losses.close()
        self._known = {}


def find_where_it_began(recorder: Any, model: torch.nn.Module | None, probe_iterations: int) -> BeganFinder:
    """Give ``recorder`` (and its inspection) a :class:`BeganFinder` of its optimizers (nothing is put on the model
    until the first loss)."""
    records = recorder.records

    def optimizers() -> list[torch.optim.Optimizer]:
        return [o for o in (r.optimizer_ref() for r in records) if o is not None]

    finder = BeganFinder(optimizers, recorder.names, model, recorder.errors, probe_iterations)
    finder.origin = recorder.origin
    recorder.began = recorder.inspection.began = finder
    return finder
