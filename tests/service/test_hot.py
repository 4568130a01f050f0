"""``hot.HotRoutes``: the create and delete requests it answers in front of FastAPI get the routes' answers.

In process (``TestClient`` on two apps over the same kind of state, one with the hot routes and one
without them): the same requests in the same order must get the same status, headers and body bytes, and
the plainly right requests must be the ones answered in front (the others reach the app).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from toposched.errors import StateError
from toposched.service.app import ServiceApp, create_app
from toposched.service.config import ServiceConfig
from toposched.service.guards import Receive, Scope, Send
from toposched.topology.sources import SourceRef

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WRONG = {"Authorization": "Bearer wrong-token-0123456789"}
HEADERS = ("content-type", "content-length", "retry-after", "www-authenticate", "connection")


@dataclass
class Side:
    """One app under test and the requests that reached its full FastAPI stack (by method and path)."""

    client: TestClient
    app: ServiceApp
    reached: list[str] = field(default_factory=list)


def side(*, hot: bool) -> Side:
    config = ServiceConfig(state="memory", source=SourceRef(kind="preset", ref="hgx-h100"), token=TOKEN)
    app = create_app(config)
    assert isinstance(app, ServiceApp) and app.hot is not None
    client = TestClient(app, raise_server_exceptions=False)
    out = Side(client, app)
    full = app.hot.app

    async def counted(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            out.reached.append(f"{scope['method']} {scope['path']}")
        await full(scope, receive, send)

    app.hot.app = counted
    if not hot:
        app.hot = None
    return out


@pytest.fixture
def sides() -> Iterator[tuple[Side, Side]]:
    hot, full = side(hot=True), side(hot=False)
    with hot.client, full.client:
        yield hot, full


def answer(s: Side, method: str, path: str, **kwargs: Any) -> tuple[int, dict[str, str], bytes]:
    if "chunks" in kwargs:  # a body without Content-Length (Transfer-Encoding: chunked)
        kwargs = {k: v for k, v in kwargs.items() if k != "chunks"} | {"content": iter(kwargs["chunks"])}
    response = s.client.request(method, path, **kwargs)
    headers = {name: response.headers[name] for name in HEADERS if name in response.headers}
    return response.status_code, headers, response.content


# lone surrogates (valid JSON escapes, not text): refused by the label and id rules, never a 500
SURROGATES = [
    b'{"model": "llama-3.1-8b", "node_selector": {"\\ud800": "x"}}',
    b'{"model": "llama-3.1-8b", "near": "\\ud800"}',
    b'{"model": "llama-3.1-8b", "racks": ["r\\udfff"]}',
]

# (method, path, request arguments, answered in front of FastAPI)
REQUESTS: list[tuple[str, str, dict[str, Any], bool]] = [
    ("POST", "/v1/placements", {"json": {"model": "llama-3.1-8b", "id": "a"}, "headers": AUTH}, True),
    ("POST", "/v1/placements", {"json": {"model": "llama-3.1-8b", "id": "a"}, "headers": AUTH}, True),
    ("POST", "/v1/placements", {"json": {"model": "llama-3.1-8b", "id": "a", "replicas": 2}, "headers": AUTH}, True),
    ("POST", "/v1/placements", {"json": {"model": "meta-llama/Llama-3.1-8B", "id": "b"}, "headers": AUTH}, True),
    ("POST", "/v1/placements", {"json": {"model": "llama-3.1-405b", "id": "c"}, "headers": AUTH}, True),
    ("POST", "/v1/placements", {"json": {"model": "llama-3.1-8b", "replicas": 9999}, "headers": AUTH}, True),
    ("POST", "/v1/placements", {"json": {"model": "llama-3.1-8b", "wait_s": 100}, "headers": AUTH}, True),
    ("POST", "/v1/placements", {"json": {"model": "llama-3.1-8b", "id": "d"}, "headers": WRONG}, False),
    ("POST", "/v1/placements", {"json": {"model": "llama-3.1-8b", "id": "d"}}, False),
    ("POST", "/v1/placements", {"json": {"model": "llama-3.1-8b", "replicas": 0}, "headers": AUTH}, False),
    ("POST", "/v1/placements", {"json": {"model": "llama-3.1-8b", "colour": "red"}, "headers": AUTH}, False),
    ("POST", "/v1/placements", {"json": [1, 2], "headers": AUTH}, False),
    ("POST", "/v1/placements", {"content": b"model=llama", "headers": AUTH}, False),
    ("POST", "/v1/placements", {"content": b'{"model": "llama-3.1-8b", "replicas": NaN}', "headers": AUTH}, False),
    ("POST", "/v1/placements", {"content": b"", "headers": AUTH}, False),
    ("POST", "/v1/placements", {"content": b" " * (64 * 1024 + 1), "headers": AUTH}, False),
    ("POST", "/v1/placements", {"chunks": [b'{"model": "llama-3.1-8b",', b' "id": "e"}'], "headers": AUTH}, False),
    ("POST", "/v1/placements/", {"json": {"model": "llama-3.1-8b", "id": "f"}, "headers": AUTH}, False),
    ("GET", "/v1/placements/a", {"headers": AUTH}, False),
    ("DELETE", "/v1/placements/a", {"headers": AUTH}, True),
    ("DELETE", "/v1/placements/a", {"headers": AUTH}, True),
    ("DELETE", "/v1/placements/b", {"headers": WRONG}, False),
    ("DELETE", "/v1/placements/.b", {"headers": AUTH}, False),
    ("DELETE", "/v1/placements/b/renew", {"headers": AUTH}, False),
    ("DELETE", "/v1/placements/b", {"headers": AUTH}, True),
    *(("POST", "/v1/placements", {"content": body, "headers": AUTH}, False) for body in SURROGATES),
]


def test_the_same_answers_with_and_without_the_hot_routes(sides: tuple[Side, Side]) -> None:
    hot, full = sides
    for method, path, kwargs, in_front in REQUESTS:
        before = len(hot.reached)
        got, expected = answer(hot, method, path, **kwargs), answer(full, method, path, **kwargs)
        assert got == expected, (method, path, kwargs.get("json"))
        assert (len(hot.reached) == before) is in_front, (method, path, kwargs.get("json"))


def test_a_state_error_gets_the_app_handler(sides: tuple[Side, Side], monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise StateError("the ledger file x is locked by another process")

    for s in sides:
        monkeypatch.setattr(s.app.state.toposched, "place", fail)
        monkeypatch.setattr(s.app.state.toposched, "release", fail)
    hot, full = sides
    for method, path, kwargs in (
        ("POST", "/v1/placements", {"json": {"model": "llama-3.1-8b", "id": "a"}}),
        ("DELETE", "/v1/placements/a", {}),
    ):
        got = answer(hot, method, path, headers=AUTH, **kwargs)
        assert got == answer(full, method, path, headers=AUTH, **kwargs)
        assert got[0] == 503 and b"state unavailable" in got[2]
    assert hot.reached == []


def test_a_bug_answers_500_and_is_raised_for_the_server_to_log(
    sides: tuple[Side, Side], monkeypatch: pytest.MonkeyPatch
) -> None:
    def bug(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    for s in sides:
        monkeypatch.setattr(s.app.state.toposched, "release", bug)
    hot, full = sides
    got = answer(hot, "DELETE", "/v1/placements/a", headers=AUTH)
    assert got == answer(full, "DELETE", "/v1/placements/a", headers=AUTH)
    assert got[0] == 500 and b"internal error" in got[2]
    with pytest.raises(RuntimeError, match="a bug"):  # what uvicorn gets, and logs with its traceback
        TestClient(hot.app).delete("/v1/placements/a", headers=AUTH)


def test_a_middleware_added_after_create_app_sees_the_hot_routes_requests_too() -> None:
    """An audit log or another check a deployer wraps the app in must see the two requests that change
    state: the hot routes step aside once the app has a middleware it did not have (or an override)."""
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.responses import PlainTextResponse

    app = side(hot=True).app

    async def deny(request: Any, call_next: Any) -> Any:
        return PlainTextResponse("denied by the deployer's middleware", status_code=403)

    app.add_middleware(BaseHTTPMiddleware, dispatch=deny)
    with TestClient(app) as client:
        made = client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": "a"}, headers=AUTH)
        gone = client.delete("/v1/placements/a", headers=AUTH)
    assert (made.status_code, gone.status_code) == (403, 403)


def test_a_body_longer_than_announced_is_not_read_past_the_limit() -> None:
    """A server that passes on more body than its Content-Length said: the hot routes stop reading at the
    first chunk over the limit and hand the request to the app (whose limit answers 413)."""
    import asyncio

    app = side(hot=True).app
    limit = app.state.toposched.config.max_body_bytes
    chunks = [b"x" * 10_000] * (limit // 10_000 + 10)
    read: list[int] = []
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        read.append(1)
        n = len(read)
        return {"type": "http.request", "body": chunks[n - 1], "more_body": n < len(chunks)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/placements", "raw_path": b"/v1/placements", "query_string": b"", "root_path": "",
        "headers": [(b"content-length", b"40"), (b"authorization", AUTH["Authorization"].encode())],
        "client": ("127.0.0.1", 1), "server": ("test", 80),
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413
    assert len(read) < len(chunks) - 5  # not every chunk: the limit stopped the reading


def test_lone_surrogates_are_refused_with_the_field_named(sides: tuple[Side, Side]) -> None:
    hot, _ = sides
    for body, name in zip(SURROGATES, ("body.node_selector", "body.near", "body.racks.0"), strict=True):
        status, _, text = answer(hot, "POST", "/v1/placements", content=body, headers=AUTH)
        assert status == 422 and f'"field":"{name}'.encode() in text, text
