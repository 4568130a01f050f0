"""ASGI middleware in front of every route: bearer-token auth and a request-size limit.

Both are plain ASGI (no per-request task or body copy), so they cost next to nothing on the hot path.
Open without a token: ``/healthz``, ``/readyz`` and the web page's static shell under ``/ui`` (``/``
redirects there; HTML, JS and CSS only; the page reads every datum through the authenticated JSON API, with
the token the user gives it); with ``--open-extender`` also ``/v1/extender/`` (kube-scheduler sends no token).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/", "/ui"})
OPEN_PREFIXES = ("/ui/", "/favicon.ico")


async def _reply(send: Send, status: int, body: dict[str, Any], headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": data})


class BearerAuth:
    """401 unless ``Authorization: Bearer TOKEN`` matches (constant-time compare)."""

    def __init__(self, app: ASGIApp, token: str | None, open_prefixes: tuple[str, ...] = ()) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
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
        if not hmac.compare_digest(given, self.expected):
            await _reply(
                send,
                401,
                {"error": "unauthorized", "detail": "send the header Authorization: Bearer TOKEN"},
                ((b"www-authenticate", b'Bearer realm="toposched"'),),
            )
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for bodies over ``limit`` bytes, whether announced by Content-Length or streamed.

    Also reads every request body as JSON (``curl -d`` sends a form content type by default).
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope["headers"])
        if scope["method"] in ("POST", "PUT", "PATCH"):  # every body this API takes is JSON, whatever it says
            headers = [(k, v) for k, v in headers if k != b"content-type"] + [(b"content-type", b"application/json")]
            scope = {**scope, "headers": headers}
        length = next((v for k, v in headers if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await _reply(send, 413, {"error": "body too large", "detail": f"at most {self.limit} bytes"})
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)  # BodyTooLarge becomes a 413 in the app's exception handler


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"body over {limit} bytes")
