"""The FastAPI application: ingest, /metrics, the query API, health, and the retirement loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from . import _trace
from ._access import AccessGuard, AccessMetrics
from ._checkpoints import Checkpointer
from ._config import ServerConfig
from ._evidence import prune_evidence_job
from ._fleet import Fleet
from ._gc import release_free_memory
from ._hosts import HostAllowList
from ._ingest import IngestService
from ._metrics import (
    CONTENT_TYPE,
    RENDER_PAUSE_S,
    Exposition,
    NotificationMetrics,
    SelfMetrics,
    accepts_gzip,
    gzip_exposition,
)
from ._placement_view import Placements
from ._query import router as query_router
from ._query import suspect_judge
from ._recovery import delete_history_job, load_ranks, stored_ranks
from ._state import CollectorState, RankState
from ._status_page import mount_status_page
from ._store import Store
from .alerting.notifications import NotifyConfig
from .alerting.route import router as alerts_router
from .alerting.service import AlertService

__all__ = ["create_app", "VERSION"]

VERSION = "0.1.0"
log = logging.getLogger("ampwatch.server")


async def _retire_loop(app: FastAPI, config: ServerConfig) -> None:
    """Drop quiet ranks and finished runs from memory; prune old history from the database hourly."""
    state, store, clock = app.state.collector_state, app.state.store, app.state.clock
    period = max(0.05, min(15.0, config.silent_after / 4, config.run_retention / 4 or 15.0))
    last_prune = 0.0
    while True:
        now = clock()
        gone = state.retire(now, config.expire_after, config.run_retention)
        try:
            await app.state.ingest.judge_waiting()  # spikes of runs whose ranks stopped sending
        except Exception:
            log.exception("judging gradient outliers failed; will retry")
        if gone:
            app.state.placements.keep(state.runs)
            log.info("%d ranks left /metrics (quiet past --expire-after or run retired)", len(gone))
        if now - last_prune >= 3600:
            last_prune = now
            try:
                pruned = set(await store.submit(delete_history_job(now - config.db_retention)))
                if pruned:
                    state.stored = {key for key in state.stored if key[0] not in pruned}
                    log.info("deleted the history of %d runs older than --db-retention", len(pruned))
                dropped = await store.submit(prune_evidence_job(now - config.suspect_retention_days * 86400.0,
                                                                config.suspect_max_rows))
                if dropped:
                    log.info("deleted %d evidence rows past --suspect-retention-days or --suspect-max-rows", dropped)
            except Exception:
                log.exception("pruning old history failed; will retry in an hour")
        await asyncio.sleep(period)


SUSPECTS_EVERY_S = 5.0
"""How often the built-in alerts take the suspects (GET /v1/suspects and /metrics judge them when read)."""


async def _suspect_loop(app: FastAPI) -> None:
    """Give the built-in alerts the suspect devices every :data:`SUSPECTS_EVERY_S` (judged again only once the
    evidence changed: ``SuspectJudge``); a rank's next batch then holds AmpSuspectDevice or not."""
    judge = suspect_judge(app.state)
    while True:
        try:
            body = await asyncio.to_thread(judge.current)
            app.state.alert_service.suspect_devices = frozenset(d["device"] for d in body["devices"])
        except Exception:
            log.exception("judging the suspects failed; will retry")
        await asyncio.sleep(SUSPECTS_EVERY_S)


