"""Protocol v1 batches built by hand from ``ampwatch.contract.batch``, as JSON-ready dicts, for tests, benchmarks and
simulated ranks (the real agent is tested against the same contract).

``optimizer`` gives an optimizer's counters, every one the contract declares; :class:`OptimizerRun` advances them a
step or a skip at a time, as the agent counts them, and :class:`SimulatedRank` a rank's batches from them;
``post_batch`` sends a batch to a real collector.

>>> batch = make_batch(run="exp-1", optimizers={"gen": optimizer(steps=10, skipped=1)}, events=[skip_event(1)])
>>> batch["state"]["optimizers"]["gen"]["skipped"], batch["events"][0]["kind"]
(1, 'skip')
"""

from __future__ import annotations

import copy
import json
import time
import urllib.error
import urllib.request
from typing import Any

from ampwatch.contract.batch import (
    OPTIMIZER_LEVELS,
    RANK_LEVELS,
    DeliveryCounters,
    OptimizerCounters,
    fields,
    samples_digest,
)
from ampwatch.contract.protocol import LISTED_EVENT_KINDS, MAX_SAMPLE_IDS, PROTOCOL_VERSION, STREAK_LADDER, is_rung

__all__ = ["APPLIED", "DUPLICATE", "BASE", "CLEAN_DELIVERY", "OPTIMIZER_LEVELS", "RANK_LEVELS", "SENT_WHEN_SET",
           "OptimizerRun", "SimulatedRank", "ingest_status", "make_batch", "optimizer", "post_batch", "samples",
           "signal_level", "skip_event", "spike_event"]

APPLIED: dict[str, Any] = {"applied": True, "kinds": list(LISTED_EVENT_KINDS)}
"""A collector's answer to a batch it applied: it lists the event kinds it takes that protocol 1 added later
(docs/protocol.md#kinds-a-collector-lists)."""
DUPLICATE: dict[str, Any] = {"applied": False, "duplicate": True, "kinds": list(LISTED_EVENT_KINDS)}
"""A collector's answer to a batch it had applied already."""

CLEAN_DELIVERY: dict[str, int] = dict.fromkeys(fields(DeliveryCounters), 0)
"""The state's ``delivery`` counters of an agent that lost and was refused nothing."""

BASE: dict[str, Any] = {
    "protocol": PROTOCOL_VERSION, "agent": {"version": "0.1.0", "torch": "2.13.0"}, "run": "exp-42", "rank": 0,
    "world_size": 2, "local_rank": 0, "host": "node-a", "pid": 4242,
    "incarnation": "6f1c0e0c3a5b4f6e9d2a7b8c9d0e1f2a", "seq": 1, "sent_at": 1764400000.25,
    "scaler": {"enabled": True, "kind": "GradScaler", "init_scale": 65536.0, "growth_factor": 2.0,
               "backoff_factor": 0.5, "growth_interval": 2000},
    "state": {"iteration": 0, "loss_scale": 65536.0, "backoffs": 0, "growths": 0, "manual_sets": 0,
              "optimizers": {}, "delivery": CLEAN_DELIVERY},
    "events": [], "closed": False,
}


SENT_WHEN_SET: frozenset[str] = frozenset(OPTIMIZER_LEVELS) | {"grad_norm_spikes"}
"""What :func:`optimizer` leaves out unless given: the agent sends a level once its window holds two values, and a
spike counter once it is not 0 (issue 40), so a healthy batch of today's shape holds none of them."""

_ZEROS = {name: 0 for name in fields(OptimizerCounters) if name not in SENT_WHEN_SET}
_DECLARED = frozenset(fields(OptimizerCounters))
_SHORT = {"consecutive": "consecutive_skipped", "longest": "longest_streak", "reached": "streaks_reached"}


