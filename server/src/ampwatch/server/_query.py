"""The JSON query API: runs, ranks with their current state, and the event history."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request

from ampwatch.contract.placement import block_of
from ampwatch.contract.protocol import COLLECTOR_EVENT_KINDS, DELIVERY_COUNTERS, EVENT_KINDS, STREAK_LADDER

from ._fleet import Fleet
from ._floats import wire_float
from ._latest_events import STORM_CAUSE_SQL, collapse
from ._recovery import load_ranks
from ._run_scale import WINDOWS, run_scale, traces
from ._run_summary import firing_of, summary_page, trouble_rows
from ._state import RankState
from ._stored_form import event_of_row, wire_document
from ._suspects import SuspectJudge, SuspectSettings, for_run
from ._view_cache import ViewCache

__all__ = ["router", "rank_summary", "suspect_judge"]

router = APIRouter(prefix="/v1", tags=["query"])

if TYPE_CHECKING:  # a Literal built from the contract's tuples at run time is no type to mypy: plain text to it
    EventKind = str
    ScaleWindow = str
else:  # FastAPI answers 422 to any other value, naming those it takes
    EventKind = Literal[EVENT_KINDS + COLLECTOR_EVENT_KINDS]
    ScaleWindow = Literal[tuple(WINDOWS)]


def rank_summary(rank: RankState, in_metrics: bool) -> dict[str, Any]:
    """Describe a rank: identity, gauges of its newest process, totals over all its processes."""
    view = rank.view  # one batch's view throughout
    batch = view.owner.batch
    totals = view.totals.to_json()
    optimizers = {}
    for name, t in view.optimizer_totals.items():
        sent = batch.state.optimizers.get(name)
        optimizers[name] = {
            "steps": t.steps, "skipped": t.skipped, "consecutive_skipped": view.consecutive_skipped(name),
            "longest_streak": view.longest_streak(name), "streaks": t.streaks,
            "streaks_reached": {str(length): count
                                for length, count in zip(STREAK_LADDER, t.streaks_reached, strict=True)},
            "scheduler_steps_after_skip": t.scheduler_steps_after_skip, "poisoned_steps": t.poisoned_steps,
            "latest_nonfinite_parameter": view.latest_nonfinite(name),
            # Spikes over every process; the rolling levels as the newest process sent them (null: none sent).
            "grad_norm_spikes": t.grad_norm_spikes,
            "grad_norm": _level(sent.grad_norm if sent else None),
            "local_grad_norm": _level(sent.local_grad_norm if sent else None),
        }
    return {
        "rank": rank.rank, "host": batch.host, "local_rank": batch.local_rank, "world_size": batch.world_size,
        "pid": batch.pid, "incarnation": view.owner.id,
        # An agent before process_key: its batches cannot be told from a forger's (docs/security.md).
        "keyless": batch.process_key is None,
        "incarnations": len(view.incarnations) - len(view.conflicting),
        "last_seen": view.last_seen, "closed": view.closed, "in_metrics": in_metrics,
        # Scale values as the protocol writes them: NaN and infinities as strings (JSON has no such numbers).
        "iteration": batch.state.iteration, "loss_scale": wire_float(batch.state.loss_scale),
        "scaler": wire_document(batch.scaler), "agent": wire_document(batch.agent),
        **{name: totals[name] for name in ("backoffs", "growths", "manual_sets")},
        "delivery": {name: totals[name] for name in DELIVERY_COUNTERS},
        # Skipped iterations that started on this rank (DDP); null when its agent does not watch DDP.
        "origin_iterations": (view.totals.origin_iterations if view.totals.origin_iterations
                              or batch.state.origin_iterations is not None else None),
        "loss_spikes": view.totals.loss_spikes, "loss": _level(batch.state.loss),
        # Spikes of this rank's own gradients that stood out from the other ranks' (gradient_outlier events).
        "gradient_outliers": view.gradient_outliers,
        "optimizers": optimizers,
        # Processes that claimed this rank while it kept sending (rank_conflict events), kept out of it.
        "conflicts": [{"incarnation": inc.id, "host": inc.batch.host, "pid": inc.batch.pid,
                       "last_seen": inc.last_seen} for inc in view.conflicting],
    }


def _level(level: Any) -> dict[str, float] | None:
    return None if level is None else {"mean": level.mean, "std": level.std}


def origin_ranks(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the ranks where some of the run's skips started, most such iterations first."""
    found = [{key: s[key] for key in ("rank", "host", "local_rank", "origin_iterations")}
             for s in summaries if s["origin_iterations"]]
    return sorted(found, key=lambda s: (-s["origin_iterations"], s["rank"]))


