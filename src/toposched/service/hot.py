"""The two requests clients send most, answered in front of FastAPI: ``POST /v1/placements`` and
``DELETE /v1/placements/{id}``.

Through FastAPI a request passes seven middleware layers, two route matches and the dependency solver
before the endpoint runs (``docs/service.md``, "Load test", has what skipping them saves).
``HotRoutes`` sits in front of the app (``app.ServiceApp``) and answers these two requests
itself when they are plainly right, with the same code the routes run (``api.place_answer``,
``api.release_answer``), so the answers are the routes' answers, byte for byte. Anything else goes on to
the app unchanged, which answers it, errors included, in the one error shape (and every request does
when a middleware was added to the app after ``create_app`` or a dependency is overridden:
``app.ServiceApp``):

* another method or path, a ``root_path``, a WebSocket or lifespan message;
* a missing or wrong bearer token (the app answers 401), when the service has one;
* a body without ``Content-Length``, or over ``max_body_bytes`` (413; reading stops at the first byte
  over it, even when a server passes on more than was announced), or that is not a JSON object that
  ``PlaceBody`` accepts (422, every bad field named); a placement id that does not match ``ID_PATTERN``.

A body read here and then passed on is handed to the app as it came (``_Replay``). An exception the
answer raises gets the app's own exception handler (``InputError`` 422, ``StateError`` 503 ...); one
without a handler gets the 500 answer and is raised again for uvicorn to log, as Starlette does.
"""

from __future__ import annotations

import hmac
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi.responses import JSONResponse
from prometheus_client import Histogram
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from toposched.names import ID_PATTERN
from toposched.service.api import place_answer, release_answer
from toposched.service.guards import ASGIApp, Message, Receive, Scope, Send
from toposched.service.schemas import PlaceBody
from toposched.service.state import ServiceState

PLACEMENTS = "/v1/placements"
_ONE = PLACEMENTS + "/"
_ID = re.compile(ID_PATTERN.removeprefix("^").removesuffix("$"))  # fullmatch: no "$" before a final newline

Handler = Callable[[Request, Any], Response | Awaitable[Response]]


class _Replay:
    """``receive`` for the app after this module read some messages: those first, then the client's."""

    def __init__(self, messages: list[Message], receive: Receive) -> None:
        self.messages = messages
        self.receive = receive

    async def __call__(self) -> Message:
        if self.messages:
            return self.messages.pop(0)
        return await self.receive()


class HotRoutes:
    """Answers the plainly right create and delete requests; passes everything else to ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        state: ServiceState,
        latency: Histogram,
        *,
        token: str | None,
        max_body_bytes: int,
        handlers: Mapping[Any, Handler],
    ) -> None:
        self.app = app
        self.state = state
        self.latency = latency
        self.expected = f"Bearer {token}".encode() if token else None
        self.max_body_bytes = max_body_bytes
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            path: str = scope["path"]
            method: str = scope["method"]
            if method == "POST" and path == PLACEMENTS:
                await self._create(scope, receive, send)
                return
            if method == "DELETE" and path.startswith(_ONE) and _ID.fullmatch(path[len(_ONE) :]):
                await self._delete(scope, receive, send, path[len(_ONE) :])
                return
        await self.app(scope, receive, send)

    def _admits(self, scope: Scope, *, body: bool) -> bool:
        """The token is right (when the service has one) and the announced length is within the limit;
        ``body``: a length must be announced (a chunked body goes to the app)."""
        given = length = None
        for key, value in scope["headers"]:
            if key == b"authorization" and given is None:
                given = value
            elif key == b"content-length" and length is None:
                length = value
        if self.expected is not None and not hmac.compare_digest(given or b"", self.expected):
            return False
        if length is None:
            return not body
        return length.isdigit() and int(length) <= self.max_body_bytes

    async def _create(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._admits(scope, body=True):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        chunks: list[bytes] = []
        size = 0
        complete = False
        while not complete:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client went away: the app sees it as it would have
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            complete = not message.get("more_body", False)
            if size > self.max_body_bytes:
                break  # more than announced: the app's limit answers (413) without reading the rest here
        raw = b"".join(chunks)
        body = _place_body(raw) if complete and size <= self.max_body_bytes else None
        if body is None:
            await self.app(scope, _Replay(messages, receive), send)
            return
        await self._answer(scope, receive, send, lambda: place_answer(self.state, self.latency, body, receive))

    async def _delete(self, scope: Scope, receive: Receive, send: Send, pid: str) -> None:
        if not self._admits(scope, body=False):
            await self.app(scope, receive, send)
            return
        await self._answer(scope, receive, send, lambda: release_answer(self.state, pid))

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, answer: Callable[[], Awaitable[JSONResponse]]
    ) -> None:
        try:
            response: Response = await answer()
        except Exception as exc:
            handler = next((self.handlers[t] for t in type(exc).__mro__ if t in self.handlers), None)
            if handler is None:
                raise
            answered = handler(Request(scope), exc)
            response = await answered if inspect.isawaitable(answered) else answered
            if handler is self.handlers.get(Exception):
                await response(scope, receive, send)
                raise  # uvicorn logs the traceback, as after Starlette's ServerErrorMiddleware
        await response(scope, receive, send)


def _place_body(raw: bytes) -> PlaceBody | None:
    """The body as FastAPI reads it for the route (``json.loads``, then ``PlaceBody``); None when it would
    not accept it (the app then answers with its own error)."""
    if not raw:
        return None
    try:
        return PlaceBody.model_validate(json.loads(raw))
    except (ValueError, RecursionError, ValidationError):
        return None
