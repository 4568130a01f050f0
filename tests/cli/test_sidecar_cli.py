"""``toposched sidecar`` on a plan with the scripted NVML scenarios."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunCli


@pytest.fixture
def plan_file(run_cli: RunCli, tmp_path: Path) -> str:
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--tp", "4", "--json")
    assert result.exit_code == 0, result.stderr
    path = tmp_path / "plan.json"
    path.write_text(result.stdout)
    return str(path)


def _events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_link_down_alerts_and_reacts(run_cli: RunCli, plan_file: str, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.prom"
    result = run_cli(
        "sidecar", "--placement", plan_file, "--fake", "link-down", "--interval", "0.001",
        "--iterations", "3", "--react", "--metrics-file", str(metrics),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    events = _events(result.stdout)
    alerts = [e for e in events if e["event"] == "alert"]
    assert {(e["kind"], e["gpu"]) for e in alerts} == {("TOPOLOGY_DRIFT", "hgx-h100/1")} and len(alerts) == 3
    assert [e["event"] for e in events].count("check") == 3
    (reaction,) = [e for e in events if e["event"] == "reaction"]
    assert reaction["status"] == "degraded" and reaction["proposal"]["gpus"] == [f"hgx-h100/{i}" for i in range(4, 8)]
    assert 'toposched_sidecar_alerts_total{kind="TOPOLOGY_DRIFT"} 3.0' in metrics.read_text()


def test_steady_is_quiet(run_cli: RunCli, plan_file: str) -> None:
    result = run_cli("sidecar", "--placement", "plan", "--plan", plan_file, "--fake", "steady", "--interval", "0.001",
                     "--iterations", "2")  # fmt: skip
    assert result.exit_code == 0
    assert [e["event"] for e in _events(result.stdout)] == ["check", "check"]


def test_bad_inputs(run_cli: RunCli, plan_file: str) -> None:
    unknown = run_cli("sidecar", "--placement", "nope", "--plan", plan_file, "--fake", "steady", "--iterations", "1")
    assert unknown.exit_code == 2 and "unknown placement" in unknown.stderr
    scenario = run_cli("sidecar", "--placement", plan_file, "--fake", "link-dwn", "--iterations", "1")
    assert scenario.exit_code == 2 and "link-down" in scenario.stderr
    missing = run_cli("sidecar", "--placement", "plan", "--iterations", "1")
    assert missing.exit_code == 2 and "--plan" in missing.stderr


def test_real_nvml_without_a_driver_fails_clearly(run_cli: RunCli, plan_file: str) -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # a GPU machine: the real path runs instead (see docs/sidecar.md)
        pynvml.nvmlShutdown()
        pytest.skip("NVML works here")
    result = run_cli("sidecar", "--placement", plan_file, "--iterations", "1")
    assert result.exit_code == 1 and "NVML" in result.stderr


@pytest.mark.parametrize("args", [("--placement", "p", "--plan", "/dev/zero"), ("--placement", "/dev/zero")])
def test_special_file_plan_is_one_error_line(run_cli: RunCli, args: tuple[str, ...]) -> None:
    result = run_cli("sidecar", *args, "--fake", "steady", "--iterations", "1")
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and "/dev/zero" in lines[0] and len(lines) <= 2