@router.get("/runs", summary="List runs, most recently seen first, paginated; with --peers, every replica's")
async def list_runs(request: Request, limit: int = Query(100, ge=1, le=1000),
                    after: str | None = Query(None, max_length=1024,
                                                 description="the 'next' cursor of the previous page"),
                    scope: Literal["fleet", "local"] = Query(
                        "fleet", description="with --peers: 'fleet' lists the runs of every replica, 'local' this "
                                             "replica's own (what each replica asks of the others); without "
                                             "--peers both list this collector's")
                    ) -> dict[str, Any]:
    """Return a page of the runs in the database (rank count, first/last seen) and the next page's cursor; with
    --peers each run says the ``replica`` holding it, and the fleet answer lists the ``replicas`` and their state."""
    app = request.app.state
    fleet: Fleet | None = getattr(app, "fleet", None)
    if fleet is None or scope == "local":
        cursor = _cursor(after, fleet=False)
        rows = await _stored_runs(app.store, cursor, limit + 1, tie_included=False)
        page = [_local_row(row, app) for row in rows[:limit]]
        return {"runs": page,
                "next": f"{page[-1]['last_seen']!r}:{page[-1]['run']}" if len(rows) > limit else None}
    replicas = sorted(app.config.peers)  # a cursor names a replica by its place here: the same on every replica
    cursor = _cursor(after, fleet=True, replicas=len(replicas))

    def key(row: dict[str, Any]) -> tuple[float, str, int]:
        return -row["last_seen"], row["run"], replicas.index(row["replica"])

    # This replica's rows past the cursor (those tied with it on last_seen and run too: the replica decides),
    # and every peer's from its last answer, merged in one order.
    own = [_local_row(row, app) for row in await _stored_runs(app.store, cursor, limit + 2, tie_included=True)]
    peers, states = await fleet.answers()
    rows = sorted((row for row in own + peers if cursor is None or key(row) > cursor), key=key)[:limit + 1]
    page = rows[:limit]
    last = page[-1] if page else None
    return {"runs": page, "replicas": states,
            "next": f"{last['last_seen']!r}:{replicas.index(last['replica'])}:{last['run']}"
                    if last is not None and len(rows) > limit else None}


def _cursor(after: str | None, *, fleet: bool, replicas: int = 0) -> tuple[float, str, int] | None:
    """Read ``after``, the previous page's last row: ``<last_seen>:<run>``, or ``<last_seen>:<replica>:<run>`` in
    a fleet answer (the replica's place in the sorted ``--peers``); as its sort key (last_seen negated)."""
    if after is None:
        return None
    seen, sep, run = after.partition(":")
    place = "0"
    if fleet:
        place, _, run = run.partition(":")
    try:
        last_seen, index = float(seen), int(place)
    except ValueError:
        sep = ""
    if not sep or not 0 <= index < max(1, replicas):
        raise HTTPException(422, "'after' must be the 'next' value of the previous page of GET /v1/runs")
    return -last_seen, run, index


async def _stored_runs(store: Any, cursor: tuple[float, str, int] | None, limit: int,
                       tie_included: bool) -> list[Any]:
    """The database's runs past ``cursor`` (most recently seen first), with the one tied with it when asked."""
    having, params = "", []
    if cursor is not None:
        last_seen, run = -cursor[0], cursor[1]
        having = f" HAVING max(last_seen) < ? OR (max(last_seen) = ? AND run {'>=' if tie_included else '>'} ?)"
        params = [last_seen, last_seen, run]
    return await asyncio.to_thread(
        store.query, "SELECT run, count(DISTINCT rank) AS ranks, min(first_seen) AS first_seen, "
                     f"max(last_seen) AS last_seen FROM incarnations GROUP BY run{having} "
                     "ORDER BY last_seen DESC, run LIMIT ?", (*params, limit))