def optimizer(**counters: Any) -> dict[str, Any]:
    """Counters of one optimizer as the agent sends them: each counter the contract declares, 0 unless given, but for
    :data:`SENT_WHEN_SET`, present only when given (``consecutive``, ``longest`` and ``reached`` short for
    ``consecutive_skipped``, ``longest_streak`` and ``streaks_reached``); a name the contract does not declare raises
    ``TypeError``."""
    values = dict(_ZEROS, streaks_reached={})
    for key, value in counters.items():
        name = _SHORT.get(key, key)
        if name not in _DECLARED:
            raise TypeError(f"optimizer(): {key!r} is not a counter ampwatch.contract.batch.OptimizerCounters "
                            f"declares ({', '.join(_DECLARED)})")
        values[name] = value
    return values


class OptimizerRun:
    """One optimizer's counters advanced a step or a skip at a time, as the agent counts them."""

    __slots__ = ("steps", "skipped", "consecutive", "longest", "streaks", "start", "reached",
                 "scheduler_steps_after_skip", "poisoned_steps")

    def __init__(self) -> None:
        self.steps = self.skipped = self.consecutive = self.longest = self.streaks = self.start = 0
        self.scheduler_steps_after_skip = self.poisoned_steps = 0
        self.reached = [0] * len(STREAK_LADDER)

    def step(self) -> int:
        """Count an update; return the length of the streak it ended (0: none)."""
        self.steps += 1
        ended, self.consecutive = self.consecutive, 0
        return ended

    def skip(self, iteration: int = 0) -> int:
        """Count a skip at ``iteration``; return its position in its streak (1: it starts one)."""
        self.skipped += 1
        self.consecutive += 1
        position = self.consecutive
        if position == 1:
            self.streaks += 1
            self.start = iteration
        if position > self.longest:
            self.longest = position
        if is_rung(position) and position <= STREAK_LADDER[-1]:
            self.reached[position.bit_length() - 1] += 1
        return position

    def counters(self) -> dict[str, Any]:
        """Return the counters as a batch's ``state.optimizers[name]`` holds them."""
        return {"steps": self.steps, "skipped": self.skipped, "consecutive_skipped": self.consecutive,
                "longest_streak": self.longest, "streaks": self.streaks,
                "streaks_reached": {str(n): c for n, c in zip(STREAK_LADDER, self.reached, strict=True) if c},
                "scheduler_steps_after_skip": self.scheduler_steps_after_skip, "poisoned_steps": self.poisoned_steps}


class SimulatedRank:
    """One rank of a simulated run as its agent reports it: each batch ``iterations_per_batch`` iterations of one
    optimizer, ``gen``, each a step or a skip (which backs the scale off, as GradScaler does)."""

    def __init__(self, run: str, rank: int, world_size: int, iterations_per_batch: int,
                 scale: float = 2.0 ** 16) -> None:
        self.run, self.rank, self.world_size, self.iterations_per_batch = run, rank, world_size, iterations_per_batch
        self.gen, self.scale = OptimizerRun(), scale
        self.seq = self.iteration = self.backoffs = self.spikes = 0

    def batch(self, skipping: bool, spike: bool, closed: bool) -> dict[str, Any]:
        """Advance a batch's iterations (each a skip while ``skipping``) and return the batch; ``spike``: a loss and
        a gradient-norm spike among them."""
        for _ in range(self.iterations_per_batch):
            self.iteration += 1
            if skipping:
                self.gen.skip(self.iteration)
                self.backoffs += 1
                self.scale /= 2
            else:
                self.gen.step()
        self.spikes += spike
        self.seq += 1
        counters = self.gen.counters() | ({"grad_norm_spikes": self.spikes} if self.spikes else {})
        batch = make_batch(run=self.run, rank=self.rank, world_size=self.world_size, local_rank=self.rank,
                           seq=self.seq, incarnation=f"simulated-{self.run}-{self.rank}", sent_at=time.time(),
                           iteration=self.iteration, backoffs=self.backoffs, loss_scale=self.scale,
                           optimizers={"gen": counters}, closed=closed)
        if self.spikes:  # the agent sends it once it moved
            batch["state"]["loss_spikes"] = self.spikes
        return batch


