"""Scoped tokens: a report token that may only ``POST /v1/reports`` (sidecars) and a read token that may only
``GET`` (Prometheus, dashboards), next to the API token that may do everything.

In process (``TestClient`` on ``create_app`` with the in-memory state): a scoped token on ``POST
/v1/placements`` is refused by the one request path (``BearerAuth``), before any route runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr, ValidationError

from tests.conftest import RunCli
from toposched.cli._common import read_token
from toposched.service.app import create_app
from toposched.service.config import ServiceConfig
from toposched.sidecar.loop import webhook_token
from toposched.topology.sources import SourceRef

API = "api-token-0123456789abcdef"
REPORT = "report-token-0123456789abcdef"
READ = "read-token-0123456789abcdef"
PLACE = {"model": "llama-3.1-8b", "id": "scoped-1"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def client() -> Iterator[TestClient]:
    config = ServiceConfig(
        state="memory",
        source=SourceRef(kind="preset", ref="hgx-h100"),
        token=API,
        report_token=REPORT,
        read_token=READ,
    )
    with TestClient(create_app(config), raise_server_exceptions=False) as c:
        yield c


def placements(client: TestClient) -> list[str]:
    answer = client.get("/v1/placements", headers=bearer(API))
    assert answer.status_code == 200
    return [p["id"] for p in answer.json()["placements"]]


def test_the_api_token_may_do_everything(client: TestClient) -> None:
    assert client.post("/v1/placements", json=PLACE, headers=bearer(API)).status_code == 201
    assert client.get("/metrics", headers=bearer(API)).status_code == 200
    report = {"placement": "scoped-1", "node": "hgx-h100", "cycle": 1, "active_alerts": []}
    assert client.post("/v1/reports", json=report, headers=bearer(API)).status_code == 200
    assert client.delete("/v1/placements/scoped-1", headers=bearer(API)).status_code == 200


def test_the_report_token_may_only_post_reports(client: TestClient) -> None:
    assert client.post("/v1/placements", json=PLACE, headers=bearer(API)).status_code == 201
    report = {"placement": "scoped-1", "node": "hgx-h100", "cycle": 1, "active_alerts": []}
    assert client.post("/v1/reports", json=report, headers=bearer(REPORT)).status_code == 200
    refused = [
        client.post("/v1/placements", json={**PLACE, "id": "scoped-2"}, headers=bearer(REPORT)),
        client.delete("/v1/placements/scoped-1", headers=bearer(REPORT)),
        client.get("/v1/placements", headers=bearer(REPORT)),
        client.get("/metrics", headers=bearer(REPORT)),
        client.post("/v1/topology/refresh", headers=bearer(REPORT)),
    ]
    for answer in refused:
        assert answer.status_code == 403, answer.text
        body = answer.json()
        assert body["error"] == "forbidden" and "POST /v1/reports" in body["detail"]
    assert placements(client) == ["scoped-1"]  # neither booked nor released


def test_the_read_token_may_only_read(client: TestClient) -> None:
    assert client.post("/v1/placements", json=PLACE, headers=bearer(API)).status_code == 201
    for path in ("/v1/placements", "/v1/placements/scoped-1", "/v1/topology", "/v1/queue", "/v1/alerts", "/metrics"):
        assert client.get(path, headers=bearer(READ)).status_code == 200, path
    report = {"placement": "scoped-1", "node": "hgx-h100", "cycle": 1, "active_alerts": []}
    refused = [
        client.post("/v1/placements", json={**PLACE, "id": "scoped-2"}, headers=bearer(READ)),
        client.delete("/v1/placements/scoped-1", headers=bearer(READ)),
        client.post("/v1/placements/scoped-1/renew", json={"ttl_s": 60}, headers=bearer(READ)),
        client.post("/v1/reports", json=report, headers=bearer(READ)),
    ]
    for answer in refused:
        assert answer.status_code == 403, answer.text
        assert "may only GET" in answer.json()["detail"]
    assert placements(client) == ["scoped-1"]


def test_an_unknown_token_is_401_whatever_the_scopes(client: TestClient) -> None:
    for headers in (bearer("nope"), bearer(REPORT + "x"), {}):
        answer = client.get("/v1/placements", headers=headers)
        assert answer.status_code == 401 and answer.headers["www-authenticate"].startswith("Bearer")


def test_the_tokens_must_differ() -> None:
    with pytest.raises(ValidationError, match="must all differ"):
        ServiceConfig(token=API, report_token=API)
    with pytest.raises(ValidationError, match="must all differ"):
        ServiceConfig(token=API, report_token=REPORT, read_token=REPORT)


def test_serve_refuses_a_reused_or_empty_scoped_token(
    run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOPOSCHED_API_TOKEN", API)
    monkeypatch.delenv("TOPOSCHED_READ_TOKEN", raising=False)
    monkeypatch.setenv("TOPOSCHED_REPORT_TOKEN", API)
    result = run_cli("serve", "--preset", "hgx-h100", "--state", f"sqlite:{tmp_path / 's.db'}")
    assert result.exit_code == 2 and "hold the same token" in result.stderr
    assert "$TOPOSCHED_API_TOKEN" in result.stderr and "$TOPOSCHED_REPORT_TOKEN" in result.stderr
    assert not (tmp_path / "s.db").exists()
    monkeypatch.setenv("TOPOSCHED_REPORT_TOKEN", REPORT)  # the two scoped ones alike: only they are named
    monkeypatch.setenv("TOPOSCHED_READ_TOKEN", REPORT)
    result = run_cli("serve", "--preset", "hgx-h100", "--state", f"sqlite:{tmp_path / 's.db'}")
    assert result.exit_code == 2 and "hold the same token" in result.stderr
    assert "$TOPOSCHED_READ_TOKEN" in result.stderr and "$TOPOSCHED_API_TOKEN" not in result.stderr
    monkeypatch.delenv("TOPOSCHED_READ_TOKEN")
    monkeypatch.delenv("TOPOSCHED_REPORT_TOKEN")
    empty = tmp_path / "read"
    empty.write_text("  \n")
    result = run_cli("serve", "--preset", "hgx-h100", "--read-token-file", str(empty))
    assert result.exit_code == 2 and "--read-token-file" in result.stderr and "is empty" in result.stderr


def test_the_sidecar_sends_the_report_token_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOPOSCHED_API_TOKEN", API)
    monkeypatch.setenv("TOPOSCHED_REPORT_TOKEN", REPORT)
    assert webhook_token(None) == REPORT
    monkeypatch.delenv("TOPOSCHED_REPORT_TOKEN")
    assert webhook_token(None) == API  # older deployments: the API token, as before
    given = tmp_path / "token"
    given.write_text(READ + "\n")
    assert webhook_token(SecretStr(read_token(given) or "")) == READ  # --token-file wins


def test_a_short_token_is_named_where_it_came_from(
    run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38: a short token read with --token-file was named as $TOPOSCHED_API_TOKEN."""
    monkeypatch.delenv("TOPOSCHED_API_TOKEN", raising=False)
    monkeypatch.delenv("TOPOSCHED_READ_TOKEN", raising=False)
    monkeypatch.setenv("TOPOSCHED_REPORT_TOKEN", "short-report")
    token = tmp_path / "api.token"
    token.write_text("short-api\n")
    result = run_cli(  # refused after the warnings: the report token is in the read token's place too
        "serve", "--preset", "hgx-h100", "--state", f"sqlite:{tmp_path / 's.db'}", "--token-file", str(token),
        "--read-token-file", str(token),
    )  # fmt: skip
    said = " ".join(result.stderr.split())  # the console wraps long lines at its width
    assert f"the token of --token-file {token} is shorter than 16 characters" in said
    assert "the token of $TOPOSCHED_REPORT_TOKEN is shorter" in said
    assert "the token of $TOPOSCHED_API_TOKEN" not in said
