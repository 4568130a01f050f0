"""The app factory: ``create_app(config)`` wires state, API, extender, metrics and the web page.

Importing this module does no I/O, and neither does ``create_app``: the state is opened in the app's
lifespan (or before, by ``toposched serve``, which passes the opened state in so that a bad topology or an
unreachable etcd is a one-line error instead of a server that never becomes ready).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from toposched import __version__
from toposched.errors import InputError, StateError, ToposchedError
from toposched.service.api import build_router, on_worker
from toposched.service.config import ServiceConfig
from toposched.service.extender import build_extender
from toposched.service.guards import BearerAuth, BodyLimit, BodyTooLarge
from toposched.service.metrics import build_registry
from toposched.service.state import ServiceState

log = logging.getLogger("toposched.service")


def web_dir() -> str:
    return str(resources.files("toposched") / "data" / "web")


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(part) for part in loc)


def create_app(config: ServiceConfig, state: ServiceState | None = None) -> FastAPI:
    """The ASGI app of one replica; ``state`` may be opened already (``ServiceState.open``)."""
    state = state or ServiceState(config)
    registry, latency = build_registry(state)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if not state.ready:
            await on_worker(state, state.open)
        ticker = asyncio.create_task(_tick_forever(state))
        try:
            yield
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            await on_worker(state, state.close)
            state.worker.shutdown(wait=False)

    app = FastAPI(
        title="toposched",
        version=__version__,
        summary="Topology-aware placement of LLM inference instances (seed 000), one replica's API.",
        lifespan=lifespan,
        docs_url=None,  # Swagger UI loads from a CDN; the spec is at /openapi.json
        redoc_url=None,
    )
    app.state.toposched = state
    app.include_router(build_router(state, latency))
    app.include_router(build_extender(state))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = [{"field": _field(e["loc"]), "message": e["msg"]} for e in exc.errors()]
        return JSONResponse({"error": "invalid request", "fields": fields}, status_code=422)

    @app.exception_handler(InputError)
    async def _input(_request: Request, exc: InputError) -> JSONResponse:
        return JSONResponse({"error": "invalid request", "detail": exc.message, "fix": exc.fix}, status_code=422)

    @app.exception_handler(StateError)
    async def _state(_request: Request, exc: StateError) -> JSONResponse:
        return JSONResponse({"error": "state unavailable", "detail": exc.message}, status_code=503)

    @app.exception_handler(ToposchedError)
    async def _other(_request: Request, exc: ToposchedError) -> JSONResponse:
        return JSONResponse({"error": "failed", "detail": exc.message}, status_code=422)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_request: Request, _exc: BodyTooLarge) -> JSONResponse:
        return JSONResponse({"error": "body too large", "detail": f"at most {config.max_body_bytes} bytes"}, 413)

    @app.get("/healthz", include_in_schema=True, summary="The process answers")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {}}, summary="State loaded and the last background sync worked")
    def readyz() -> JSONResponse:
        if state.ready and state.last_error is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "detail": state.last_error or "loading"}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def metrics() -> PlainTextResponse:
        text = await on_worker(state, generate_latest, registry)
        return PlainTextResponse(text.decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    app.mount("/ui", StaticFiles(directory=web_dir(), html=True), name="ui")
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    extender = ("/v1/extender/",) if config.open_extender else ()
    app.add_middleware(BearerAuth, token=config.token if config.auth else None, open_prefixes=extender)
    return app


async def _tick_forever(state: ServiceState) -> None:
    while True:
        await asyncio.sleep(state.config.follow_interval_s)
        try:
            await on_worker(state, state.tick)
            state.last_error = None
        except ToposchedError as exc:
            state.last_error = exc.message
            log.warning("background sync failed: %s", exc.message)
