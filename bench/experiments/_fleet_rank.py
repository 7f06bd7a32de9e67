"""One simulated rank of ``bench.experiments._fleet_ranks`` at work, and the :class:`Tally` of what all of them saw.

:func:`run_rank` is the agent's sender for one rank: it wakes when the agent's own
:class:`~ampwatch.agent._schedule.PushSchedule` says a batch is due (or news came), builds the
batch from the rank's :class:`~bench.experiments._fleet_plan.Plan` as of now, and hands it to the node's
transport, retrying the very same batch with backoff until it is acknowledged, as the agent does.
"""

from __future__ import annotations

import asyncio
import random
import time

from ampwatch.agent._schedule import PushSchedule
from bench._rank_batch import SCALER, batch_body, open_identity, with_levels
from bench.experiments._fleet_plan import Delivery, LockstepPlan, Plan
from bench.experiments._fleet_transports import Answer, KeptAlive

__all__ = ["AGENT_TIMEOUT_S", "Tally", "run_rank"]

AGENT_TIMEOUT_S = 5.0  # the agent's default AMPWATCH_TIMEOUT: no answer by then is a failed attempt


class Tally:
    """What every rank saw, by phase (``warm``, ``healthy``, ``storm``; a lockstep job also ``recovery`` and
    ``hold``)."""

    def __init__(self, phases: dict[str, tuple[float, float]]) -> None:
        self.phases = phases
        self.latency: dict[str, list[tuple[float, float]]] = {p: [] for p in phases}  # (sent, seconds)
        self.late: dict[str, list[float]] = {p: [] for p in phases}  # send start minus when it was due
        self.requests = {p: 0 for p in phases}
        self.bytes = {p: 0 for p in phases}
        self.levelled = {p: 0 for p in phases}  # requests whose batch carried issue 40's levels (--levels-every)
        self.refused: dict[str, int] = {}  # answers other than 2xx, by status
        self.timeouts = 0
        self.missed = 0  # batches sent a whole heartbeat or more after they were due
        self.storm: dict[int, dict] = {}  # per storm rank: streak starts, rung-16 time, answers
        self.killed_last_ack: float | None = None  # when the killed rank's last batch was answered
        self.collector_of: list[int] = []  # per rank, the index of the collector it reports to (empty: one)
        self.latency_by: list[dict[str, list[float]]] = []  # per collector, by phase: seconds

    def answered(self, rank: int, phase: str, sent: float, seconds: float) -> None:
        """Keep one answered batch's latency, for the job and for the collector that answered it."""
        self.latency[phase].append((round(sent, 4), round(seconds, 5)))
        collector = self.collector_of[rank] if self.collector_of else 0
        while len(self.latency_by) <= collector:
            self.latency_by.append({p: [] for p in self.phases})
        self.latency_by[collector][phase].append(round(seconds, 5))

    def phase(self, t: float) -> str | None:
        for name, (a, b) in self.phases.items():
            if a <= t < b:
                return name
        return None


async def run_rank(rank: int, plan: Plan | LockstepPlan, delivery: Delivery, transport: KeptAlive, run: str, world: int,
                   end: float, kill_at: float | None, tally: Tally, levels_every: int = 0) -> None:
    """Send ``rank``'s batches of ``plan`` through ``transport`` until ``end`` (or ``kill_at``: no close).

    ``levels_every``: one batch in this many carries issue 40's rolling levels (:func:`~bench._rank_batch.with_levels`;
    1: every batch), drawn at random so that any stretch of the run has that share (a rank's own turns would
    depend on how many of its batches a short phase holds); 0: none, today's batches."""
    schedule = PushSchedule(delivery.heartbeat, delivery.news_gap, delivery.news_hold,
                            ranks=world if delivery.spread else 1, news_spread=delivery.news_spread,
                            rng=random.Random(rank))
    seq, sent_it, event_id = 0, 0, 0
    head = open_identity(run, rank, world)
    news_times = [plan.time_of(it) for it, e in plan.events if delivery.news(e)]
    news_iterations = [it for it, e in plan.events if delivery.news(e)]
    storm = tally.storm.get(rank)
    first_contact = True
    levels = random.Random(-1 - rank)
    await asyncio.sleep(max(0.0, plan.start - time.time()))  # the rank calls watch()
    schedule.begin(time.time())
    while True:
        now = time.time()
        if now >= end or (kill_at is not None and now >= kill_at):
            return  # the end of the bench, or SIGKILL: no close
        pending = [t for t, it in zip(news_times, news_iterations, strict=True) if it > sent_it]
        if pending and pending[0] <= now:
            schedule.news(pending[0])  # the agent notes news when the recorder appends it
        due = schedule.due()
        wake = min(due, pending[0]) if pending and pending[0] > now else due
        if wake > now:
            await asyncio.sleep(min(wake, end) - now)
            continue
        iteration = plan.iteration_at(now)
        events = []
        for it, event in plan.events:
            if sent_it < it <= iteration:
                event_id += 1
                events.append(dict(event, id=event_id, time=plan.time_of(it)))
        state = plan.batch_state(iteration)
        seq += 1
        levelled = bool(levels_every) and levels.random() * levels_every < 1.0
        if levelled:
            state = with_levels(state, rank, iteration)
        rest = {"seq": seq, "sent_at": now, "scaler": SCALER, "state": state, "events": events, "closed": False}
        body = batch_body(head, rest)
        schedule.built(now)
        late = now - due
        if late >= delivery.heartbeat:
            tally.missed += 1
        backoff = 1.0
        while True:  # the agent's retry: the very same batch, with backoff, until it is acknowledged
            sent = time.time()
            try:
                answer = await asyncio.wait_for(transport.post(rank, body), AGENT_TIMEOUT_S)
            except asyncio.TimeoutError:
                answer = Answer(None, len(body), 0)
                tally.timeouts += 1
            done = time.time()
            phase = tally.phase(sent)
            if phase is not None:
                tally.requests[phase] += 1
                tally.bytes[phase] += answer.sent_bytes + answer.received_bytes
                tally.levelled[phase] += levelled
                if not first_contact and answer.status is not None:
                    tally.answered(rank, phase, sent, done - sent)
                    tally.late[phase].append(max(0.0, late))
            first_contact = False
            if answer.status is not None and 200 <= answer.status < 300:
                break
            if answer.status is not None:
                tally.refused[str(answer.status)] = tally.refused.get(str(answer.status), 0) + 1
            if done >= end:
                return
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(30.0, backoff * 2)
        sent_it = iteration
        if kill_at is not None:
            tally.killed_last_ack = done
        if storm is not None:
            storm["answers"].append((round(done, 4), state["optimizers"]["gen"]["skipped"]))
