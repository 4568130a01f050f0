"""Issue 18: every error answer has the documented shape ``{"error", "detail"?, "fix"?, "fields"?}``.

In process (``TestClient`` on ``create_app`` with the in-memory state): a table of bad bodies for every route
that takes one, and the answers Starlette and FastAPI would give on their own (no route, wrong method, a body
that is not JSON, too large, a bug), none of which may come back as FastAPI's ``{"detail": ...}``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from toposched.service.app import create_app
from toposched.service.config import ServiceConfig
from toposched.topology.sources import SourceRef

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SHAPE = {"error", "detail", "fix", "fields"}
BODY_ROUTES = ("/v1/placements", "/v1/placements/a/renew", "/v1/reports", "/v1/defrag", "/v1/defrag/finish")
OK = '{"model": "llama-3.1-8b"'  # the start of a good placement body

# (what, body, status, the field named)
BAD_BODIES: list[tuple[str, bytes, int, str]] = [
    ("empty", b"", 422, "body"),
    ("not JSON", b"model=llama", 422, "body"),
    ("truncated", OK.encode(), 422, "body"),
    ("not UTF-8", b"\xff\xfe\xfd", 422, "body"),
    ("binary", bytes(range(256)), 422, "body"),
    ("null", b"null", 422, "body"),
    ("a list", b"[1, 2]", 422, "body"),
    ("a number", b"42", 422, "body"),
    ("a string", b'"llama-3.1-8b"', 422, "body"),
    ("NaN", b'{"model": "llama-3.1-8b", "replicas": NaN}', 422, "body.replicas"),
    ("replicas a string", b'{"model": "llama-3.1-8b", "replicas": "two"}', 422, "body.replicas"),
    ("replicas huge", b'{"model": "llama-3.1-8b", "replicas": 1e400}', 422, "body.replicas"),
    ("replicas 0", b'{"model": "llama-3.1-8b", "replicas": 0}', 422, "body.replicas"),
    ("model a number", b'{"model": 5}', 422, "body.model"),
    ("model unknown", b'{"model": "llama-9"}', 422, "body.model"),
    ("model a path", b'{"model": "/etc/passwd"}', 422, "body.model"),
    ("selector a list", b'{"model": "llama-3.1-8b", "node_selector": []}', 422, "body.node_selector"),
    ("unknown field", b'{"model": "llama-3.1-8b", "colour": "red"}', 422, "body.colour"),
    ("wait_s negative", b'{"model": "llama-3.1-8b", "wait_s": -1}', 422, "body.wait_s"),
    ("id not an id", b'{"model": "llama-3.1-8b", "id": "../x"}', 422, "body.id"),
    ("nested JSON bomb", b"[" * 10_000 + b"]" * 10_000, 422, "body"),
]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    config = ServiceConfig(state="memory", source=SourceRef(kind="preset", ref="hgx-h100"), token=TOKEN)
    with TestClient(create_app(config), headers=AUTH, raise_server_exceptions=False) as c:
        yield c


def assert_error_shape(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"], body
    assert set(body) <= SHAPE, body
    assert body.get("detail") is None or isinstance(body["detail"], str), body  # never FastAPI's list
    return body


@pytest.mark.parametrize(("what", "content", "status", "field"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_a_bad_placement_body_answers_in_the_error_shape_naming_the_field(
    client: TestClient, what: str, content: bytes, status: int, field: str
) -> None:
    body = assert_error_shape(client.post("/v1/placements", content=content), status)
    assert body["error"] == "invalid request"
    fields = body["fields"]
    assert isinstance(fields, list) and fields, body
    assert field in [f["field"] for f in fields], (what, fields)
    assert all(isinstance(f["message"], str) and f["message"] for f in fields)


@pytest.mark.parametrize("path", BODY_ROUTES)
@pytest.mark.parametrize("content", [b"", b"{", b"\xff", b"[]", b'{"ttl_s": "x", "need_gpus": "x"}'])
def test_every_route_with_a_body_answers_garbage_in_the_error_shape(
    client: TestClient, path: str, content: bytes
) -> None:
    body = assert_error_shape(client.post(path, content=content), 422)
    assert body["error"] == "invalid request" and body["fields"]


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_a_body_too_large_is_413_in_the_error_shape_announced_or_streamed(client: TestClient, path: str) -> None:
    big = b'{"model": "' + b"x" * 70_000 + b'"}'
    announced = client.post(path, content=big)
    assert assert_error_shape(announced, 413) == {"error": "body too large", "detail": "at most 65536 bytes"}

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is found while the body streams in
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    streamed = client.post(path, content=chunks())
    assert assert_error_shape(streamed, 413)["error"] == "body too large"
    assert streamed.headers["connection"] == "close"


@pytest.mark.parametrize(
    ("method", "path", "status", "error"),
    [
        ("GET", "/v1/nothing-here", 404, "not found"),
        ("GET", "/ui/nothing.js", 404, "not found"),
        ("GET", "/v1/placements/unknown-id", 404, "not found"),
        ("DELETE", "/v1/placements/unknown-id", 404, "not found"),
        ("PUT", "/v1/queue", 405, "method not allowed"),
        ("PATCH", "/v1/placements", 405, "method not allowed"),
        ("POST", "/healthz", 405, "method not allowed"),
        ("GET", "/v1/placements/" + "a" * 300, 422, "invalid request"),
    ],
)
def test_no_route_wrong_method_and_bad_ids_answer_in_the_error_shape(
    client: TestClient, method: str, path: str, status: int, error: str
) -> None:
    body = assert_error_shape(client.request(method, path), status)
    assert body["error"] == error
    if status != 422:
        assert isinstance(body["detail"], str) and path.split("/")[-1] in body["detail"]


def test_no_token_is_401_in_the_error_shape(client: TestClient) -> None:
    response = client.get("/v1/placements", headers={"Authorization": "Bearer wrong"})
    assert assert_error_shape(response, 401)["error"] == "unauthorized"


def test_a_bug_is_a_500_in_the_error_shape(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    state = client.app.state.toposched  # type: ignore[attr-defined]  # (the app is typed as an ASGI callable)

    def broken() -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(state, "queue_view", broken)
    body = assert_error_shape(client.get("/v1/queue"), 500)
    assert body["error"] == "internal error" and "a bug" not in str(body)  # internals stay in the log
