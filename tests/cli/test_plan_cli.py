"""`toposched plan` end to end: the JSON contract, human output and clean failures."""

from __future__ import annotations

import json

from tests.conftest import FIXTURES, RunCli


def test_plan_json_contract(run_cli: RunCli) -> None:
    result = run_cli(
        "plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--slo-tpot-ms", "40", "--replicas", "2", "--json"
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["unplaced"] == []
    assert [p["id"] for p in data["placements"]] == ["plan-0", "plan-1"]
    for p in data["placements"]:
        assert (p["tp"], p["pp"]) == (4, 1)
        assert [r["rank"] for r in p["ranks"]] == [0, 1, 2, 3]
        assert set(p["ranks"][0]) >= {"rank", "node", "gpu"}
        assert p["predicted"]["tpot_ms"] <= 40 and p["predicted"]["ttft_ms"] > 0
    used = [(r["node"], r["gpu"]) for p in data["placements"] for r in p["ranks"]]
    assert len(set(used)) == 8


def test_plan_on_a_capture_with_busy_gpus(run_cli: RunCli) -> None:
    smi = str(FIXTURES / "topo/07_dgx1-v100-1nic-driver440.txt")
    result = run_cli("plan", "--smi", smi, "--gpu", "A100-SXM-40GB", "--model", "llama-3.1-8b", "--tp", "4",
                     "--busy", "0", "--json")  # fmt: skip
    data = json.loads(result.stdout)
    (p,) = data["placements"]
    # GPU 0 is busy, so the only all-pairs-NVLink quad left is 4-7
    assert sorted(r["gpu"] for r in p["ranks"]) == [4, 5, 6, 7]


def test_unplaced_has_reasons_and_exit_1(run_cli: RunCli) -> None:
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--tp", "8", "--busy", "3", "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["placements"] == [] and data["unplaced"][0]["reasons"]


def test_human_output(run_cli: RunCli) -> None:
    result = run_cli(
        "plan", "--preset", "l40s-8x-pcie", "--model", "llama-3.1-70b", "--weight-dtype", "fp8", "--slo-tpot-ms", "80"
    )
    assert result.exit_code == 0
    assert "tp=4" in result.stdout and "domain-affinity" in result.stdout and "predicted TTFT" in result.stdout


def test_bad_input_is_one_line(run_cli: RunCli) -> None:
    cases = [
        (("plan", "--preset", "hgx-h100", "--model", "llama-3-7b"), "did you mean"),
        (("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--tp", "3"), "--tp 3: tp=3 does not divide"),
        (
            ("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--policy", "fastest"),
            "unknown placement policy",
        ),
        (("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--busy", "0,x"), "--busy"),
        (("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--busy", "9"), "not in the topology"),
        (("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--slo-class", "gold"), "--slo-class"),
        (("plan", "--model", "llama-3.1-70b"), "needs a topology"),
    ]
    for args, phrase in cases:
        result = run_cli(*args)
        assert result.exit_code == 2, (args, result.stderr)
        assert phrase in result.stderr, (args, result.stderr)
        assert result.stdout == "" and "Traceback" not in result.stderr


def test_exact_policy_on_a_small_box(run_cli: RunCli) -> None:
    result = run_cli("plan", "--preset", "4gpu-2numa-nvlink-pairs", "--model", "llama-3.1-8b", "--tp", "2",
                     "--replicas", "2", "--policy", "exact", "--json")  # fmt: skip
    data = json.loads(result.stdout)
    pairs = sorted(tuple(sorted(r["gpu"] for r in p["ranks"])) for p in data["placements"])
    assert pairs == [(0, 1), (2, 3)]


def test_exact_keeps_the_cross_domain_budget_like_slo(run_cli: RunCli) -> None:
    # issue 12: exact used to book GPUs 4-7 with the cross-domain budget broken while slo queued it
    args = ("plan", "--preset", "l40s-8x-pcie", "--model", "llama-3.1-70b", "--tp", "4", "--affinity", "none",
            "--budget-gbps", "1", "--json")  # fmt: skip
    for policy in ("slo", "exact"):
        result = run_cli(*args, "--policy", policy)
        assert result.exit_code == 1, (policy, result.stderr)
        data = json.loads(result.stdout)
        assert data["placements"] == [], policy
        assert [u["status"] for u in data["unplaced"]] == ["queued"], policy
    roomy = run_cli(*args[:-3], "--budget-gbps", "256", "--json", "--policy", "exact")
    assert roomy.exit_code == 0, roomy.stderr
    (placement,) = json.loads(roomy.stdout)["placements"]
    assert all(c["held"] for c in placement["constraints"] if c["name"] != "slo")


def test_policy_help_lists_the_registry(run_cli: RunCli) -> None:
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--policy", "exactly")
    assert result.exit_code == 2 and "exact" in result.stderr and "Traceback" not in result.stderr


def test_simulate_refuses_exact_above_its_cluster_limit_in_one_line(run_cli: RunCli) -> None:
    result = run_cli("simulate", "--scenario", "seed-256", "--policies", "slo,exact", "--json")
    assert result.exit_code == 2
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert "256 GPUs" in result.stderr and "at most 128" in result.stderr


def test_simulate_runs_exact_on_a_small_scenario(run_cli: RunCli) -> None:
    result = run_cli("simulate", "--scenario", "small", "--policies", "exact", "--requests", "10", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["policies"]["exact"]["requests"] == 10
