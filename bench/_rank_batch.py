"""What every simulated rank's protocol v1 batch says alike, written once for the benches' generators.

The fleet's ranks (``bench.experiments._fleet_ranks``), the load generator's (``bench._loadgen``), the storm
model (``bench._storm``) and the in-process ones (``bench.experiments._inprocess``) all claim the same agent,
the same GradScaler settings, 8 ranks a node, clean delivery counters and one offending
parameter; a change to any of them is a change to all of them.

A healthy rank of issue 40 (the loss and the gradient norm watched, ``ddp=`` on) also sends the rolling levels of
its loss and of each optimizer's gradient norm, global and local (:func:`with_levels`); the benches measure both
shapes side by side (``bench.healthy``).

The socket generators build thousands of batches a second, so a rank's identity is encoded once
per incarnation and left open (:func:`open_identity`), and each batch appends its own fields
(:func:`batch_body`): the bytes are what ``json.dumps`` of the whole batch would give.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from typing import Any

# The batch builder of tests and benchmarks alike: one copy, from the contract.
from ampwatch_support.batches import CLEAN_DELIVERY, OptimizerRun, optimizer, signal_level

__all__ = ["CLEAN_DELIVERY", "OFFENDING_PARAM", "OptimizerRun", "RANKS_PER_NODE", "SCALER", "batch_body", "identity",
           "open_identity", "optimizer", "with_levels"]

RANKS_PER_NODE = 8
"""Ranks per simulated host: ``local_rank`` and ``host`` follow from the rank."""

SCALER = {"enabled": True, "kind": "GradScaler", "init_scale": 65536.0, "growth_factor": 2.0,
          "backoff_factor": 0.5, "growth_interval": 2000}
"""The batch's ``scaler``: torch's defaults but for ``growth_interval``."""

OFFENDING_PARAM = {"name": "decoder.layers.11.mlp.fc2.weight", "inf": 3, "nan": 0}
"""The parameter a skip event names (where it names one)."""


def identity(run: str, rank: int, world: int) -> dict[str, Any]:
    """Return the identity fields of ``rank``'s batches, with a fresh incarnation (a new process)."""
    return {"protocol": 1, "agent": {"version": "0.1.0", "torch": "2.13.0"}, "run": run, "rank": rank,
            "world_size": world, "local_rank": rank % RANKS_PER_NODE, "host": f"node-{rank // RANKS_PER_NODE}",
            "pid": 1000 + rank, "incarnation": uuid.uuid4().hex}


def open_identity(run: str, rank: int, world: int) -> str:
    """Return :func:`identity` as JSON without its closing brace, for :func:`batch_body`."""
    return json.dumps(identity(run, rank, world))[:-1]


def batch_body(prefix: str, rest: dict[str, Any]) -> bytes:
    """Return the batch of identity ``prefix`` (from :func:`open_identity`) and the fields ``rest``, encoded."""
    return (prefix + ", " + json.dumps(rest)[1:]).encode()


def with_levels(state: dict[str, Any], rank: int, iteration: int) -> dict[str, Any]:
    """Return a copy of a healthy batch's ``state`` with what issue 40 adds to it: the loss's rolling level and, per
    optimizer, the gradient norm's and (``ddp=``) the rank's own norm's, each rounded as the agent sends them (4
    significant digits; ``ampwatch_support.batches.signal_level``). No spike counter: the agent leaves them out
    while 0.

    The values are what an LLM run shows some way into training (a loss near 2-3.5 falling slowly, gradient norms
    of a few tenths, a rank's own norm above the all-reduced one), different per rank and iteration, so each takes
    the digits a real one does.
    """
    rng = random.Random(rank * 1_000_003 + iteration)
    loss = 2.1 + 1.4 * math.exp(-iteration / 20_000)
    optimizers = {}
    for name, counters in state["optimizers"].items():
        norm = rng.uniform(0.2, 0.5)
        own = norm * rng.uniform(1.2, 1.6)
        optimizers[name] = dict(counters, grad_norm=signal_level(norm, norm * rng.uniform(0.05, 0.15)),
                                local_grad_norm=signal_level(own, own * rng.uniform(0.08, 0.2)))
    return dict(state, loss=signal_level(loss * rng.uniform(0.99, 1.01), loss * rng.uniform(0.01, 0.03)),
                optimizers=optimizers)
