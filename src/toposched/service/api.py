"""The HTTP API over one replica's ``ServiceState`` (routes only; the app is built in ``app.py``).

POST   /v1/placements               place a request (idempotent by ``id``); 201 placed, 200 already placed;
                                    with ``pd``, every prefill and decode instance or none
GET    /v1/placements               every live placement
GET    /v1/placements/{id}          one placement (any replica's)
DELETE /v1/placements/{id}          release every instance of it
POST   /v1/placements/{id}/renew    extend its lease
GET    /v1/topology                 nodes, NVLink domains and who holds each GPU
POST   /v1/topology/refresh         probe the topology source again (same GPUs only)
GET    /v1/queue                    the admission queue in service order (the head's defrag plan)
POST   /v1/defrag                   plan the fewest moves that free room (dry run by default), or book them
POST   /v1/defrag/finish            release a moved instance's old copy (its replacement is booked)
GET    /v1/alerts                   the nine signals now, the thresholds, those crossed and the GPUs they point at
GET    /v1/signals/history          the nine signals over the last hour (sampled every 10 s; service/history.py)
POST   /v1/reports                  a sidecar report: mark degraded, propose a re-placement
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse
from prometheus_client import Histogram

from toposched.errors import InputError
from toposched.names import ID_PATTERN
from toposched.perf.profile import use_profile
from toposched.service import defrag as service_defrag
from toposched.service.guards import Receive
from toposched.service.history import SignalHistory, take_sample
from toposched.service.metrics import THRESHOLDS, breaches, signal_gpus, signals
from toposched.service.records import Decision, Instance
from toposched.service.replica import P, R
from toposched.service.schemas import (
    AlertsOut,
    DefragBody,
    DefragOut,
    ErrorOut,
    FinishedOut,
    FinishMoveBody,
    NotPlacedOut,
    PlaceBody,
    PlacementListOut,
    PlacementOut,
    QueueOut,
    ReactionOut,
    RefreshOut,
    ReleasedOut,
    RenewBody,
    ReportBody,
    SignalHistoryOut,
    TopologyOut,
)
from toposched.service.state import ServiceState
from toposched.solver.pd import place_stores
from toposched.topology.model import Cluster

log = logging.getLogger("toposched.service")

PlacementId = Annotated[str, Path(pattern=ID_PATTERN, description="placement (request) id")]
Responses = dict[int | str, dict[str, Any]]

THRESHOLDS_JSON = [dataclasses.asdict(t) for t in THRESHOLDS]  # the web page draws them on the sparklines
DECISION_STATUS = {"placed": 201, "existing": 200, "conflict": 409, "no-capacity": 409, "rejected": 422}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before trying again", "schema": {"type": "integer"}}}
ERRORS: Responses = {
    401: {
        "description": "no or wrong bearer token",
        "headers": {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}},
    },
    403: {"description": "a scoped token (report or read token) used outside its scope"},
    404: {"description": "no such placement"},
    413: {"description": "body over the limit (by Content-Length or while streaming)"},
    422: {"description": "invalid request: the fields named"},
    429: {"description": "admission queue full", "headers": {**RETRY_AFTER}},
    503: {"description": "state unavailable (SQLite file, etcd)"},
}


def answers(*codes: int, ok: Any = None, created: Any = None) -> Responses:
    """OpenAPI ``responses``: the error ``codes`` (ErrorOut bodies), and the models of 200 and 201 answers."""
    out: Responses = {code: {"model": ErrorOut, **ERRORS[code]} for code in codes}
    out.update({code: {"model": model} for code, model in ((200, ok), (201, created)) if model is not None})
    return out


# the answers every authenticated route may give, and those of routes that take a body or a placement id
AUTH = (401, 403, 503)
BODY = (*AUTH, 413, 422)
BY_ID = (*AUTH, 404, 422)


def instance_json(instance: Instance) -> dict[str, Any]:
    p = instance.placement
    data = p.model_dump(mode="json")
    data["gpus"] = list(p.gpu_refs)
    data["hbm_per_gpu"]["total"] = p.hbm_per_gpu.total
    data["degraded"] = instance.degraded
    return data


def pd_json(group: list[Instance], cluster: Cluster) -> dict[str, Any]:
    """A disaggregated request's ``pd`` (what was asked, and each decode instance's prefill instance) and
    ``stores`` (``solver.pd.place_stores`` over its decode instances, as ``toposched plan`` reports them)."""
    spec = group[0].body["pd"]
    decodes = [i.placement for i in group if i.placement.role == "decode"]
    nodes = {n.name: n for n in cluster.nodes}
    stores = place_stores(decodes, nodes) if spec.get("kv_store") and decodes else []
    serving_id = {i.slot: i.placement.id for i in group}  # a moved instance lives under its replacement's id
    pairs = {
        i.placement.id: serving_id.get(i.pair, i.pair) if i.pair else None
        for i in group
        if i.placement.role == "decode"
    }
    return {"pd": {**spec, "pairs": pairs}, "stores": [s.model_dump(mode="json") for s in stores]}


def group_json(group: list[Instance], cluster: Cluster) -> dict[str, Any]:
    """One request's answer; a disaggregated one adds ``pd`` and ``stores`` (``pd_json``)."""
    first = group[0]
    expiries = [i.expires_at for i in group if i.expires_at is not None]
    extra = pd_json(group, cluster) if first.body.get("pd") else {}
    return {
        "id": first.request_id,
        "model": first.placement.model,
        "status": "degraded" if any(i.degraded for i in group) else "placed",
        "replicas": len(group),
        "ranks": [
            {"instance": i.placement.id, "rank": r.rank, "node": r.node, "gpu": r.gpu, "stage": r.stage}
            for i in group
            for r in i.placement.ranks
        ],
        "instances": [instance_json(i) for i in group],
        "expires_at": min(expiries) if expiries else None,
        "owner": first.owner,
        "request": first.body,
        **extra,
    }


