"""``plan`` and every ``launch`` command take the same plan options, declared once (cli/plan_options.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import RunCli
from toposched.cli.main import load_command
from toposched.solver.request import DEFAULT_MAX_MODEL_LEN

NODES = Path(__file__).resolve().parents[1] / "binding" / "data" / "nodes-h100.json"
LAUNCHES = ("vllm", "sglang", "trtllm", "k8s", "k8s-lint", "ray")


def _options(command: object) -> set[str]:
    return {opt for p in command.params for opt in p.opts}  # type: ignore[attr-defined]


def test_every_launch_command_takes_every_plan_option() -> None:
    plan = load_command("plan")
    group = load_command("launch")
    assert plan is not None and group is not None
    # a launch's engine is its own (launch vllm, launch k8s --engine ...): the plan is sized for it; --quiet is
    # plan's progress switch (cli/progress.py), not a plan option
    planned = _options(plan) - {"--json", "--engine", "--quiet", "-q"}
    assert {"-m", "--model", "--weight-dtype", "--kv-dtype", "--policy", "--ep", "--busy", "--profile"} <= planned
    for name in LAUNCHES:
        command = group.get_command(None, name)  # type: ignore[attr-defined]
        assert planned <= _options(command), (name, planned - _options(command))
        assert "--plan" in _options(command)


@pytest.mark.parametrize("name", LAUNCHES)
def test_a_tp_the_heads_cannot_split_is_two_lines_and_exit_2(run_cli: RunCli, name: str) -> None:
    extra = ["--nodes", str(NODES)] if name == "k8s-lint" else []
    result = run_cli("launch", name, "--model", "llama-3.1-70b", "--preset", "hgx-h100", "--tp", "3", *extra)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: --tp 3: tp=3 does not divide the 64 attention heads of llama-3.1-70b",
        "  fix: valid tp: 1, 2, 4, 8, 16, 32, 64",
    ]


def test_a_request_value_out_of_range_names_the_flag(run_cli: RunCli) -> None:
    for args in (("plan",), ("launch", "vllm")):
        result = run_cli(*args, "-m", "llama-3.1-8b", "--preset", "hgx-h100", "--replicas", "0")
        assert result.exit_code == 2 and result.stderr.startswith("error: --replicas: "), result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 2
        policy = run_cli(*args, "-m", "llama-3.1-8b", "--preset", "hgx-h100", "--policy", "nope")
        assert policy.exit_code == 2 and "slo" in policy.stderr


def test_launch_plans_with_the_options_plan_takes(run_cli: RunCli) -> None:
    common = ("-m", "llama-3.1-8b", "--preset", "hgx-h100", "--kv-dtype", "fp8", "--concurrent-seqs", "16")
    plan = json.loads(run_cli("plan", *common, "--tp", "2", "--json").stdout)
    launch = run_cli("launch", "vllm", *common, "--tp", "2", "--format", "json")
    assert launch.exit_code == 0, launch.stderr
    (one,) = json.loads(launch.stdout)["launches"]
    argv = one["argv"]
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8" and argv[argv.index("--max-num-seqs") + 1] == "16"
    (placed,) = plan["placements"]
    assert one["gpus"] == [r["gpu"] for r in placed["ranks"]]  # the same plan, not a re-plan with other defaults
    weights = run_cli("launch", "vllm", "-m", "llama-3.1-8b", "--preset", "hgx-h100", "--weight-dtype", "fp8")
    assert weights.exit_code == 0 and "--quantization fp8_per_tensor" in weights.stdout


def test_max_model_len_default_is_one_for_every_command(run_cli: RunCli) -> None:
    """Issue 32: one set of defaults: plan, launch and fit reserve the same context unless told otherwise."""
    for args in (("plan",), ("launch", "trtllm"), ("fit",)):
        text = " ".join(run_cli(*args, "--help").stdout.split())
        assert f"default {DEFAULT_MAX_MODEL_LEN}," in text, args
    fit = json.loads(run_cli("fit", "-m", "llama-3.1-70b", "--gpu", "H100-SXM", "--tp", "4", "--json").stdout)
    assert (fit["max_model_len"], fit["model_context"]) == (DEFAULT_MAX_MODEL_LEN, 131072)


def test_plan_and_launch_refuse_two_sources_and_none(run_cli: RunCli, tmp_path: Path) -> None:
    none = run_cli("plan", "-m", "llama-3.1-8b")
    assert none.exit_code == 2 and none.stderr.startswith("error: planning needs a topology")
    no_model = run_cli("plan", "--preset", "hgx-h100")
    assert no_model.exit_code == 2 and no_model.stderr.startswith("error: no model to plan")
    both = run_cli("launch", "vllm", "--plan", str(tmp_path / "p.json"), "-m", "llama-3.1-8b")
    assert both.exit_code == 2 and "not both" in both.stderr
