"""What stands in front of every route: the connection guard, bearer-token auth and request-size limits.

``GuardedHttpProtocol`` is uvicorn's HTTP/1.1 protocol (httptools) with the limits uvicorn lacks, so that
slow or idle clients cannot hold the service (``guarded_protocol(limits)`` makes the class for one server):

* a client has ``header_timeout_s`` from connecting (or from the end of its previous response) to send a
  request line and headers, and ``body_timeout_s`` after that to send the body; then 408 and closed
  (closed without an answer when it sent nothing);
* request line plus headers over ``max_header_bytes``: 431 and closed;
* at most ``max_connections`` open: a new connection beyond it closes the one that has waited longest for
  its next request (half-sent or idle), so a flood of stalled connections cannot lock out a client that
  sends its request at once; when every connection is busy with a request, the new one is closed.

``BearerAuth`` and ``BodyLimit`` are plain ASGI middleware (no per-request task or body copy). Open without
a token: ``/healthz``, ``/readyz`` and the web page's static shell under ``/ui`` (``/`` redirects there;
HTML, JS and CSS only; the page reads every datum through the authenticated JSON API, with the token the
user gives it); with ``--open-extender`` also ``/v1/extender/`` (kube-scheduler sends no token).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import h11
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from toposched.errors import InputError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/", "/ui"})
OPEN_PREFIXES = ("/ui/", "/favicon.ico")

log = logging.getLogger("toposched.service")


async def _reply(
    scope: Scope, receive: Receive, send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    """A JSON answer from the middleware, framed by Starlette's ``JSONResponse`` (content type and length)."""
    await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


READ_METHODS = frozenset({"GET"})  # (no route answers HEAD: 405 whatever the token)
REPORTS_PATH = "/v1/reports"


class BearerAuth:
    """401 unless ``Authorization: Bearer TOKEN`` carries a token of the service (constant-time compares).

    ``token`` may do everything. ``report_token`` may only ``POST /v1/reports`` and ``read_token`` only
    ``GET`` (no read route books or releases GPUs); either, used outside its scope, gets 403.
    """

    def __init__(
        self,
        app: ASGIApp,
        token: str | None,
        open_prefixes: tuple[str, ...] = (),
        *,
        report_token: str | None = None,
        read_token: str | None = None,
    ) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
        self.report = f"Bearer {report_token}".encode() if report_token else None
        self.read = f"Bearer {read_token}".encode() if read_token else None
        self.open_prefixes = OPEN_PREFIXES + open_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.expected is None:
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in OPEN_PATHS or path.startswith(self.open_prefixes):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        # every compare runs, whichever token matches: the time taken does not tell which one a guess hit
        full = hmac.compare_digest(given, self.expected)
        report = hmac.compare_digest(given, self.report or self.expected)
        read = hmac.compare_digest(given, self.read or self.expected)
        if full:
            await self.app(scope, receive, send)
            return
        if report or read:
            method: str = scope["method"]
            if (report and method == "POST" and path == REPORTS_PATH) or (read and method in READ_METHODS):
                await self.app(scope, receive, send)
                return
            allowed = f"POST {REPORTS_PATH} (sidecar reports)" if report else "GET (it reads)"
            detail = f"this token may only {allowed}; {method} {path} needs the API token"
            await _reply(scope, receive, send, 403, {"error": "forbidden", "detail": detail})
            return
        await _reply(
            scope,
            receive,
            send,
            401,
            {"error": "unauthorized", "detail": "send the header Authorization: Bearer TOKEN"},
            {"www-authenticate": 'Bearer realm="toposched"'},
        )


class BodyTooLarge(InputError):
    """A request body over ``limit`` bytes, found while it streams in: the app answers 413 and closes.

    FastAPI turns any error raised while it reads a body into a 400 ``HTTPException`` raised *from* it;
    ``too_large`` finds this error behind one, so the app and the extender answer 413, not 422.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} bytes", fix="send a smaller body")
        self.limit = limit


def too_large(exc: BaseException) -> BodyTooLarge | None:
    """The ``BodyTooLarge`` that ``exc`` is, or that FastAPI's 400 ``HTTPException`` was raised from."""
    if isinstance(exc, BodyTooLarge):
        return exc
    if isinstance(exc, HTTPException) and isinstance(exc.__cause__, BodyTooLarge):
        return exc.__cause__
    return None


TOO_LARGE = "body too large"


