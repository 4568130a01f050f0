"""End to end: a sidecar watching a scripted link failure reports to the service, which reacts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import RunCli
from tests.service.conftest import TOKEN, Server


def test_sidecar_webhook_marks_the_placement_degraded(
    sqlite_server: Server, run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"id": "hook", "model": "llama-3.1-70b", "replicas": 1, "slo_tpot_ms": 40}
    made = sqlite_server.client.post("/v1/placements", json=body)
    assert made.status_code == 201, made.text
    try:
        # the same request planned offline gives the plan file the sidecar reads
        plan = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--slo-tpot-ms", "40", "--json")
        data = json.loads(plan.stdout)
        data["request"]["id"] = data["placements"][0]["id"] = data["placements"][0]["request_id"] = "hook"
        assert [(r["node"], r["gpu"]) for r in data["placements"][0]["ranks"]] == [
            (r["node"], r["gpu"]) for r in made.json()["ranks"]
        ]
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(data))
        monkeypatch.delenv("TOPOSCHED_API_TOKEN", raising=False)
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")  # as a mounted Secret holds it
        result = run_cli(
            "sidecar",
            "--plan",
            str(path),
            "--placement",
            "hook",
            "--fake",
            "link-down",
            "--iterations",
            "3",
            "--interval",
            "0.01",
            "--webhook",
            f"{sqlite_server.url}/v1/reports",
            "--token-file",
            str(token_file),
        )
        assert result.exit_code == 0, result.stderr
        assert "TOPOLOGY_DRIFT" in result.stdout + result.stderr
        assert "webhook" not in result.stderr  # the POST was accepted (no error event)
        assert sqlite_server.client.get("/v1/placements/hook").json()["status"] == "degraded"
    finally:
        sqlite_server.client.delete("/v1/placements/hook")
