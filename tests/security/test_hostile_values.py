"""Values from outside that no real system has (found by a hostile-input review): each is one clear
error naming the input, never a traceback, a 500, or a value passed on to a script or a label."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, RunCli
from toposched.errors import InputError
from toposched.ledger.etcd_keys import split_url
from toposched.solver.scheduler import Scheduler
from toposched.topology.presets import load_preset
from toposched.topology.spec import load_cluster_spec


@pytest.mark.parametrize(
    ("url", "phrase"),
    [
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://127.0.0.1:99999", "out of range"),
        ("http://127.0.0.1:-1", "not an etcd endpoint"),
        ("http://127.0.0.1:2379aaa", "not an etcd endpoint"),
        ("http://127.0.0.1:\u0661", "not an etcd endpoint"),
        ("http://127.0.0.1:0", "port 0"),
        ("http://user:secret@127.0.0.1:2379", "user or password is not supported"),
        ("ftp://127.0.0.1:2379", "not an etcd endpoint"),
    ],
)
def test_a_bad_etcd_url_is_an_input_error(url: str, phrase: str) -> None:
    with pytest.raises(InputError, match=phrase) as info:
        split_url(url)
    assert "secret" not in str(info.value)


def test_a_good_etcd_url_is_read() -> None:
    assert split_url("http://127.0.0.1:2379/ns") == ("http://127.0.0.1:2379", "ns")
    assert split_url("127.0.0.1:2379") == ("http://127.0.0.1:2379", "toposched")


@pytest.mark.parametrize("budget", [math.nan, -1.0, 0.0, math.inf])
def test_a_budget_that_is_not_a_positive_number_is_refused(budget: float, run_cli: RunCli) -> None:
    with pytest.raises(InputError, match="cross-domain budget"):
        Scheduler(load_preset("hgx-h100"), budget_gbps=budget)
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", f"--budget-gbps={budget}")
    assert result.exit_code != 0 and "cross-domain budget" in result.stderr


@pytest.mark.parametrize(
    ("line", "phrase"),
    [
        ('gpu_model: "H100 $(id) ;x:y #z"', "is not a GPU model name"),
        ("gpu_model: " + "H" * 64, "at most 63"),
    ],
)
def test_a_gpu_model_that_no_label_can_hold_is_refused(tmp_path: Path, line: str, phrase: str) -> None:
    capture = sorted((FIXTURES / "topo").glob("*.txt"))[0]  # any real capture
    spec = tmp_path / "cluster.yaml"
    spec.write_text(f"nodes:\n  - name: a\n    smi: {capture}\n    {line}\n")
    with pytest.raises(InputError, match=phrase):
        load_cluster_spec(spec)


def test_a_probe_with_a_negative_numa_node_or_a_huge_index_is_refused(tmp_path: Path, run_cli: RunCli) -> None:
    node = json.loads(load_preset("hgx-h100").nodes[0].model_dump_json())
    for field, value in (("numa_node", -5), ("index", 99999999999999999999)):
        probe = json.loads(json.dumps(node))
        probe["gpus"][1][field] = value
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps(probe))
        spec = tmp_path / f"{field}.yaml"
        spec.write_text(f"nodes:\n  - name: a\n    probe: {path}\n")
        result = run_cli("topo", "show", "--cluster", str(spec))
        assert result.exit_code != 0 and field in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("extra", "phrase"),
    [
        ("cluster: 2x hgx-h100", "unknown preset"),
        ("cluster: 2xhgx-h100\nslo_mix: {batch: 1e308, realtime: 1e308}", "positive, finite sum"),
    ],
)
def test_scenario_values_that_would_crash_the_run_are_refused(
    tmp_path: Path, run_cli: RunCli, extra: str, phrase: str
) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"name: x\nmodel: llama-3.1-8b\n{extra}\n")
    result = run_cli("simulate", "--scenario", str(scenario))
    assert result.exit_code != 0 and phrase in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("addr", ["h100-00:9999", "--headless", "a b", "host;id"])
def test_a_master_addr_that_is_not_a_host_or_address_is_refused(run_cli: RunCli, addr: str) -> None:
    args = ["launch", "vllm", "--preset", "cluster-32x-hgx-h100", "-m", "llama-3.1-405b", "--slo-tpot-ms", "60"]
    result = run_cli(*args, f"--master-addr={addr}")
    assert result.exit_code == 2 and "--master-addr" in result.stderr, result.stderr


def test_an_ipv6_master_addr_is_bracketed_for_sglang(run_cli: RunCli, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["launch", "sglang", "--preset", "cluster-32x-hgx-h100", "-m", "llama-3.1-405b", "--slo-tpot-ms", "60"]
    result = run_cli(*args, "--master-addr", "fe80::1", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    scripts = "".join(p.read_text() for p in sorted(out.glob("*.sh")))
    assert "--dist-init-addr '[fe80::1]:" in scripts or "--dist-init-addr [fe80::1]:" in scripts, scripts[:2000]


def test_a_plan_whose_request_names_another_model_is_refused(run_cli: RunCli, tmp_path: Path) -> None:
    made = run_cli("plan", "--preset", "hgx-h100", "-m", "llama-3.1-8b", "--json")
    plan = json.loads(made.stdout)
    plan["request"]["model"] = "llama-3.1-405b"  # edited by hand: 810 GB on the GPU planned for 16
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    result = run_cli("launch", "vllm", "--plan", str(path))
    assert result.exit_code == 2 and "is not the plan's model" in result.stderr, result.stderr


def test_launch_ray_warns_when_a_placement_takes_part_of_a_node(run_cli: RunCli) -> None:
    args = ["--preset", "l40s-8x-pcie", "-m", "llama-3.1-8b", "--tp", "2", "--busy", "0,1,2,4"]
    result = run_cli("launch", "ray", *args)
    assert result.exit_code == 0 and "Ray bundles pin the node" in result.stderr, result.stderr
    assert json.loads(result.stdout)["placement_groups"]  # the warning is on stderr only