def _local_row(row: Any, app: Any) -> dict[str, Any]:
    """A run of this collector as GET /v1/runs lists it; with --peers, with the ``replica`` and blocks held."""
    held = app.collector_state.runs
    listed = dict(row, in_metrics=row["run"] in held)
    if app.config.peers:
        listed.update(split=_split(held.get(row["run"]), app.config), replica=app.config.advertise_url)
    return listed


def _split(ranks: dict[int, RankState] | None, config: Any) -> dict[str, Any] | None:
    """The blocks of a split run this collector holds ranks of (null: a run in one block, or no longer in memory)."""
    ranks = ranks or {}
    sizes = {rank.view.current.batch.world_size for rank in ranks.values() if rank.view.current is not None}
    world_size = max(sizes, default=0)  # a job's ranks all send one world size
    if len(config.peers) < 2 or world_size <= config.block_ranks:
        return None
    held = {block_of(rank, world_size, config.block_ranks) for rank in ranks if 0 <= rank < world_size}
    return {"blocks": sorted(held), "of": -(-world_size // config.block_ranks), "world_size": world_size}


# Run ids may hold "/" (the ASGI path arrives decoded, %2F included), hence {run:path}; the events, latest
# events, summary and scale routes come first, or the run route's {run:path} would take "<run>/events" as a run id.
@router.get("/runs/{run:path}/events", summary="A run's events, oldest (or newest) first, paginated")
async def list_events(
    request: Request, run: str,
    kind: EventKind | None = Query(None, description="only this event kind"),
    rank: int | None = Query(None, ge=0, description="only this rank"),
    optimizer: str | None = Query(None, description="only events of this optimizer"),
    since: float | None = Query(None, description="only events at or after this Unix time"),
    after: int = Query(0, ge=0, description="the 'next' cursor of the previous page"),
    limit: int = Query(100, ge=1, le=1000),
    newest_first: bool = Query(False, description="newest first: the first page is the latest events, 'next' "
                                                   "pages back in time"),
) -> dict[str, Any]:
    """Return events (skips with offending parameters, scale changes, warnings...) and the next page's cursor."""
    # Newest first, the cursor is the last row of the previous page and the next page lies below it.
    where, params = (["run = ?", "rowid < ?"] if newest_first and after else ["run = ?", "rowid > ?"]), [run, after]
    for column, value in (("kind", kind), ("rank", rank), ("optimizer", optimizer)):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if since is not None:
        where.append("time >= ?")
        params.append(since)
    store = request.app.state.store
    sql = (f"SELECT rowid AS cursor, rank, incarnation, id, kind, time, iteration, optimizer, body FROM events "
           f"WHERE {' AND '.join(where)} "
           f"ORDER BY rowid {'DESC' if newest_first else ''} LIMIT ?")
    rows = await asyncio.to_thread(store.query, sql, (*params, limit + 1))
    if not rows and after == 0:
        known = await asyncio.to_thread(store.query, "SELECT 1 FROM incarnations WHERE run = ? LIMIT 1", (run,))
        if not known:
            raise HTTPException(404, f"no run named {run!r}; GET /v1/runs lists the known runs")
    page = rows[:limit]
    events = [dict(event_of_row(row), rank=row["rank"], incarnation=row["incarnation"]) for row in page]
    return {"events": events, "next": page[-1]["cursor"] if len(rows) > limit else None}


@router.get("/runs/{run:path}/events/latest", summary="A run's newest events, each storm collapsed into one row")
async def latest_events(
    request: Request, run: str,
    limit: int = Query(100, ge=1, le=1000, description="rows"),
    scan: int = Query(5000, ge=1, le=50_000, description="newest events the rows start from"),
) -> dict[str, Any]:
    """Return up to ``limit`` rows, newest first: one per event, except a storm's events (one kind, iteration,
    optimizer and cause on 5 ranks or more), which share one row with their count and ranks. Rows start among
    the newest ``scan`` events; a storm's count takes in as many again behind them, so the scan's edge does not
    cut it (one indexed read: milliseconds for 10,000). The page asks for rare kinds separately."""
    rows = await asyncio.to_thread(
        request.app.state.store.query,
        f"SELECT id, rank, incarnation, kind, time, iteration, optimizer, body, {STORM_CAUSE_SQL} "
        "FROM events WHERE run = ? ORDER BY rowid DESC LIMIT ?", (run, 2 * scan))
    if not rows:
        known = await asyncio.to_thread(request.app.state.store.query,
                                        "SELECT 1 FROM incarnations WHERE run = ? LIMIT 1", (run,))
        if not known:
            raise HTTPException(404, f"no run named {run!r}; GET /v1/runs lists the known runs")
    return {"rows": collapse(rows, limit, fresh=scan), "scanned": len(rows), "more": len(rows) == 2 * scan}


def suspect_judge(state: Any) -> SuspectJudge:
    """The app's judge of suspects (made on first use, with the collector's settings)."""
    if getattr(state, "suspect_judge", None) is None:
        config = state.config
        state.suspect_judge = SuspectJudge(state.store.query, SuspectSettings(
            config.suspect_events, config.suspect_max_origins, config.suspect_stand_out_ratio),
            ranks_judged=state.placements.ranks_judged)
    return state.suspect_judge


@router.get("/suspects", summary="Suspect devices and samples, each with its evidence (docs/suspects.md)")
async def get_suspects(
    request: Request,
    run: str | None = Query(None, max_length=1024, description="only suspects with evidence in this run (judged "
                                                                "over every run)"),
) -> dict[str, Any]:
    """Return the devices that were the sole origin of enough skips with different samples, and the samples
    found in the origin ranks' batches on two devices or more, judged over the evidence kept across runs."""
    body = await asyncio.to_thread(suspect_judge(request.app.state).current)
    return for_run(body, run) if run is not None else body


def _views(request: Request) -> ViewCache:
    """The app's cache of run-view bodies (made on first use)."""
    state = request.app.state
    if getattr(state, "view_cache", None) is None:
        state.view_cache = ViewCache(clock=state.clock)
    return state.view_cache


def _held(request: Request, run: str) -> dict[int, RankState]:
    ranks = request.app.state.collector_state.runs.get(run)
    if not ranks:
        raise HTTPException(404, f"no run named {run!r} in memory (a run leaves it after --run-retention or "
                                 f"--expire-after); GET /v1/runs/{{run}} reads one from the database")
    return ranks


@router.get("/runs/{run:path}/summary", summary="A run at a glance: ranks in trouble first, paged")
async def get_run_summary(
    request: Request, run: str,
    offset: int = Query(0, ge=0, description="rows to skip"),
    limit: int = Query(50, ge=1, le=1000, description="rows in this page"),
    search: str = Query("", max_length=200, description="a rank number, part of a host name, or a reason"),
) -> dict[str, Any]:
    """Return counts by trouble reason, the loss-scale spread and a page of rank rows (only ranks held in memory).

    The rows are built once per change of the run (its generation or firing alerts), at least 1 s and at most
    10 s apart, and shared by every page, search and tab; each answer reads its rows' progress (iteration,
    steps, last seen) now.
    """
    ranks, state = _held(request, run), request.app.state.collector_state
    alerts = request.app.state.alert_service.alerts
    firing = firing_of(run, alerts)
    version = (state.generation(run), firing)
    built = _views(request).get(("summary", run), version, lambda: trouble_rows(
        run, list(ranks.values()), alerts, request.app.state.clock(), request.app.state.config.silent_after, firing),
        min_age_s=_SUMMARY_MIN_AGE_S)
    return dict(summary_page(built, ranks, request.app.state.clock(), offset, limit, search),
                generation=state.generation(run))


@router.get("/runs/{run:path}/scale", summary="A run's loss scale over recent iterations: spread and outlier ranks")
async def get_run_scale(
    request: Request, run: str,
    window: ScaleWindow = Query(
        "1000", description="the last 200, 1000 or 5000 iterations, or all the collector holds"),
    ranks: str = Query("", max_length=400, pattern=r"^[0-9,]*$",
                       description="comma-separated ranks to include whatever their distance (at most 16)"),
    outliers: int = Query(6, ge=0, le=16, description="ranks furthest from the median to include"),
) -> dict[str, Any]:
    """Return min / median / max of the loss scale across ranks per slice of the window (at most 200 slices) and
    the outlier ranks with their points and skips; built once per change of the run, at most once per 3 s
    (a storm changes it at every batch; the chart is redrawn every 3 s)."""
    held, state = _held(request, run), request.app.state.collector_state
    asked = tuple(sorted({int(r) for r in ranks.split(",") if r}))[:16]
    key, generation = ("scale", run, window, asked, outliers), state.generation(run)
    views = _views(request)
    if (body := views.peek(key, generation)) is not None:
        return body
    copies = traces(held.values())  # on the event loop, while no batch changes them; the rest off it
    body = await asyncio.to_thread(run_scale, run, copies, WINDOWS[window], outliers=outliers, asked=asked)
    if body["outliers"]:
        shown = [o["rank"] for o in body["outliers"]]
        found = await asyncio.to_thread(request.app.state.store.query, _SKIPS_SQL.format(
            ranks=",".join("?" * len(shown))), (run, _SKIPS_SCANNED, body["start"], *shown, _SKIPS_SHOWN))
        skips: dict[int, list] = {}
        streaks: dict[int, list] = {}
        for row in reversed(found):
            if row["kind"] == "skip":
                skips.setdefault(row["rank"], []).append([row["iteration"], row["optimizer"]])
            else:  # a streak's end: its whole length, the skips between its rungs were counted, not sent
                end = event_of_row(row)
                streaks.setdefault(row["rank"], []).append([end["start_iteration"], end["length"], row["optimizer"]])
        for o in body["outliers"]:
            o["skips"], o["streaks"] = skips.get(o["rank"], []), streaks.get(o["rank"], [])
    return views.put(key, generation, body, request.app.state.clock() + _SCALE_MIN_AGE_S,
                     min_age_s=_SCALE_MIN_AGE_S)


_SUMMARY_MIN_AGE_S = 1.0  # a summary rebuilt at most once a second per run, however many tabs read it
_SCALE_MIN_AGE_S = 3.0  # the chart's data, likewise once per page refresh

# The shown ranks' skips and streak ends in the window, for the chart's marks: among the run's newest events only
# (bounded work).
_SKIPS_SCANNED, _SKIPS_SHOWN = 20_000, 2_000
_SKIPS_SQL = ("SELECT id, rank, kind, time, iteration, optimizer, body FROM (SELECT rowid, id, rank, kind, time, "
              "iteration, optimizer, body FROM events WHERE run = ? ORDER BY rowid DESC LIMIT ?) "
              "WHERE kind IN ('skip', 'streak_end') AND iteration >= ? AND rank IN ({ranks}) "
              "ORDER BY rowid DESC LIMIT ?")


@router.get("/runs/{run:path}/placement", summary="Where a run is placed among the collectors (--peers)")
async def get_run_placement(request: Request, run: str) -> dict[str, Any]:
    """Return the run's ``placement`` as ``GET /v1/runs/{run}`` has it (null with one collector, or for a run not
    held in memory), without its ranks: what the page reads of a run of any size; ``collectors``: how many
    ``--peers`` list (1 without)."""
    placements = request.app.state.placements
    return {"run": run, "collectors": len(placements.peers) or 1, "placement": placements.to_json(run)}


@router.get("/runs/{run:path}", summary="One run: its ranks with their current state")
async def get_run(request: Request, run: str) -> dict[str, Any]:
    """Return the run's ranks (from memory when shown in /metrics, else rebuilt from the database)."""
    held = request.app.state.collector_state.runs.get(run, {})
    stored = await asyncio.to_thread(load_ranks, request.app.state.store, run=run)
    ranks = {r.rank: (r, False) for r in stored}
    ranks.update({r.rank: (r, True) for r in held.values() if r.view.current is not None})
    if not ranks:
        raise HTTPException(404, f"no run named {run!r}; GET /v1/runs lists the known runs")
    summaries = [rank_summary(r, shown) for _, (r, shown) in sorted(ranks.items())]
    body = {"run": run, "closed": all(s["closed"] for s in summaries), "origin_ranks": origin_ranks(summaries),
            "ranks": summaries}
    placements = request.app.state.placements
    if placements.enabled:  # several collectors (--peers): where the run is, and what came here that belongs elsewhere
        body["placement"] = placements.to_json(run)
    return body
