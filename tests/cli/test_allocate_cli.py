"""`toposched allocate`: the GetPreferredAllocation JSON contract, refusals and bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import FIXTURES, RunCli

TOPO = FIXTURES / "topo"
DGX1 = str(TOPO / "07_dgx1-v100-1nic-driver440.txt")
H100 = str(TOPO / "04_8x-h100-nv18-no-gpunumaid.txt")
RTX4090 = str(TOPO / "21_8x-rtx4090-node-sys-with-prompt.txt")


def gpus(run_cli: RunCli, *args: str) -> list[int]:
    result = run_cli("allocate", *args, "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"gpus"}
    return list(data["gpus"])


def test_dgx1_size4_is_a_quad(run_cli: RunCli) -> None:
    assert gpus(run_cli, "--smi", DGX1, "--size", "4") in ([0, 1, 2, 3], [4, 5, 6, 7])


def test_available_and_must_include(run_cli: RunCli) -> None:
    assert gpus(run_cli, "--smi", DGX1, "--available", "1,2,3,4,5,6,7", "--size", "4") == [4, 5, 6, 7]
    assert gpus(run_cli, "--smi", RTX4090, "--must-include", "6", "--size", "4") == [4, 5, 6, 7]
    assert gpus(run_cli, "--smi", H100, "--available", " 3, 4,5,6,7", "--size", "2") == [4, 5]


def test_preset_source_and_explain(run_cli: RunCli) -> None:
    result = run_cli("allocate", "--preset", "hgx-h100", "--size", "8", "--json", "--explain")
    data = json.loads(result.stdout)
    assert data["gpus"] == list(range(8))
    assert data["method"] == "exhaustive"
    assert data["score"]["in_nvlink_clique"] is True
    assert data["why"]


def test_multi_node_topology_needs_node(run_cli: RunCli) -> None:
    result = run_cli("allocate", "--preset", "cluster-32x-hgx-h100", "--size", "2", "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["gpus"] == []
    assert "--node" in result.stderr
    ok = run_cli("allocate", "--preset", "cluster-32x-hgx-h100", "--node", "h100-03", "--size", "2", "--json")
    assert json.loads(ok.stdout) == {"gpus": [0, 1]}
    unknown = run_cli("allocate", "--preset", "cluster-32x-hgx-h100", "--node", "h100-3", "--size", "2")
    assert unknown.exit_code == 2
    assert "did you mean" in unknown.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--available", "0,1", "--must-include", "3", "--size", "2"), "must-include GPU 3 not in the available set"),
        (("--available", "0,1", "--size", "3"), "size 3 is larger than the 2 available"),
        (("--must-include", "0,1,2", "--size", "2"), "more than the size 2"),
        (("--size", "0"), "size must be at least 1"),
    ],
)
def test_impossible_request_prints_empty_gpus_and_reason(run_cli: RunCli, args: tuple[str, ...], fragment: str) -> None:
    result = run_cli("allocate", "--smi", H100, *args, "--json")
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["gpus"] == []
    assert fragment in data["reason"]
    assert set(data) == {"gpus", "reason"}


def test_impossible_request_without_json_goes_to_stderr(run_cli: RunCli) -> None:
    result = run_cli("allocate", "--smi", H100, "--size", "9")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "size 9 is larger than the 8 available" in result.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--available", "0,x"), "--available '0,x': 'x' is not a GPU index"),
        (("--available", "0,,1"), "--available '0,,1' has an empty item"),
        (("--must-include", "-1"), "--must-include '-1'"),
        (("--available", "0,8"), "--available names GPU 8"),
        (("--must-include", "12"), "--must-include names GPU 12"),
        (("--available", "1,1"), "--available lists GPU 1 more than once"),
    ],
)
def test_bad_lists_name_the_flag(run_cli: RunCli, args: tuple[str, ...], fragment: str) -> None:
    plain = run_cli("allocate", "--smi", H100, "--size", "1", *args)
    assert plain.exit_code == 2
    assert fragment in plain.stderr
    assert "Traceback" not in plain.stderr
    assert len(plain.stderr.strip().splitlines()) <= 2
    as_json = run_cli("allocate", "--smi", H100, "--size", "1", *args, "--json")
    assert as_json.exit_code == 2
    assert json.loads(as_json.stdout)["gpus"] == []


def test_human_output_names_gpus_and_why(run_cli: RunCli) -> None:
    result = run_cli("allocate", "--smi", DGX1, "--size", "4")
    assert result.exit_code == 0
    assert "GPUs 0,1,2,3" in result.stdout
    assert "every pair on NVLink" in result.stdout


def test_two_sources_are_refused(run_cli: RunCli) -> None:
    result = run_cli("allocate", "--smi", H100, "--preset", "hgx-h100", "--size", "1")
    assert result.exit_code == 2
    assert "one topology source" in result.stderr


def test_real_entry_point_exit_code() -> None:
    env = {**os.environ, "TOPOSCHED_DEBUG": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "toposched.cli.main", "allocate", "--smi", DGX1, "--size", "9", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 2
    assert json.loads(proc.stdout) == {"gpus": [], "reason": "size 9 is larger than the 8 available GPU(s)"}
