"""Forward probes: which module's output first held inf/NaN, armed for a bounded window after a forward start.

When a skipped or poisoned iteration's loss was not finite, the inf/NaN began in the forward pass, and
nothing the agent has kept says where. :class:`ForwardProbes` then arms ONE global forward hook
(``torch.nn.modules.module.register_module_forward_hook``) that looks only at the model's own modules: for
each floating-point tensor a module returns it notes ``torch.isfinite(out).all()`` (a 0-d bool on the
output's device: two small kernels, no sync, nothing written to the output) and the module's position.
Hooks fire when a module's forward returns, so the first noted module whose output held inf/NaN is the
innermost one that made it (a parent returns after its children). The flags are read (one device-to-host
copy) only at the next skipped or poisoned iteration whose loss was not finite. The hook comes off once
it has named a module, after ``iterations`` iterations, and at ``close()``.

One global hook, not one per module: nothing of it is put on the user's modules, so a model pickled,
deep-copied (an EMA twin) or saved while the probes are armed holds nothing of ampwatch, and a copy never
carries a probe away. Forwards without autograd (``no_grad``, evaluation) are not noted.

A compiled model (``torch.compile``: an ``OptimizedModule`` or a module compiled with ``.compile()``) takes
no probe (``unavailable``): a hook would be traced into its graphs. Should a compiled region run the hook
anyway (the job compiled a model the watch was not given), the hook notes nothing while torch.compile is at
work, so it adds nothing to a graph.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch

from . import _device
from ._compiled import compiling, is_compiled_module

__all__ = ["ForwardProbes", "ModuleFound"]

_KEPT_ITERATIONS = 8  # iterations whose flags stay readable (a fused optimizer's outcome may land a little late)
_MAX_FLAGS = 1 << 16  # flags noted per iteration at most (many micro-batches of a large model): later ones dropped

ModuleFound = tuple[str, str]
"""``(path, class name)`` of a module."""


class ForwardProbes:
    """Arm, read and disarm the forward probes of one model (``model`` None: never available)."""

    def __init__(self, model: torch.nn.Module | None, errors: Any, iterations: int) -> None:
        self.errors = errors
        self.iterations = iterations
        self.available = model is not None and iterations > 0 and not is_compiled_module(model)
        self._model = weakref.ref(model) if model is not None else None  # the watch never keeps a model alive
        self._handle: Any = None
        self._left = 0  # iterations the armed probes still watch
        self._index: dict[int, int] = {}  # id(module) -> position in ``_modules``, while armed
        self._modules: list[ModuleFound] = []
        self.open: list[tuple[int, torch.Tensor]] = []  # (module position, finite flag) of the open iteration
        self.on = False  # armed: the hook is on (a plain attribute: read at every iteration's end)
        self.armed_at = -1  # the iteration they were last put on at
        self._kept: collections.deque[tuple[int, list[tuple[int, torch.Tensor]]]] = \
            collections.deque(maxlen=_KEPT_ITERATIONS)
        self._last: int | None = None

    def arm(self, iteration: int) -> bool:
        """Put the probes on, at ``iteration``, for the next ``iterations`` iterations; return whether they are on."""
        model = self._model() if self._model is not None else None
        if not self.available or model is None:
            return False
        if self._handle is not None:
            return True
        try:
            named = list(model.named_modules(remove_duplicate=True))
            self._modules = [(path, type(module).__name__) for path, module in named]
            self._index = {id(module): k for k, (_, module) in enumerate(named)}
            self.open = []
            self._handle = torch.nn.modules.module.register_module_forward_hook(self._probe)
            self.on = True
            self.armed_at = iteration
            self._left = self.iterations
        except Exception as error:  # noqa: BLE001 - no probe: the event says unavailable
            self.errors.report("forward probes", error)
            self.available = False
            self.disarm()
            return False
        return True

    def _probe(self, module: Any, args: Any, output: Any) -> None:
        # Read-only: returns None, so the output goes on as the module returned it.
        position = self._index.get(id(module))
        if position is None or not torch.is_grad_enabled() or compiling():
            return
        opened = self.open
        if len(opened) >= _MAX_FLAGS:
            return
        try:
            for tensor in _tensors(output):
                if tensor.is_floating_point() or tensor.is_complex():
                    opened.append((position, torch.isfinite(tensor.detach()).all()))
        except Exception as error:  # noqa: BLE001 - never fail the forward
            self.errors.report("forward probe", error)

    def assign(self, iteration: int) -> None:
        """The flags noted so far belong to ``iteration``; count the window down (once per iteration)."""
        if self.open:
            if self._kept and self._kept[-1][0] == iteration:
                self._kept[-1][1].extend(self.open)
            else:
                self._kept.append((iteration, self.open))
            self.open = []
        if self._handle is not None and iteration != self._last:
            self._last = iteration
            self._left -= 1
            if self._left <= 0:
                self.disarm()

    def first_nonfinite(self, iteration: int, current: bool) -> ModuleFound | None:
        """Return the first module, in the order their forwards returned, whose output held inf/NaN in
        ``iteration`` (None when none did, or nothing was noted). One device-to-host copy per device."""
        noted = [flag for i, flags in self._kept if i == iteration for flag in flags]
        if current:
            noted += self.open
        if not noted:
            return None
        by_device: dict[torch.device, list[int]] = {}
        for k, (_, flag) in enumerate(noted):
            by_device.setdefault(flag.device, []).append(k)
        bad: list[int] = []
        for members in by_device.values():
            values = _device.read_later(torch.stack([noted[k][1] for k in members])).wait()
            bad += [k for k, finite in zip(members, values, strict=True) if not finite]
        if not bad:
            return None
        return self._modules[noted[min(bad)][0]]

    def noted(self, iteration: int, current: bool) -> bool:
        """Tell whether the probes noted some output in ``iteration`` (they saw its forward)."""
        return (current and bool(self.open)) or any(i == iteration and flags for i, flags in self._kept)

    def disarm(self) -> None:
        """Take the probes off (their flags stay readable for the iterations kept)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.on = False
        self._index = {}

    def close(self) -> None:
        """Take the probes off and let go of every flag and the model."""
        self.disarm()
        self.open, self._kept = [], collections.deque(maxlen=_KEPT_ITERATIONS)
        self._model, self.available = None, False


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a module's output: itself, or those of a tuple, list or dict of them (one level)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    if isinstance(output, dict):
        return [t for t in output.values() if isinstance(t, torch.Tensor)]
    return []
