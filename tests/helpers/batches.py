"""Protocol v1 batches built by hand, as JSON-ready dicts (the real agent is tested against the same schema).

``post_batch`` sends one to a real collector, as an agent would.

>>> batch = make_batch(run="exp-1", optimizers={"gen": optimizer(steps=10, skipped=1)}, events=[skip_event(1)])
>>> batch["state"]["optimizers"]["gen"]["skipped"], batch["events"][0]["kind"]
(1, 'skip')
"""

from __future__ import annotations

import copy
import json
import time
import urllib.request
from typing import Any

from ampwatch.contract.protocol import PROTOCOL_VERSION

__all__ = ["BASE", "make_batch", "optimizer", "post_batch", "skip_event"]

BASE: dict[str, Any] = {
    "protocol": PROTOCOL_VERSION, "agent": {"version": "0.1.0", "torch": "2.13.0"}, "run": "exp-42", "rank": 0,
    "world_size": 2, "local_rank": 0, "host": "node-a", "pid": 4242,
    "incarnation": "6f1c0e0c3a5b4f6e9d2a7b8c9d0e1f2a", "seq": 1, "sent_at": 1764400000.25,
    "scaler": {"enabled": True, "kind": "GradScaler", "init_scale": 65536.0, "growth_factor": 2.0,
               "backoff_factor": 0.5, "growth_interval": 2000},
    "state": {"iteration": 0, "loss_scale": 65536.0, "backoffs": 0, "growths": 0, "manual_sets": 0,
              "optimizers": {}, "delivery": {"dropped_events": 0, "send_failures": 0, "rejected_batches": 0,
                                             "agent_errors": 0}},
    "events": [], "closed": False,
}


def optimizer(steps: int = 0, skipped: int = 0, consecutive: int = 0, longest: int = 0, streaks: int = 0,
              reached: dict[str, int] | None = None, **extra: int) -> dict[str, Any]:
    """Counters of one optimizer as the agent sends them."""
    return {"steps": steps, "skipped": skipped, "consecutive_skipped": consecutive, "longest_streak": longest,
            "streaks": streaks, "streaks_reached": reached or {}, "scheduler_steps_after_skip": 0,
            "poisoned_steps": 0, **extra}


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
               params: tuple[str, ...] = ("fc.weight",)) -> dict[str, Any]:
    """A skip event naming ``params`` as holding an inf each."""
    return {"id": id, "kind": "skip", "time": time.time(), "iteration": iteration, "optimizer": optimizer,
            "streak": streak, "params": [{"name": p, "inf": 1, "nan": 0} for p in params],
            "params_total": len(params), "inspected": True}


def post_batch(url: str, batch: dict[str, Any], timeout: float = 10.0) -> None:
    """POST ``batch`` to the collector at ``url``; fail unless it answers 200."""
    request = urllib.request.Request(url + "/v1/ingest", data=json.dumps(batch).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        assert answer.status == 200