def signal_level(mean: float, std: float) -> dict[str, float]:
    """A rolling level (``ampwatch.contract.batch.SignalLevel``) as the agent sends it: each value rounded to 4
    significant digits.

    >>> signal_level(2.84712, 0.0412345)
    {'mean': 2.847, 'std': 0.04123}
    """
    return {"mean": float(f"{mean:.4g}"), "std": float(f"{std:.4g}")}


def make_batch(*, optimizers: dict[str, dict] | None = None, events: list[dict] | None = None,
               **fields: Any) -> dict[str, Any]:
    """A valid protocol v1 batch; keyword arguments replace top-level fields or ``state`` fields."""
    batch = copy.deepcopy(BASE)
    for key, value in fields.items():
        if key in batch["state"]:
            batch["state"][key] = value
        else:
            batch[key] = value
    batch["state"]["optimizers"] = optimizers if optimizers is not None else {"gen": optimizer()}
    batch["events"] = events or []
    return batch


def skip_event(id: int, optimizer: str = "gen", iteration: int = 0, streak: int = 1,
               params: tuple[str, ...] = ("fc.weight",), **more: Any) -> dict[str, Any]:
    """A skip event naming ``params`` as holding an inf each; ``more`` sets other fields of
    ``ampwatch.contract.batch.SkipEvent`` (``origin``, ``began``, ``samples``, ``calibration``, ...)."""
    return {"id": id, "kind": "skip", "time": time.time(), "iteration": iteration, "optimizer": optimizer,
            "streak": streak, "params": [{"name": p, "inf": 1, "nan": 0} for p in params],
            "params_total": len(params), "inspected": True, **more}


def spike_event(id: int, kind: str = "loss_spike", iteration: int = 0, value: float | str = 10.0,
                mean: float | None = 1.0, std: float | None = 0.5, **more: Any) -> dict[str, Any]:
    """A ``loss_spike`` (or, ``kind="grad_norm_spike"``, a spike of optimizer ``more["optimizer"]``, default "gen")
    of ``value`` against a window of ``mean`` and ``std`` (``z`` worked out from them, null for a non-finite value:
    "NaN", "Infinity"); ``more`` sets other fields of ``ampwatch.contract.batch.LossSpikeEvent`` or
    ``GradNormSpikeEvent`` (``streak``, ``local``, ``samples``)."""
    finite = not isinstance(value, str)
    z = (value - mean) / std if finite and mean is not None and std else None  # type: ignore[operator]
    event = {"id": id, "kind": kind, "time": time.time(), "iteration": iteration, "value": value, "mean": mean,
             "std": std, "z": z, "streak": 1}
    if kind == "grad_norm_spike":
        event["optimizer"] = "gen"
    return {**event, **more}


def samples(ids: list[int | str]) -> dict[str, Any]:
    """An event's ``samples`` (``ampwatch.contract.batch.Samples``) for an iteration that trained on ``ids``.

    >>> samples([3, 1])["count"], samples([3, 1])["digest"] == samples([1, 3])["digest"]
    (2, True)
    """
    return {"ids": list(ids[:MAX_SAMPLE_IDS]), "count": len(ids), "digest": samples_digest(ids)}


def ingest_status(url: str, body: dict[str, Any] | bytes, timeout: float = 10.0) -> int:
    """POST a batch (or raw ``body`` bytes) to the collector at ``url``; return its status, 0 without an answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + "/v1/ingest", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0  # no answer: the collector is down


def post_batch(url: str, batch: dict[str, Any], timeout: float = 10.0) -> None:
    """POST ``batch`` to the collector at ``url``; fail unless it answers 200."""
    request = urllib.request.Request(url + "/v1/ingest", data=json.dumps(batch).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        assert answer.status == 200
