"""The app factory: ``create_app(config)`` wires state, API, extender, metrics and the web page.

Importing this module does no I/O, and neither does ``create_app``: the state is opened in the app's
lifespan (or before, by ``toposched serve``, which passes the opened state in so that a bad topology or an
unreachable etcd is a one-line error instead of a server that never becomes ready).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.routing import Match

from toposched import __version__
from toposched.errors import InputError, StateError, ToposchedError
from toposched.service.api import ERRORS, add_history_route, add_routes, on_worker, sample_forever
from toposched.service.config import ServiceConfig
from toposched.service.extender import EXTENDER_PREFIX, build_extender, drop_validation_answer
from toposched.service.guards import TOO_LARGE, BearerAuth, BodyLimit, BodyTooLarge, too_large
from toposched.service.history import SignalHistory
from toposched.service.metrics import build_registry
from toposched.service.schemas import ErrorOut, HealthOut, ReadyOut
from toposched.service.state import ServiceState


def web_dir() -> str:
    return str(resources.files("toposched") / "data" / "web")


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(part) for part in loc)


def invalid(exc: RequestValidationError) -> dict[str, Any]:
    """The 422 body for a request that failed validation: every bad field, named."""
    fields = []
    for e in exc.errors():
        if e["type"] == "json_invalid":  # loc is ("body", character offset)
            fields.append({"field": "body", "message": f"not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}"})
        else:
            fields.append({"field": _field(e["loc"]), "message": e["msg"]})
    return {"error": "invalid request", "fields": fields}


def error_response(status: int, error: str, detail: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An answer in the one error shape (``ErrorOut``): ``{"error", "detail"}``."""
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


def too_large_response(exc: BodyTooLarge) -> JSONResponse:
    return error_response(413, TOO_LARGE, exc.message, {"Connection": "close"})


def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (no route, wrong method, a body that is not JSON, too large) as ErrorOut."""
    if exc.status_code == 400:  # FastAPI: the body could not be read (not UTF-8, or over the limit while streaming)
        large = too_large(exc)
        if large is not None:
            return too_large_response(large)
        fields = [{"field": "body", "message": "not a JSON document in UTF-8"}]
        return JSONResponse({"error": "invalid request", "fields": fields}, status_code=422)
    if exc.status_code == 404:
        return error_response(404, "not found", f"nothing at {request.url.path}", exc.headers)
    if exc.status_code == 405:
        # Starlette's Allow names the methods of the first route whose path matched; a path served by
        # several routes (GET and POST /v1/placements) has all of theirs (issue 37)
        allowed = _allowed_methods(request)
        headers = {**(exc.headers or {}), "Allow": ", ".join(allowed)} if allowed else exc.headers
        methods = f"; it takes {', '.join(allowed)}" if allowed else ""
        detail = f"{request.method} is not a method of {request.url.path}{methods} (the API is listed at /openapi.json)"
        return error_response(405, "method not allowed", detail, headers)
    return error_response(exc.status_code, "failed", str(exc.detail), exc.headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method the app's routes serve at the request's path (HEAD beside GET, as Starlette adds it)."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE and getattr(route, "methods", None):
            methods.update(route.methods)
    return sorted(methods)


def create_app(config: ServiceConfig, state: ServiceState | None = None) -> FastAPI:
    """The ASGI app of one replica; ``state`` may be opened already (``ServiceState.open``)."""
    state = state or ServiceState(config)
    registry, latency = build_registry(state)
    history = SignalHistory()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if not state.ready:
            await on_worker(state, state.open)
        ticker = asyncio.create_task(_tick_forever(state))
        sampler = asyncio.create_task(sample_forever(state, history))
        try:
            yield
        finally:
            for task in (ticker, sampler):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await on_worker(state, state.close)
            state.worker.shutdown(wait=False)

    app = FastAPI(
        title="toposched",
        version=__version__,
        summary="Topology-aware placement of LLM inference instances on GPU clusters, one replica's API.",
        lifespan=lifespan,
        docs_url=None,  # Swagger UI loads from a CDN; the spec is at /openapi.json
        redoc_url=None,
        # The service exports Prometheus metrics (/metrics); FastAPI's native OpenTelemetry would look up
        # three global providers (and os.environ) on every request to find that none is configured.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.toposched = state
    add_routes(app.router, state, latency)
    add_history_route(app.router, history)
    app.include_router(build_extender(state))
    generate_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = drop_validation_answer(generate_openapi())
            # the queue wait this replica allows (its --max-wait, not the largest any replica could): issue 37
            body = spec.get("components", {}).get("schemas", {}).get("PlaceBody", {})
            if "wait_s" in body.get("properties", {}):
                body["properties"]["wait_s"]["maximum"] = config.max_wait_s
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(invalid(exc), status_code=422)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return http_error(request, exc)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_request: Request, exc: BodyTooLarge) -> JSONResponse:
        return too_large_response(exc)

    @app.exception_handler(InputError)
    async def _input(_request: Request, exc: InputError) -> JSONResponse:
        return JSONResponse({"error": "invalid request", "detail": exc.message, "fix": exc.fix}, status_code=422)

    @app.exception_handler(StateError)
    async def _state(_request: Request, exc: StateError) -> JSONResponse:
        return JSONResponse({"error": "state unavailable", "detail": exc.message}, status_code=503)

    @app.exception_handler(ToposchedError)
    async def _other(_request: Request, exc: ToposchedError) -> JSONResponse:
        return JSONResponse({"error": "failed", "detail": exc.message}, status_code=422)

    @app.exception_handler(Exception)
    async def _bug(_request: Request, _exc: Exception) -> JSONResponse:
        # Starlette still logs the traceback (and re-raises for the server); the client gets the error shape
        return error_response(500, "internal error", "an unexpected error; the service log has the traceback")

    @app.get("/healthz", responses={200: {"model": HealthOut}}, summary="The process answers")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get(
        "/readyz",
        responses={200: {"model": ReadyOut}, 503: {"model": ReadyOut, "description": "not ready, and why"}},
        summary="State loaded and the last background sync worked",
    )
    async def readyz() -> JSONResponse:
        # not ready while loading, while background syncs fail (a damaged file: the periodic check reads every
        # row), and while writes fail (a full disk, a read-only file): issue 37
        problem = state.last_error or (state.write_problem() if state.ready else "loading")
        if problem is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "detail": problem}, status_code=503)

    @app.get(
        "/metrics",
        response_class=Response,  # no default media type: the 401 is JSON, the metrics are text
        responses={
            200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            401: {"model": ErrorOut, **ERRORS[401], "content": {"application/json": {}}},
        },
        summary="Prometheus metrics",
    )
    async def metrics() -> PlainTextResponse:
        text = await on_worker(state, generate_latest, registry)
        return PlainTextResponse(text.decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    app.mount("/ui", StaticFiles(directory=web_dir(), html=True), name="ui")
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, limits={EXTENDER_PREFIX: config.max_extender_body_bytes})
    extender = (EXTENDER_PREFIX,) if config.open_extender else ()
    token = config.token if config.auth else None
    app.add_middleware(
        BearerAuth,
        token=token,
        open_prefixes=extender,
        report_token=config.report_token,  # (no API token, as with auth off: every request passes)
        read_token=config.read_token,
    )
    return app


async def _tick_forever(state: ServiceState) -> None:
    """Background sync until cancelled: ``ServiceState.sync`` never raises; it counts and logs its failures,
    keeps the reason for /readyz and backs off (``sync_delay``) while they last."""
    while True:
        await asyncio.sleep(state.sync_delay())
        await on_worker(state, state.sync)
