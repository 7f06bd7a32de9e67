"""A job whose inf/NaN begins where the test says: in backward at a known layer, or in the forward of a known module.

:class:`Tower` is ``x -> p1 -> p2 -> p3 -> [inf gradient] -> spike -> out``, its modules registered in the order
``p2, p3, p1, spike, out``: backward produces ``out``'s gradient first, then ``p3``'s, ``p2``'s, ``p1``'s, an order
that neither ``named_parameters()`` nor its reverse gives. With ``fire_backward`` set, :class:`InfGradient` makes
the gradient reaching ``p3``'s output inf, so ``p3.weight`` is the first gradient backward makes non-finite (and
``p2``'s, ``p1``'s after it). An input row of 1e4 makes ``spike`` (an ``exp``) return inf: the first module whose
output is not finite, the loss then non-finite. Used by agent/tests/test_where_it_began.py in one process and by
``ampwatch_support.began_worker`` over real DDP ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["Exp", "InfGradient", "Tower", "digest", "forward_hooks", "global_forward_hooks", "run"]

HUGE = 1e4  # an input value that exp() turns into inf after the three layers


class InfGradient(torch.autograd.Function):
    """The identity forward; backward hands on a gradient full of inf."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf"))


class Exp(nn.Module):
    """``exp(x)``: inf where ``x`` is large."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


class Tower(nn.Module):
    """Modules registered ``p2, p3, p1, spike, out``, used ``p1, p2, p3, spike, out`` (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.p2 = nn.Linear(8, 8, bias=False)
        self.p3 = nn.Linear(8, 8, bias=False)
        self.p1 = nn.Linear(8, 8, bias=False)
        self.spike = Exp()
        self.out = nn.Linear(8, 4)
        self.fire_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.p3(torch.relu(self.p2(torch.relu(self.p1(x)))))
        if self.fire_backward:
            h = InfGradient.apply(h)
        return self.out(self.spike(h * 0.1))


def digest(params) -> str:
    """The weights' bits, hashed (NaN equals itself this way; on a GPU, one copy to the host; no numpy: a GPU
    machine running ``bench.gpu`` may lack it)."""
    return hashlib.sha256(b"".join(bytes(p.detach().contiguous().view(torch.uint8).cpu().reshape(-1).tolist())
                                   for p in params)).hexdigest()


def forward_hooks(model: nn.Module) -> int:
    """Forward hooks (and pre-hooks) on ``model``'s own modules."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def global_forward_hooks() -> int:
    """Global forward hooks (``register_module_forward_hook``), every module's."""
    return len(torch.nn.modules.module._global_forward_hooks)


def _inputs(rank: int, iteration: int, micro: int, device: torch.device) -> torch.Tensor:
    seed = torch.Generator().manual_seed(1000 * rank + 10 * iteration + micro)
    return torch.randn(4, 8, generator=seed).to(device)


def run(watch: Callable[..., Any] | None, *, scaled: bool, iterations: int, rank: int = 0,
        backward_at: frozenset[int] = frozenset(), forward_at: frozenset[int] = frozenset(), micro: int = 1,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        during: Callable[[int, nn.Module, Any], None] | None = None, device: str = "cpu",
        enabled: bool = True) -> dict:
    """Train a :class:`Tower` for ``iterations`` (``micro`` backwards each) on this rank's inputs.

    ``watch(scaler, opt, model)``: makes the watch (None: the unwatched twin). ``backward_at``/``forward_at``:
    the iterations whose (first) micro-batch makes the gradient inf at ``p3`` / the forward inf at ``spike``.
    ``wrap``: e.g. DDP around the model. ``during(i, model, watch)``: called after each iteration. ``device``:
    where it trains (bf16 autocast and a GradScaler of that device type). ``enabled``: False, the scaler is a
    disabled one (watched as without a scaler). Returns the
    weights' digest after each iteration, each skip or poisoned step's ``[iteration, kind, began]``, the hook
    counts after each iteration, and the agent's error count.
    """
    torch.manual_seed(0)
    where = torch.device(device)
    net = Tower().to(where)
    model = wrap(net) if wrap is not None else net
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(where.type, init_scale=2.0 ** 8, enabled=enabled) if scaled else None
    handle = watch(scaler, opt, model) if watch is not None else None
    digests, hooks = [], []
    events: list[list] = []
    with contextlib.ExitStack() as stack:
        if handle is not None:
            stack.callback(handle.close)
        for i in range(iterations):
            opt.zero_grad(set_to_none=True)
            for m in range(micro):
                x = _inputs(rank, i, m, where)
                first = m == 0
                net.fire_backward = first and i in backward_at
                if first and i in forward_at:
                    x[0] = HUGE
                with torch.autocast(where.type, dtype=torch.bfloat16):
                    loss = model(x).float().pow(2).mean() / micro
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    if handle is not None:
                        handle.loss(loss)
                    loss.backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            net.fire_backward = False
            digests.append(digest(net.parameters()))
            hooks.append([forward_hooks(net), global_forward_hooks()])
            if during is not None:
                during(i, net, handle)
            if handle is not None:
                events += [[e["iteration"], e["kind"], e.get("began")] for e in _drain(handle)
                           if e["kind"] in ("skip", "poisoned_step")]
    errors = handle.snapshot()["state"]["delivery"]["agent_errors"] if handle is not None else 0
    hooks.append([forward_hooks(net), global_forward_hooks()])  # after close()
    return {"digests": digests, "events": events, "hooks": hooks, "errors": errors}


def _drain(handle: Any) -> Iterator[dict]:
    yield from handle._recorder.events.drain()
