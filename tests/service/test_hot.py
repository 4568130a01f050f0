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