async def on_worker(state: ServiceState, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run ``fn`` where the state lives: inline on the event loop (SQLite, memory), else on its worker thread
    (whose initializer set the service's cost-model profile); inline, under ``use_profile`` of it."""
    if state.inline:
        with use_profile(state.config.profile):
            return fn(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(state.worker, functools.partial(fn, *args, **kwargs))


def not_found(pid: str) -> JSONResponse:
    return JSONResponse({"error": "not found", "detail": f"no placement {pid}"}, status_code=404)


def decision_response(state: ServiceState, decision: Decision) -> JSONResponse:
    code = DECISION_STATUS[decision.status]
    if decision.instances:
        return JSONResponse(group_json(list(decision.instances), state.scheduler.cluster), status_code=code)
    headers = {"Retry-After": "1"} if decision.status == "no-capacity" else None
    body = {"id": decision.request_id, "status": decision.status, "reasons": list(decision.reasons)}
    return JSONResponse(body, status_code=code, headers=headers)


async def place_answer(
    state: ServiceState, latency: Histogram, body: PlaceBody, receive: Receive | None = None
) -> JSONResponse:
    """The answer of ``POST /v1/placements``.

    ``receive``: the request's ASGI receive, its body read already; a request waiting in the admission
    queue watches it, so a client that goes away is taken out of the queue (or, placed meanwhile, released)."""
    started = time.perf_counter()
    if body.wait_s > 0 and body.wait_s > state.config.max_wait_s:
        problem = {"field": "body.wait_s", "message": f"at most {state.config.max_wait_s:g} s"}
        return JSONResponse({"error": "invalid request", "fields": [problem]}, status_code=422)
    decision: Decision | None = None
    if body.request_rate is not None:
        try:
            body = await on_worker(state, state.sized, body)
        except InputError as exc:
            return JSONResponse({"error": "invalid request", "detail": exc.message, "fix": exc.fix}, status_code=422)
    hold_s = state.headroom_hold_s(body, body.wait_s)
    if body.wait_s == 0 or not len(state.queue):
        decision = await on_worker(state, state.place, body, headroom=state.config.keep_whole_domains if hold_s else 0)
    elif body.id:  # others wait: an id booked already is answered now (existing, or a conflict), not queued
        decision = await on_worker(state, state.booked_answer, body)
    if decision is None or (decision.status == "no-capacity" and body.wait_s > 0):
        decision = await _wait_in_queue(state, body, hold_s, receive)
        if decision is None:
            latency.labels(outcome="queue-full").observe(time.perf_counter() - started)
            full = {"error": "queue full", "detail": "retry later"}
            return JSONResponse(full, status_code=429, headers={"Retry-After": "1"})
    latency.labels(outcome=decision.status).observe(time.perf_counter() - started)
    return decision_response(state, decision)


async def release_answer(state: ServiceState, pid: str) -> JSONResponse:
    """The answer of ``DELETE /v1/placements/{pid}``."""
    released = await on_worker(state, state.release, pid)
    if released is None:
        return not_found(pid)
    return JSONResponse({"id": pid, "released": released})


V1 = "/v1"
"""The API's version prefix."""


def add_routes(router: APIRouter, state: ServiceState, latency: Histogram) -> None:
    """Add the ``/v1`` routes to ``router``: the app's own (``app.router``), not a router the app includes,
    whose every request FastAPI matches twice (the app's match, then the included router's): 0.09 ms of
    server CPU per create + delete pair more, paired on a 2-core VM (docs/service.md)."""

    placed = answers(*BODY, 429, ok=PlacementOut, created=PlacementOut)
    placed[409] = {"model": NotPlacedOut, "description": "conflict, or no capacity", "headers": {**RETRY_AFTER}}
    placed[422] = {**placed[422], "model": ErrorOut | NotPlacedOut, "description": "invalid, or can never fit"}

    @router.post(
        V1 + "/placements",
        status_code=201,
        responses=placed,
        summary="Place a request's instances (all or none), waiting up to wait_s in the fair queue",
    )
    async def create_placement(body: PlaceBody, request: Request) -> JSONResponse:
        return await place_answer(state, latency, body, request.receive)

    @router.get(V1 + "/placements", responses=answers(*AUTH, ok=PlacementListOut), summary="Every live placement")
    async def list_placements() -> JSONResponse:
        return JSONResponse(
            {"placements": [group_json(g, state.scheduler.cluster) for g in await on_worker(state, state.all_groups)]}
        )

    @router.get(V1 + "/placements/{pid}", responses=answers(*BY_ID, ok=PlacementOut), summary="One placement")
    async def get_placement(pid: PlacementId) -> JSONResponse:
        found = await on_worker(state, state.lookup, pid)
        return JSONResponse(group_json(found, state.scheduler.cluster)) if found else not_found(pid)

    @router.delete(
        V1 + "/placements/{pid}",
        responses=answers(*BY_ID, ok=ReleasedOut),
        summary="Release every instance of a placement",
    )
    async def delete_placement(pid: PlacementId) -> JSONResponse:
        return await release_answer(state, pid)

    @router.post(
        V1 + "/placements/{pid}/renew", responses=answers(*BY_ID, 413, ok=PlacementOut), summary="Extend the lease"
    )
    async def renew_placement(pid: PlacementId, body: RenewBody) -> JSONResponse:
        renewed = await on_worker(state, state.renew, pid, body.ttl_s)
        return JSONResponse(group_json(renewed, state.scheduler.cluster)) if renewed else not_found(pid)

    @router.get(
        V1 + "/topology",
        responses=answers(*AUTH, ok=TopologyOut),
        summary="Nodes, NVLink domains, occupancy and who holds each GPU",
    )
    async def get_topology() -> JSONResponse:
        return JSONResponse(await on_worker(state, state.topology_view))

    @router.post(
        V1 + "/topology/refresh",
        responses=answers(*AUTH, 422, ok=RefreshOut),
        summary="Probe the topology source again and store a new DomainMap",
    )
    async def refresh_topology() -> JSONResponse:
        stored = await on_worker(state, state.refresh_topology, probe=True)
        return JSONResponse(
            {"version": stored.version, "created_at": stored.created_at, "source": stored.source.describe()}
        )

    @router.get(
        V1 + "/queue",
        responses=answers(*AUTH, ok=QueueOut),
        summary="Requests waiting in the admission queue, in the order they would be served",
    )
    async def get_queue() -> JSONResponse:
        items = await on_worker(state, state.queue_view)
        return JSONResponse({"depth": len(items), "items": items})

    refused: Responses = {
        409: {"model": ErrorOut, "description": "no plan (the detail says why), or the ledger refused a booking"},
        429: {"model": ErrorOut, "description": "over the rate limit of moves booked", "headers": {**RETRY_AFTER}},
    }

    @router.post(
        V1 + "/defrag",
        responses={**answers(*BODY, ok=DefragOut), **refused},
        summary="The fewest moves that free room for a TP group (dry run by default; else books the new copies)",
    )
    async def post_defrag(body: DefragBody) -> JSONResponse:
        answer = await on_worker(
            state,
            service_defrag.defrag,
            state,
            need_gpus=body.need_gpus,
            request=body.request() if body.model is not None else None,
            level=body.level,
            max_moves=body.max_moves,
            dry_run=body.dry_run,
        )
        if answer.status in ("no-plan", "conflict"):
            error = "no defrag plan" if answer.status == "no-plan" else "conflict"
            return JSONResponse({"error": error, "detail": answer.reason}, status_code=409)
        if answer.status == "limited":
            wait = answer.retry_after_s
            retry = str(max(1, math.ceil(wait))) if math.isfinite(wait) else "3600"
            limited = {"error": "rate limited", "detail": answer.reason}
            return JSONResponse(limited, status_code=429, headers={"Retry-After": retry})
        assert answer.plan is not None
        booked = [m.replacement_id for m in answer.plan.moves] if answer.status == "booked" else []
        plan = {"need_gpus": answer.need_gpus, "level": answer.level, **answer.plan.to_json()}
        return JSONResponse({**plan, "dry_run": answer.status == "planned", "booked": booked})

    @router.post(
        V1 + "/defrag/finish",
        responses={**answers(*BODY, 404, ok=FinishedOut), 409: refused[409]},
        summary="Release a moved instance's old copy once its new copy is up and the old one drained",
    )
    async def post_defrag_finish(body: FinishMoveBody) -> JSONResponse:
        answer = await on_worker(state, service_defrag.finish, state, body.placement_id, body.replacement_id)
        if answer.status == "not-found":
            return not_found(body.placement_id)
        if answer.status == "not-a-move":
            fix = "book the move first (POST /v1/defrag with dry_run false); the old copy keeps serving"
            return JSONResponse({"error": "conflict", "detail": answer.reason, "fix": fix}, status_code=409)
        ids = {"placement_id": body.placement_id, "replacement_id": body.replacement_id}
        return JSONResponse({**ids, "released": list(answer.released)})

    @router.get(
        V1 + "/alerts",
        responses=answers(*AUTH, ok=AlertsOut),
        summary="The nine placement-health signals now, the alert thresholds, those crossed (no for: duration) "
        "and the GPUs each crossed one points at",
    )
    async def get_alerts() -> JSONResponse:
        stats = await on_worker(state, state.stats)
        gpus = signal_gpus(stats)
        firing = [{**alert, "gpus": gpus[str(alert["signal"])]} for alert in breaches(stats)]
        return JSONResponse({"signals": signals(stats), "firing": firing, "thresholds": THRESHOLDS_JSON})

    @router.post(
        V1 + "/reports",
        responses=answers(*BODY, 404, ok=ReactionOut),
        summary="A sidecar report: mark degraded, propose a move",
    )
    async def post_report(body: ReportBody) -> JSONResponse:
        reaction = await on_worker(state, state.report, body.report())
        return JSONResponse(reaction) if reaction is not None else not_found(body.placement)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone away (the request's body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _wait_in_queue(
    state: ServiceState, body: PlaceBody, hold_s: float = 0.0, receive: Receive | None = None
) -> Decision | None:
    """Queue the request and wait for ``drain`` to place it, at most ``wait_s``; None when the queue is full.

    ``hold_s``: how long it is decided with the service's headroom (``Admission.headroom_hold_s``).
    ``receive``: watched while waiting; a client that goes away is taken out of the queue, and what was
    placed for it meanwhile is released (nobody would get the answer, and nothing would renew it)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Decision] = loop.create_future()

    def deliver(decision: Decision) -> None:
        def settle() -> None:
            if not future.done():
                future.set_result(decision)

        loop.call_soon_threadsafe(settle)

    if not body.id:
        body = body.model_copy(update={"id": state.new_id()})
    rid = await on_worker(state, state.enqueue, body, deliver, hold_s)
    if rid is None:
        return None
    gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None
    try:
        waits: set[asyncio.Future[Any]] = {future} if gone is None else {future, gone}
        await asyncio.wait(waits, timeout=body.wait_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if gone is not None and not gone.done():
            gone.cancel()
    left = gone is not None and gone.done() and not gone.cancelled() and gone.exception() is None
    if future.done():
        decision = future.result()
    elif await on_worker(state, state.cancel, rid):
        why = "the client went away while waiting" if left else f"waited {body.wait_s:g} s in the admission queue"
        return Decision("no-capacity", rid, (), (why,))
    else:
        decision = await future  # served between the timeout and the cancel: the answer is on its way
    if left and decision.status == "placed":
        await on_worker(state, state.release, rid)  # placed for a client that is gone: nobody holds it
        return Decision("no-capacity", rid, (), ("the client went away while waiting; what was placed is released",))
    return decision


async def sample_forever(state: ServiceState, history: SignalHistory) -> None:
    """Sample every ``history.step_s`` until cancelled; a failed sample is logged once and skipped."""
    failed = False
    while True:
        try:
            await on_worker(state, take_sample, state, history)
            failed = False
        except Exception as exc:
            if not failed:
                log.warning("signal history: a sample failed (%s); skipped until one works", exc, exc_info=exc)
            failed = True
        await asyncio.sleep(history.step_s)


def add_history_route(router: APIRouter, history: SignalHistory) -> None:
    """``GET /v1/signals/history`` on ``router`` (the app's own, as ``api.add_routes`` does)."""

    @router.get(
        V1 + "/signals/history",
        responses=answers(*AUTH, ok=SignalHistoryOut),
        summary="The nine placement-health signals over the last hour, one sample every 10 s (this replica's)",
    )
    async def get_signal_history() -> JSONResponse:
        now = time.time()
        samples = [{"t": s.t, "signals": s.signals} for s in history.samples(now)]
        body = {"now": now, "step_s": history.step_s, "window_s": history.window_s, "samples": samples}
        return JSONResponse(body)
