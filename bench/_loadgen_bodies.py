"""What each sender of ``bench._loadgen`` posts: a template per rank (or node) that gives the body at ``seq``.

Healthy ranks report two optimizers' cumulative counters with a skip and a backoff every
``every`` updates: as a protocol v1 batch (``ampwatch``), as a protocol v2 batch of a node's
ranks (``ampwatch-node``, what a node relay posts), or as the same counters in a Pushgateway
group (``pushgateway``). Storm ranks (``--storm``) follow ``bench._storm.StormRank``. A template
encodes what does not change once, so the generator stays cheap.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ampwatch.contract.node_batch import encode_node_batch
from bench._rank_batch import CLEAN_DELIVERY, OFFENDING_PARAM, SCALER, batch_body, open_identity, optimizer
from bench._storm import StormRank

__all__ = ["PER_NODE", "SKIP_EVERY", "ampwatch_body", "ampwatch_node_template", "ampwatch_template",
           "pushgateway_body", "pushgateway_template", "storm_template"]

SKIP_EVERY = 50  # default: one skip and one backoff every 50th update: realistic, and it exercises the event path
PER_NODE = 8  # default: ranks per simulated node (target ampwatch-node)
_OPT = ("gen", "disc")


def _counters(seq: int, every: int) -> dict:
    skips = seq // every
    return {"seq": seq, "iteration": seq * 10, "steps": seq - skips, "skips": skips, "backoffs": skips}


def ampwatch_template(run: str, rank: int, ranks: int, every: int = SKIP_EVERY) -> Callable[[int], bytes]:
    """Return ``seq -> body`` of a protocol v1 batch for one rank (two optimizers)."""
    prefix = open_identity(run, rank, ranks)

    def body(seq: int) -> bytes:
        c = _counters(seq, every)
        skips, now = c["skips"], time.time()
        gen = optimizer(steps=c["steps"], skipped=skips, longest=min(skips, 1), streaks=skips,
                        reached={"1": skips} if skips else {})
        events = []
        if seq % every == 0:
            events = [{"id": 2 * skips - 1, "kind": "skip", "time": now, "iteration": seq, "optimizer": "gen",
                       "streak": 1, "params": [OFFENDING_PARAM], "params_total": 1, "inspected": True},
                      {"id": 2 * skips, "kind": "scale_change", "time": now, "iteration": seq, "cause": "backoff",
                       "before": 65536.0, "after": 32768.0}]
        rest = {"seq": seq, "sent_at": now, "scaler": SCALER,
                "state": {"iteration": c["iteration"], "loss_scale": 32768.0, "backoffs": skips, "growths": 0,
                          "manual_sets": 0,
                          "optimizers": {"gen": gen, "disc": dict(gen, skipped=0, streaks=0, streaks_reached={})},
                          "delivery": CLEAN_DELIVERY},
                "events": events, "closed": False}
        return batch_body(prefix, rest)
    return body


def ampwatch_node_template(run: str, node: int, ranks: int, per_node: int = PER_NODE,
                           every: int = SKIP_EVERY) -> Callable[[int], bytes]:
    """Return ``seq -> body`` of a protocol v2 batch: ranks ``node * per_node ...`` of a ``ranks``-rank job at ``seq``.

    What a node relay posts when every rank of the node has a batch waiting (docs/protocol.md, v2).
    """
    members = [ampwatch_template(run, rank, ranks, every)
               for rank in range(node * per_node, min(ranks, (node + 1) * per_node))]
    return lambda seq: encode_node_batch([build(seq) for build in members])


def storm_template(run: str, rank: int, ranks: int, pattern: str) -> Callable[[int, bool, int], bytes]:
    """Return ``(seq, storm, intervals) -> body``: a batch of a rank with two optimizers covering ``intervals``
    push intervals of training (more than 1 after missed slots), skipping on all of them in a storm."""
    prefix = open_identity(run, rank, ranks)
    model = StormRank(pattern)

    def body(seq: int, storm: bool, intervals: int = 1) -> bytes:
        events = model.push(storm, intervals)
        rest = {"seq": seq, "sent_at": time.time(), "scaler": SCALER, "state": model.state(), "events": events,
                "closed": False}
        return batch_body(prefix, rest)
    return body


def pushgateway_template(run: str, rank: int, ranks: int, every: int = SKIP_EVERY) -> Callable[[int], bytes]:
    """Return ``seq -> body``: the same counters as the batch, as a Pushgateway group in the text format."""
    def body(seq: int) -> bytes:
        c = _counters(seq, every)
        skips = c["skips"]
        per_opt = {"gen": (c["steps"], skips, skips), "disc": (c["steps"], 0, 0)}
        lines = []
        for name, kind, index in (("ampwatch_optimizer_steps_total", "counter", 0),
                                  ("ampwatch_optimizer_skipped_steps_total", "counter", 1),
                                  ("ampwatch_optimizer_skip_streaks_total", "counter", 2)):
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f'{name}{{optimizer="{o}"}} {v[index]}' for o, v in per_opt.items())
        lines.append("# TYPE ampwatch_optimizer_consecutive_skipped_steps gauge")
        lines.extend(f'ampwatch_optimizer_consecutive_skipped_steps{{optimizer="{o}"}} 0' for o in _OPT)
        lines.append("# TYPE ampwatch_optimizer_longest_skip_streak gauge")
        lines.extend(f'ampwatch_optimizer_longest_skip_streak{{optimizer="{o}"}} {min(skips, 1) if o == "gen" else 0}'
                     for o in _OPT)
        for name, kind, value in (("ampwatch_loss_scale", "gauge", 32768.0),
                                  ("ampwatch_loss_scale_backoffs_total", "counter", skips),
                                  ("ampwatch_loss_scale_growths_total", "counter", 0),
                                  ("ampwatch_iteration", "gauge", c["iteration"])):
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name} {value}")
        return ("\n".join(lines) + "\n").encode()
    return body


def ampwatch_body(run: str, rank: int, ranks: int, seq: int) -> bytes:
    """One protocol v1 batch (for tests and one-off use)."""
    return ampwatch_template(run, rank, ranks)(seq)


def pushgateway_body(run: str, rank: int, ranks: int, seq: int) -> bytes:
    """One Pushgateway group body (for tests and one-off use)."""
    return pushgateway_template(run, rank, ranks)(seq)
