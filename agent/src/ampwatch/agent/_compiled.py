"""Keep the agent's hooks out of what ``torch.compile`` makes of an optimizer step.

PyTorch's compiled-optimizer recipe compiles ``optimizer.step()``. Dynamo then meets the step pre-hooks
in two ways: it traces them (and would bake what the agent reads at trace time, a gradient check's answer,
into the graph as a constant), or, where it falls back to running a frame as Python (it does so for
``Optimizer``'s step wrapper, which a hook's graph break defeats), it compiles each function the hook calls
as a frame of its own, with the same effect one level down. Either way every later step would look like
the traced one. A hook made by :func:`outside_graphs` runs its body as Python at every step while
torch.compile is at work, with Dynamo off for it and everything it calls: a graph break before the step's
own graphs, which torch's optimizers break around anyway (``torch._dynamo.graph_break()`` in
``Optimizer._use_grad``: a compiled step is never one whole graph).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compiling", "is_compiled_module", "outside_graphs"]


def _never() -> bool:
    return False


def _no_callback() -> None:
    return None


_is_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", _never)
# Private (torch._C._dynamo): the callback Dynamo sets on every frame that starts while a compiled function
# runs; None (or False: run cached code only) when no frame would be compiled. Missing: only tracing is seen.
_frame_callback: Callable[[], Any] = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
                                             "get_eval_frame_callback", _no_callback)


def compiling() -> bool:
    """Tell whether torch.compile is at work around the caller: tracing it, or running it as Python between graphs.

    ``torch.compiler.is_compiling()`` comes first: Dynamo knows it (a constant True while it traces), so
    it never traces the private callback read after it.
    """
    return _is_compiling() or _frame_callback() not in (None, False)


def outside_graphs(body: Callable[..., None]) -> Callable[..., None]:
    """Return a hook that calls ``body``, with Dynamo off for it and all it calls while torch.compile is at work.

    Costs about 0.1 us per call in eager mode (this test and one more call). Makes the wrapper with
    ``torch.compiler.disable`` at once, which imports Dynamo unless it is imported already (torch's own
    optimizers import it when they are made). Where that fails (a torch without Dynamo), ``body`` itself
    is the hook: nothing can compile the step. Neither function holds the other: no reference cycle.
    """
    try:
        disabled = torch.compiler.disable(body, recursive=True)
    except Exception:  # noqa: BLE001 - watch() must not fail because torch.compile cannot run here
        return body

    def hook(*args: Any) -> None:
        if compiling():
            return disabled(*args)
        return body(*args)

    return hook


def is_compiled_module(model: torch.nn.Module) -> bool:
    """Tell whether ``model`` or one of its modules is compiled: a ``torch.compile`` wrapper (``OptimizedModule``,
    private: ``torch._dynamo.eval_frame``) or a module compiled in place (``module.compile()``)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    optimized = getattr(eval_frame, "OptimizedModule", None)
    for module in model.modules():
        if (optimized is not None and isinstance(module, optimized)) or \
                getattr(module, "_compiled_call_impl", None) is not None:
            return True
    return False
