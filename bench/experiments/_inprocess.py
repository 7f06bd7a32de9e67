"""A real collector app driven in this process, without sockets: its ingest handler called as uvicorn would.

For benchmarks that need many simulated pushes quickly (a simulated clock, CPU per update): the
app, its lifespan, store, built-in alerts and retirement loop are the real ones; only HTTP parsing
and the socket are left out.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from bench._rank_batch import CLEAN_DELIVERY, OFFENDING_PARAM, SCALER, identity, optimizer

__all__ = ["SimulatedRank", "post", "collector_app"]


class SimulatedRank:
    """One simulated rank: cumulative counters of two optimizers, 4 iterations a second."""

    def __init__(self, run: str, rank: int, ranks: int) -> None:
        self.head = identity(run, rank, ranks)
        self.seq = self.iteration = self.skipped = self.backoffs = self.streak = self.longest = self.event = 0
        self.streaks = 0
        self.reached: dict[str, int] = {}

    def body(self, now: float, steps: int, storm: bool = False) -> bytes:
        """Return the next protocol v1 batch: ``steps`` more iterations, all skipped in a storm, else a skip
        every 50th batch."""
        self.seq += 1
        self.iteration += steps
        skips = steps if storm else int(self.seq % 50 == 0)
        events = []
        if skips:
            if self.streak == 0:
                self.streaks += 1
            for _ in range(skips):
                self.streak += 1
                length = self.streak
                if length & (length - 1) == 0:  # a power of two: a rung of the streak ladder
                    self.reached[str(length)] = self.reached.get(str(length), 0) + 1
            self.longest = max(self.longest, self.streak)
            self.skipped += skips
            self.backoffs += skips
            self.event += 1
            events.append({"id": self.event, "kind": "skip", "time": now, "iteration": self.iteration,
                           "optimizer": "gen", "streak": self.streak,
                           "params": [OFFENDING_PARAM],
                           "params_total": 1, "inspected": True})
        else:
            self.streak = 0
        gen = optimizer(steps=self.iteration - self.skipped, skipped=self.skipped, consecutive=self.streak,
                        longest=self.longest, streaks=self.streaks, reached=self.reached)
        disc = dict(gen, steps=self.iteration, skipped=0, consecutive_skipped=0, longest_streak=0, streaks=0,
                    streaks_reached={})
        batch = dict(self.head, seq=self.seq, sent_at=now,
                     scaler=SCALER,
                     state={"iteration": self.iteration, "loss_scale": 32768.0, "backoffs": self.backoffs,
                            "growths": 0, "manual_sets": 0, "optimizers": {"gen": gen, "disc": disc},
                            "delivery": CLEAN_DELIVERY},
                     events=events, closed=False)
        return json.dumps(batch).encode()


async def post(ingest: Callable, body: bytes) -> int:
    """Call the collector's ingest handler as uvicorn would for one request; return the status."""
    scope = {"type": "http", "method": "POST", "path": "/v1/ingest", "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    status = [0]

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]

    await ingest(scope, receive, send)
    return status[0]


@contextlib.asynccontextmanager
async def collector_app(db: str, clock: Callable[[], float] | None = None,
                        args: tuple[str, ...] = ()) -> AsyncIterator[Any]:
    """Yield a started collector app on database ``db`` (``clock``: passed to ``create_app`` when given)."""
    from ampwatch.server.__main__ import build_parser
    from ampwatch.server._app import create_app
    from ampwatch.server._config import config_from_args
    from ampwatch.server._gc import tune_gc

    config = config_from_args(build_parser().parse_args(["--db", db, "--log-level", "warning", *args]))
    app = create_app(config) if clock is None else create_app(config, clock=clock)
    tune_gc()  # as the collector's own process does
    async with app.router.lifespan_context(app):
        yield app