class _CollectorApp(FastAPI):
    """FastAPI, except that ingest goes straight to its handler (no routing or dependency solving per batch)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (refusal := self.state.guard.refusal(scope)) is not None:
            await self.state.guard.refuse(send, *refusal)
            return
        if scope["type"] == "http" and scope["path"] == "/v1/ingest" and scope["method"] == "POST" \
                and self.state.ready:
            await self.state.ingest(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def create_app(config: ServerConfig, *, clock: Callable[[], float] = time.time) -> FastAPI:
    """Build the collector app; the database opens at startup and closes at shutdown.

    ``clock`` (Unix seconds) stamps every batch and drives expiry and the built-in alerts: a
    benchmark passes a simulated one to run half an hour of pushes in minutes.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        trace = _trace.start()  # AMPWATCH_SERVER_TRACE: off unless set
        store = Store(config.db)
        checkpoints = Checkpointer(store)
        store.trace = trace.add if trace is not None else None
        state = CollectorState(config)
        horizon = clock() - max(config.expire_after, config.run_retention)
        state.stored = await asyncio.to_thread(stored_ranks, store)
        for rank in await asyncio.to_thread(load_ranks, store, seen_after=horizon):
            state.adopt(rank)
        state.retire(clock(), config.expire_after, config.run_retention)
        placements = app.state.placements = Placements(config.peers, config.advertise_url, config.block_ranks)
        for _, view in state.views():
            placements.note(view.run, view.rank, view.owner.batch.world_size)
        own = SelfMetrics(state, store.size_bytes, VERSION)
        store.on_events_added = own.events.inc
        app.state.store, app.state.collector_state, app.state.own = store, state, own
        ingest = app.state.ingest = IngestService(config, state, store, own, clock)
        ingest.outliers.ranks_judged = placements.ranks_judged  # a split run's share: of its ranks here
        app.state.exposition = Exposition(state, own, config.silent_after, clock, pause_s=RENDER_PAUSE_S,
                                          busy=lambda: ingest.in_flight > 0,
                                          suspects=suspect_judge(app.state).current)
        notify = NotifyConfig(group_wait_s=config.notify_group_wait, group_interval_s=config.notify_group_interval,
                              repeat_interval_s=config.notify_repeat_interval)
        alerts = app.state.alert_service = AlertService(config.webhook, thresholds=config.alert_thresholds,
                                                        notify_config=notify, clock=clock,
                                                        blocks=placements.alert_block)
        own.registry.register(NotificationMetrics(alerts.notifier.counts))
        own.registry.register(AccessMetrics(app.state.guard))

        def applied(rank: RankState) -> None:
            batch = rank.view.owner.batch
            placements.note(batch.run, batch.rank, batch.world_size)
            alerts.observe(rank)
        app.state.ingest.on_applied = applied if placements.enabled else alerts.observe
        alert_task = asyncio.create_task(alerts.run(state))
        task = asyncio.create_task(_retire_loop(app, config))
        suspects_task = asyncio.create_task(_suspect_loop(app))
        # With --peers: the other replicas' runs, for GET /v1/runs and the page (docs/collector.md#fleet-view).
        fleet = app.state.fleet = Fleet(config.advertise_url, config.peers, config.read_token) \
            if config.peers and config.advertise_url else None
        fleet_task = asyncio.create_task(fleet.run()) if fleet is not None else None
        lag_task = asyncio.create_task(trace.watch_loop()) if trace is not None else None
        app.state.ready = True
        log.info("state rebuilt from %s: %d runs, %d ranks", store.path, len(state.runs), state.rank_count())
        try:
            yield
        finally:
            app.state.ready = False
            task.cancel()
            alert_task.cancel()
            suspects_task.cancel()
            if fleet is not None and fleet_task is not None:
                fleet_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await fleet_task
                fleet.close()
            with contextlib.suppress(asyncio.CancelledError):
                await suspects_task
            with contextlib.suppress(asyncio.CancelledError):
                await task
            with contextlib.suppress(asyncio.CancelledError):
                await alert_task
            await asyncio.to_thread(alerts.close)
            await asyncio.to_thread(checkpoints.close)
            await asyncio.to_thread(store.close)
            if lag_task is not None:
                lag_task.cancel()
            _trace.stop()

    # /docs (Swagger UI) makes the browser fetch scripts from a public CDN: off unless asked for (--api-docs).
    app = _CollectorApp(title="ampwatch collector", version=VERSION, lifespan=lifespan,
                        docs_url="/docs" if config.api_docs else None, redoc_url=None,
                  description="Receives GradScaler skip and loss-scale batches from ampwatch agents "
                              "(protocol v1, or v2: one node's ranks per request; docs/protocol.md) and exposes "
                              "them to Prometheus at /metrics.")
    app.state.ready = False
    app.state.config = config
    app.state.clock = clock
    app.state.guard = AccessGuard(config.read_token, config.rate_limit, HostAllowList.of(config))

    @app.post("/v1/ingest", tags=["ingest"],
              summary="Apply one agent batch (protocol v1) or one node's batches (v2)",
              responses={200: {"description": '{"applied": true} or {"applied": false, "duplicate": true}; v2: '
                                              '{"protocol": 2, "results": [one per rank, with its "status"]}'},
                         400: {"description": "malformed JSON"}, 401: {"description": "token missing"},
                         403: {"description": "token wrong"}, 413: {"description": "body too large"},
                         409: {"description": 'refused for good ("retry": false): this process claimed a rank '
                                              "that another process kept sending to (rank_conflict)"},
                         422: {"description": 'refused for good ("retry": false): schema error, name too long, '
                                              "over --max-optimizers-per-rank / --max-ranks-per-run, or a counter "
                                              "rising faster than --max-counter-rate"},
                         429: {"description": 'back-pressure ("retry": true, Retry-After): over --max-runs, '
                                              "--rate-limit, --client-new-runs or --client-event-rate"},
                         503: {"description": "retry"}})
    async def ingest(request: Request) -> JSONResponse:
        """Validate the batch, store it, answer once it is committed."""
        # Reached only before startup completes: once ready, _CollectorApp answers ingest itself.
        return JSONResponse({"error": "unavailable", "retry": True, "message": "the collector is starting; retry"},
                            503)

    @app.get("/metrics", tags=["metrics"], response_class=PlainTextResponse,
             summary="Prometheus exposition (text format 0.0.4)")
    async def metrics(request: Request) -> Response:
        """Render every series from the current state; gzip it when the scraper accepts it (Prometheus does)."""
        # Rendered in a worker thread (about 1 s at the default max_ranks_per_run): the event loop goes on applying
        # batches meanwhile, and the render reads each rank's immutable view, so it never sees half a batch.
        exposition = request.app.state.exposition
        render = exposition.render if _trace.active is None else lambda: _trace.timed("render", exposition.render)
        if not accepts_gzip(request.headers.get("accept-encoding", "")):
            body = await run_in_threadpool(lambda: render().encode())
            response = Response(body, media_type=CONTENT_TYPE, headers={"Vary": "Accept-Encoding"})
        else:
            response = Response(await run_in_threadpool(lambda: gzip_exposition(render())), media_type=CONTENT_TYPE,
                                headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
        response.background = BackgroundTask(run_in_threadpool, release_free_memory)  # once the body is sent
        return response

    @app.get("/healthz", tags=["health"], summary="The process is alive")
    async def healthz() -> dict:
        """Answer 200 while the process serves requests."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], summary="State rebuilt and database writable")
    async def readyz(request: Request) -> JSONResponse:
        """Answer 200 once state is rebuilt and the database writer runs, else 503."""
        store = getattr(request.app.state, "store", None)
        if request.app.state.ready and store is not None and store.healthy and store.failing is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    app.include_router(query_router)
    app.include_router(alerts_router)
    mount_status_page(app)
    return app
