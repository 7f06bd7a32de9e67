"""POST /v1/ingest: authenticate, bound, validate, apply idempotently, answer after COMMIT.

A protocol v1 body is one rank's batch; a v2 body (a node relay's) is several, each applied and answered
on its own by the same per-rank path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from ampwatch.contract.node_batch import NODE_PROTOCOL_VERSION, is_node_batch, split_node_batch
from ampwatch.contract.protocol import LISTED_EVENT_KINDS

from . import _trace
from ._access import bearer_matches
from ._batch_parse import LARGE_BODY_BYTES, BatchError, parse_batch, parse_large_batch
from ._client_budget import ClientBudget
from ._config import ServerConfig
from ._evidence import evidence_rows
from ._incarnation import Incarnation, next_incarnation
from ._metrics import SelfMetrics
from ._outliers import Outlier, OutlierJudge, local_spikes
from ._ownership import beside, claimants
from ._plausibility import implausible_rise
from ._recovery import load_ranks
from ._refusals import Refused, failure_answer, refuse_browsers
from ._schema import Batch
from ._state import CollectorState, LimitExceeded, RankState
from ._store import Store, Writes
from ._stored_form import stored_event

__all__ = ["IngestService"]

log = logging.getLogger("ampwatch.server")

# The two answers of nearly every request, encoded once; each lists the kinds it takes of those added to protocol 1
# (docs/protocol.md#kinds-a-collector-lists).
_APPLIED = json.dumps({"applied": True, "kinds": list(LISTED_EVENT_KINDS)}).encode()
_DUPLICATE = json.dumps({"applied": False, "duplicate": True, "kinds": list(LISTED_EVENT_KINDS)}).encode()
_MAX_STORED_RAW = 16_384  # bytes; a batch of 16 optimizers without events is ~6 KiB


class IngestService:
    """Applies batches to the in-memory state and the store; one per app."""

    def __init__(self, config: ServerConfig, state: CollectorState, store: Store, own: SelfMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self.config, self.state, self.store, self.own, self.clock = config, state, store, own, clock
        self.budget = ClientBudget(config.client_new_runs, config.client_event_rate)
        self._busy: dict[tuple[str, int], asyncio.Future] = {}  # ranks with a batch being applied
        self.on_applied: Callable[[RankState], None] | None = None  # built-in alerts; must not raise or block
        self._requests_by_status: dict[int, Any] = {}  # counter children, looked up once per status
        self.in_flight = 0
        """Ingest requests begun and not yet answered (the event loop has work: ``/metrics`` pauses for it)."""
        self.outliers = OutlierJudge(config.alert_thresholds)
        """Local gradient-norm spikes waiting to be judged across their run's ranks (:mod:`._outliers`)."""

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Answer one ``POST /v1/ingest`` as a bare ASGI app (the hot path skips the framework's routing)."""
        started = time.perf_counter()
        trace, status = _trace.active, 500
        traced = trace.begin() if trace is not None else None
        self.in_flight += 1
        try:
            status = await self._answer(scope, receive, send)
        finally:
            self.in_flight -= 1
            if traced is not None and trace is not None:
                trace.end(traced, status)
        self.own.latency.observe(time.perf_counter() - started)

    async def _answer(self, scope: dict, receive: Callable, send: Callable) -> int:
        retry_after = None
        body: bytes | dict  # bytes ready to send, or an error to write as JSON
        # Every refusal says "retry": true (the very same batch may pass later: send it again) or false (it
        # never will: drop it); agents act on that rather than on the status alone (docs/protocol.md).
        try:
            client = (scope.get("client") or ("unknown", 0))[0]
            status, body = await self._ingest(dict(scope["headers"]), receive, client)
        except Exception as exc:
            status, body, retry_after = failure_answer(exc, self.own)
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        counter = self._requests_by_status.get(status)
        if counter is None:
            counter = self._requests_by_status[status] = self.own.requests.labels(str(status))
        counter.inc()
        return status

    async def _ingest(self, headers: dict[bytes, bytes], receive: Callable, client: str) -> tuple[int, bytes]:
        self._authenticate(headers.get(b"authorization"))
        refuse_browsers(headers)
        body = await self._read_body(headers.get(b"content-length"), receive)
        _trace.mark("read")
        if is_node_batch(body):
            return 200, await self._ingest_node(body, client)
        parsed = await self._prepare(body)
        _trace.mark("parse", rank=parsed[0].rank, events=len(parsed[1]))
        return await self._apply_rank(parsed, body, client)

    async def _ingest_node(self, body: bytes, client: str) -> bytes:
        """Apply a protocol v2 node batch: each rank's batch on its own, answered per rank, committed together."""
        pieces = split_node_batch(body)
        if pieces is None:
            raise Refused(400, "json", "the protocol v2 body is not laid out as docs/protocol.md says "
                                       '({"protocol":2,"lengths":[...],"batches":[...]}, no spaces, lengths in '
                                       "bytes); send each rank's batch as protocol v1 instead")
        # Concurrently, so the ranks' writes share one group commit; each rank still waits for its own turn.
        results = await asyncio.gather(*(self._apply_piece(piece, client) for piece in pieces))
        return json.dumps({"protocol": NODE_PROTOCOL_VERSION, "results": results}).encode()

    async def _apply_piece(self, piece: bytes, client: str) -> dict:
        """Return one rank's result in a v2 answer: its status and the body a v1 request would have got."""
        rank = None
        try:
            parsed = await self._prepare(piece)
            rank = parsed[0].rank
            status, answer = await self._apply_rank(parsed, piece, client)
            result = {"status": status, **json.loads(answer)}
        except Exception as exc:
            status, error, retry_after = failure_answer(exc, self.own)
            result = {"status": status, **error}
            if retry_after is not None:
                result["retry_after"] = retry_after
        if rank is not None:
            result["rank"] = rank
        return result

    async def _apply_rank(self, parsed: tuple[Batch, list[str]], body: bytes, client: str) -> tuple[int, bytes]:
        """Apply one rank's batch (``parsed`` by :meth:`_prepare` from ``body``, its bytes as the agent encoded
        them), one batch per rank at a time."""
        batch = parsed[0]
        # One batch per rank at a time: the duplicate check and the install must see each other.
        key = (batch.run, batch.rank)
        done = await self._take(key)
        _trace.mark("turn")
        try:
            answer = await self._apply(*parsed, body, client)
        finally:
            self._give_back(key, done)
        if batch.run in self.outliers.waiting:  # a healthy run: never
            await self.judge_outliers(batch.run, (batch.rank, batch.state.iteration))
        return answer

    async def _take(self, key: tuple[str, int]) -> asyncio.Future:
        """Hold the rank ``key`` (run, rank): what is read of it and written for it is not interleaved with another
        batch of it (or a judgment that counts on it) until :meth:`_give_back`."""
        while (busy := self._busy.get(key)) is not None:
            await asyncio.wait([busy])
        done = asyncio.get_running_loop().create_future()
        self._busy[key] = done
        return done

    def _give_back(self, key: tuple[str, int], done: asyncio.Future) -> None:
        del self._busy[key]  # the next batch of the rank (or judgment) goes on
        done.set_result(None)

    async def judge_outliers(self, run: str, reported: tuple[int, int] | None = None) -> None:
        """Judge the local gradient-norm spikes of ``run`` that are due (``reported``: rank and iteration of the batch
        just applied) and record each outlier; a failure to record one is logged, the batch is answered as applied."""
        now = self.clock()
        for outlier in self.outliers.due(run, self.state.runs.get(run, {}), now, reported):
            try:
                await self._record_outlier(outlier, now)
            except Exception:
                log.exception("recording a gradient outlier of rank %d of run %r failed; it is not counted",
                              outlier.spike.rank, run)

    async def judge_waiting(self) -> None:
        """Judge every run's spikes that waited long enough (a run whose ranks stopped sending); called periodically."""
        for run in self.outliers.runs_waiting():
            await self.judge_outliers(run)
        self.outliers.forget(self.clock())

    async def _record_outlier(self, outlier: Outlier, now: float) -> None:
        """Record a ``gradient_outlier``: its event and evidence row, and the rank's count, stored with the process
        that sent the spike (event id: minus the spike's, so that it is stored once and never meets an agent's)."""
        spike = outlier.spike
        rank = self.state.get(spike.run, spike.rank)
        if rank is None:
            return  # the rank left memory meanwhile: its history is the database's
        key = (spike.run, spike.rank)
        done = await self._take(key)
        try:
            process = rank.view.incarnations.get(spike.incarnation)
            if process is None:
                return
            counted = dataclasses.replace(process, gradient_outliers=process.gradient_outliers + 1)
            event, evidence = outlier.rows(process.batch, process.device, now)
            await self._stored(self.store.write_incarnation(spike.run, spike.rank, counted.to_row(), [event],
                                                            [evidence]))
            rank.recount(counted)
        finally:
            self._give_back(key, done)
        log.info("rank %d of run %r: its own gradient norm of %s stood out at iteration %d (gradient_outlier)",
                 spike.rank, spike.run, spike.optimizer, spike.iteration)
        if self.on_applied is not None:
            self.on_applied(rank)

    def _authenticate(self, given: bytes | None) -> None:
        if self.config.token is None:
            return
        if not given:
            raise Refused(401, "auth", "this collector requires a token: set AMPWATCH_TOKEN on the agent "
                                       "(sent as 'Authorization: Bearer <token>')")
        if not bearer_matches(given, self.config.token):
            raise Refused(403, "auth", "the token is wrong: AMPWATCH_TOKEN on the agent must equal the "
                                       "collector's --token / AMPWATCH_SERVER_TOKEN")

    async def _read_body(self, declared: bytes | None, receive: Callable) -> bytes:
        limit = self.config.max_body_bytes
        too_large = Refused(413, "too_large", f"the batch is larger than this collector's limit of {limit} "
                                              f"bytes: send fewer events per batch or raise --max-body-bytes")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refused(400, "json", "the client disconnected before sending the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def _prepare(self, body: bytes) -> tuple[Batch, list[str]]:
        """Parse and validate ``body``, and encode what its events' rows keep (:func:`stored_event`).

        A batch of the usual size (at most ``LARGE_BODY_BYTES``) on the event loop; a larger one in a worker
        thread, bounded before it is built into objects (``parse_large_batch``), so that one large or hostile
        body never holds up every other agent's answer (a thread switch comes between its parts).
        """
        if len(body) <= LARGE_BODY_BYTES:
            return self._parsed(parse_batch, body)
        return await asyncio.to_thread(self._parsed, self._parse_large, body)

    def _parse_large(self, body: bytes) -> Batch:
        return parse_large_batch(body, self.config.max_optimizers_per_rank)

    @staticmethod
    def _parsed(parse: Callable[[bytes], Batch], body: bytes) -> tuple[Batch, list[str]]:
        try:
            batch = parse(body)
        except BatchError as exc:
            if exc.malformed:
                raise Refused(400, "json", "the body is not valid JSON: " + exc.lines[0]) from None
            raise Refused(422, "schema", "the batch does not follow protocol v1 (docs/protocol.md)",
                          exc.lines) from None
        return batch, [stored_event(e) for e in batch.events]

    async def _apply(self, batch: Batch, bodies: list[str], body: bytes, client: str) -> tuple[int, bytes]:
        if batch.process_key is None and self.config.require_process_key:
            raise Refused(422, "process_key", f"rank {batch.rank} of run {batch.run!r}: the batch has no "
                                              "process_key, which this collector requires "
                                              "(--require-process-key): upgrade the agent")
        rank = self.state.get(batch.run, batch.rank)
        if rank is None and (batch.run, batch.rank) in self.state.stored:  # back after it left memory
            found = await asyncio.to_thread(load_ranks, self.store, run=batch.run, rank=batch.rank)
            rank = found[0] if found else None
        try:
            self.state.check_limits(batch, rank)
        except LimitExceeded as exc:
            raise Refused(exc.status, "cardinality", exc.message, retry=exc.retry,
                          retry_after=exc.retry_after) from None
        over = self.budget.refusal(client, batch.run not in self.state.runs, len(batch.events))
        if over is not None:
            reason, message, wait = over
            raise Refused(429, reason, message, retry=True, retry_after=wait)
        events = [(batch.run, batch.rank, batch.incarnation, e.id, e.kind, e.time, e.iteration,
                   getattr(e, "optimizer", None), stored) for e, stored in zip(batch.events, bodies, strict=True)]
        old = rank.view.incarnations.get(batch.incarnation) if rank else None
        if old is not None and batch.process_key != old.batch.process_key:
            # The incarnation id is shown by the read API; the process key is not: a stranger's batch (counted,
            # not logged: a forger would fill the log).
            raise Refused(409, "conflict", f"rank {batch.rank} of run {batch.run!r}: incarnation "
                                           f"{batch.incarnation} belongs to another process. Each process sends its "
                                           "own; if two jobs share this run id, relaunch this one with its own "
                                           "(AMPWATCH_RUN)")
        if old is not None and old.conflict_with is not None:
            raise Refused(409, "conflict", f"rank {batch.rank} of run {batch.run!r} belongs to another process "
                                           f"(incarnation {old.conflict_with}), which kept sending after this one "
                                           "claimed it: two jobs share this run id. Relaunch this job with its own "
                                           "run id (AMPWATCH_RUN)")
        if old is not None and batch.seq <= old.last_seq:
            # Already applied, or older than what was: counters stay; unseen events (a reordered batch) are kept.
            self.own.duplicates.inc()
            if events:
                evidence = evidence_rows(batch, old.device, self.clock())
                await self._stored(self.store.insert_events(events, evidence))
            return 200, _DUPLICATE
        now = self.clock()
        displaced: tuple[str, ...] = ()
        if old is None and rank is not None and not batch.replayed:
            displaced = beside(rank.view.incarnations.values(), batch.process_key, now, self.config.silent_after)
        new = next_incarnation(old, batch, now, self.config.max_label_length, displaced)
        # Judged on new's counters, and on the rank's totals over all its processes.
        implausible = implausible_rise(old, new, now, self.config.max_counter_rate, rank.view if rank else None)
        if implausible is not None:
            raise Refused(422, "implausible", implausible)
        # What the run view showed of it (a conflict changes it too).
        shown = rank.view.shown() if rank is not None else ()
        if rank is not None and old is not None and not batch.replayed:
            await self._record_conflicts(rank, old, now)
        evidence = evidence_rows(batch, new.device, now) if events else []
        await self._stored(self.store.write_incarnation(
            batch.run, batch.rank, new.to_row(_as_stored(body, events)), events, evidence))
        if rank is None:
            rank = RankState(batch.run, batch.rank)
        rank.install(new)
        self.state.adopt(rank)
        if events and (spikes := local_spikes(batch, old.max_event_id if old else 0, now)):
            self.outliers.note(spikes)
        if rank.view.shown() != shown:
            self.state.moved(batch.run)
        if self.on_applied is not None:
            self.on_applied(rank)
        self.own.batches.inc()
        _trace.mark("after")
        return 200, _APPLIED

    async def _stored(self, job: Writes) -> None:
        """Submit ``job`` and wait for its group commit (traced: the wait split by :func:`._trace.stored`)."""
        _trace.mark("apply")
        future = self.store.submit(job)
        await future
        _trace.stored(self.store.timing_of(future))

    async def _record_conflicts(self, rank: RankState, live: Incarnation, now: float) -> None:
        """``live`` sends again for itself: every process that claimed the rank meanwhile is in conflict with it.

        A process restarted after a crash displaces a live-looking incarnation too, but that one never
        sends again (its spool, replayed by another process, is marked so), so only two processes that both
        keep sending make a conflict. Each conflict is an event (kind ``rank_conflict``, stored under the
        claimant with id 0: agents number theirs from 1) and puts the claimant out of the rank, which is
        ``live``'s again; its later batches get a 409. docs/protocol.md#who-owns-a-rank has the whole table.
        """
        for claimant in claimants(rank.view.incarnations.values(), live):
            body = {"id": 0, "kind": "rank_conflict", "time": now, "iteration": claimant.batch.state.iteration,
                    "live_incarnation": live.id, "host": claimant.batch.host, "pid": claimant.batch.pid}
            event = (rank.run, rank.rank, claimant.id, 0, "rank_conflict", now, claimant.batch.state.iteration,
                     None, json.dumps(body))
            await self._stored(self.store.write_incarnation(rank.run, rank.rank, claimant.to_row(), [event]))
            rank.exclude(claimant)
            log.warning("rank %d of run %r: incarnation %s (host %s, pid %d) claimed it while %s kept sending; "
                        "put out of the rank (rank_conflict)", rank.rank, rank.run, claimant.id,
                        claimant.batch.host, claimant.batch.pid, live.id)


def _as_stored(body: bytes, events: list) -> str | None:
    """Return the body to store as the incarnation's batch when that is safe (no events, no bulk), else None."""
    # A small event-free body restores to the same model (unknown fields are ignored on reading), so it
    # needs no re-serialising; a large one might carry bulk that the schema drops, so it is re-serialised.
    return body.decode() if not events and len(body) <= _MAX_STORED_RAW else None
