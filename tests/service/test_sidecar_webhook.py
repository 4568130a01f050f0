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


def _ratio(server: Server, name: str) -> float | None:
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_reports_are_checked_against_the_placement_and_the_ratios_follow_the_latest_report(
    sqlite_server: Server,
) -> None:
    """A report must come from the placement's node and name only its GPUs (else 422: a spoofed report would
    mark it degraded and fire P0 alerts); the same drift reported again and again is one drifted instance,
    not a ratio over 1 that stays up, and a clean report clears it."""
    made = sqlite_server.client.post("/v1/placements", json={"id": "watched", "model": "llama-3.1-8b"})
    assert made.status_code == 201, made.text
    try:
        (rank,) = made.json()["ranks"]
        node, gpu = rank["node"], f"{rank['node']}/{rank['gpu']}"
        drift = {"kind": "TOPOLOGY_DRIFT", "gpu": gpu, "subject": "nvlink", "observed": 0, "expected": 18}
        report = {"placement": "watched", "node": node, "cycle": 1, "new_alerts": [drift], "active_alerts": [drift]}
        post = lambda body: sqlite_server.client.post("/v1/reports", json=body)  # noqa: E731
        assert post({**report, "node": "some-other-node"}).status_code == 422
        stray = {**drift, "gpu": f"{node}/7" if rank["gpu"] != 7 else f"{node}/6"}
        assert post({**report, "active_alerts": [stray], "new_alerts": [stray]}).status_code == 422
        assert post({"placement": "watched"}).status_code == 422  # no node: not from its sidecar
        for cycle in range(5):
            assert post({**report, "cycle": cycle}).status_code == 200
        drifted = _ratio(sqlite_server, "toposched_sidecar_drift_ratio")
        assert drifted is not None and 0 < drifted <= 1
        clean = {**report, "cycle": 9, "new_alerts": [], "active_alerts": []}
        assert post(clean).status_code == 200
        assert _ratio(sqlite_server, "toposched_sidecar_drift_ratio") == 0.0
    finally:
        sqlite_server.client.delete("/v1/placements/watched")