class BodyLimit:
    """413 for bodies over the limit, whether announced by Content-Length or streamed (chunked).

    ``limits`` gives a larger limit to some path prefixes (the extender's node lists). Also reads every
    request body as JSON (``curl -d`` sends a form content type by default).
    """

    def __init__(self, app: ASGIApp, limit: int, limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.limits = limits or {}

    def limit_for(self, path: str) -> int:
        return next((n for prefix, n in self.limits.items() if path.startswith(prefix)), self.limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        headers: list[tuple[bytes, bytes]] = list(scope["headers"])
        if scope["method"] in ("POST", "PUT", "PATCH"):  # every body this API takes is JSON, whatever it says
            headers = [(k, v) for k, v in headers if k != b"content-type"] + [(b"content-type", b"application/json")]
            scope = {**scope, "headers": headers}
        length = next((v for k, v in headers if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > limit):
            body = {"error": TOO_LARGE, "detail": BodyTooLarge(limit).message}
            await _reply(scope, receive, send, 413, body, {"connection": "close"})
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited, send)


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may take (from ``ServiceConfig``; see the module docstring)."""

    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 32 * 1024


@dataclass
class ConnectionStats:
    """Connections the guard closed, by reason (one per server; for logs and tests)."""

    evicted: int = 0
    refused: int = 0
    header_timeouts: int = 0
    body_timeouts: int = 0
    headers_too_large: int = 0


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus header/body deadlines, a header size cap and a connection cap.

    A connection is *waiting* from ``connection_made``, and again once its response and its request body
    are both complete, until the next request's headers are in. Waiting connections sit in ``waiting`` in
    the order they began to wait: the oldest is the one a new connection over the cap closes.
    """

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    waiting: ClassVar[OrderedDict[GuardedHttpProtocol, None]] = OrderedDict()
    stats: ClassVar[ConnectionStats] = ConnectionStats()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes received since the connection began waiting
        self._in_body = False  # headers in, body not yet complete

    # -- the states --------------------------------------------------------------------------------------
    def _start_waiting(self) -> None:
        if self in self.waiting or self.transport.is_closing():
            return
        self.waiting[self] = None
        self._head_bytes = 0
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_slow)

    def _stop_waiting(self) -> None:
        self.waiting.pop(self, None)
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _idle(self) -> bool:
        """No request in progress: the last response and the last request body are both complete."""
        done = self.cycle is None or self.cycle.response_complete
        return done and not self._in_body and not self.pipeline

    # -- uvicorn's callbacks -----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._start_waiting()
        if len(self.connections) > self.limits.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        self._stop_body_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_body:
            self._head_bytes += len(data)
        super().data_received(data)
        if not self._in_body and self._head_bytes > self.limits.max_header_bytes:
            self.stats.headers_too_large += 1
            self._refuse(
                431, "headers too large", f"request line and headers over {self.limits.max_header_bytes} bytes"
            )

    def on_headers_complete(self) -> None:
        self._stop_waiting()
        self._in_body = True
        self._head_bytes = 0
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_too_slow)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_body = False
        self._stop_body_timer()
        if self._idle():
            self._start_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._idle():
            self._start_waiting()

    # -- the limits --------------------------------------------------------------------------------------
    def _make_room(self) -> None:
        if not self.stats.evicted and not self.stats.refused:
            log.warning("%d connections open: closing those waiting longest for a request", len(self.connections))
        oldest = next(iter(self.waiting), None)
        if oldest is None or oldest is self:  # every other connection is busy with a request
            self.stats.refused += 1
            self._close()
            return
        self.stats.evicted += 1
        oldest._close()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self not in self.waiting:
            return
        self.stats.header_timeouts += 1
        if self._head_bytes:
            self._refuse(408, "request timeout", f"headers not complete within {self.limits.header_timeout_s:g} s")
        else:
            self._close()  # sent nothing (or idle after a response): nobody to answer

    def _body_too_slow(self) -> None:
        self._body_timer = None
        if not self._in_body:
            return
        self.stats.body_timeouts += 1
        if self.cycle is not None and self.cycle.response_started:
            self._close()
        else:
            self._refuse(408, "request timeout", f"body not complete within {self.limits.body_timeout_s:g} s")

    def _refuse(self, status: int, error: str, detail: str) -> None:
        """Answer ``status`` outside the app and close (the app sees a disconnect if it was reading)."""
        answering = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if not self.transport.is_closing() and not answering:  # never inside another response
            self.transport.write(refusal_bytes(status, {"error": error, "detail": detail}))
        self._close()

    def _close(self) -> None:
        self._stop_waiting()
        self._stop_body_timer()
        self.transport.close()


def refusal_bytes(status: int, body: dict[str, str]) -> bytes:
    """A whole ``status`` response with a JSON ``body`` and ``connection: close``, framed by h11 (the HTTP/1.1
    library uvicorn itself depends on), not by hand. h11 answers only a request it has read, and a refusal
    comes before one was whole (headers too slow or too large), so it reads a minimal request that h11's
    client side writes."""
    data = json.dumps(body).encode()
    client = h11.Connection(our_role=h11.CLIENT)
    request = client.send(h11.Request(method="GET", target="/", headers=[("host", "toposched")])) or b""
    conn = h11.Connection(our_role=h11.SERVER)
    conn.receive_data(request + (client.send(h11.EndOfMessage()) or b""))
    conn.next_event()
    headers = [("content-type", "application/json"), ("content-length", str(len(data))), ("connection", "close")]
    out = conn.send(h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase.encode()))
    return (out or b"") + (conn.send(h11.Data(data=data)) or b"") + (conn.send(h11.EndOfMessage()) or b"")


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpProtocol]:
    """A protocol class for ``uvicorn.run(..., http=...)`` with ``limits`` and its own waiting list."""
    return type(
        "GuardedHttpProtocol",
        (GuardedHttpProtocol,),
        {"limits": limits, "waiting": OrderedDict(), "stats": ConnectionStats()},
    )
