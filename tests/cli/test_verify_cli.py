"""``toposched verify nccl`` and ``verify topo`` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, RunCli

NCCL = FIXTURES / "nccl"
TOPO = FIXTURES / "topo"


def _one(prefix: str, where: Path = NCCL) -> str:
    (path,) = where.glob(prefix + "*")
    return str(path)


def test_nccl_json_contract(run_cli: RunCli) -> None:
    result = run_cli("verify", "nccl", _one("03_"), "--json")
    assert result.exit_code == 1, result.stderr  # spans_nodes and collnet_fallback are warnings
    data = json.loads(result.stdout)
    assert data["nranks"] == 8 and data["nnodes"] == 4 and data["gdrdma"] is True
    assert data["transports"] == ["COLLNET", "NET/IB", "P2P/CUMEM"]
    assert {"code", "severity", "message"} <= set(data["findings"][0])


def test_nccl_json_nnodes_null_when_not_reported(run_cli: RunCli) -> None:
    data = json.loads(run_cli("verify", "nccl", _one("08_"), "--json").stdout)
    assert data["nnodes"] is None and data["nranks"] == 16
    assert data["transports"] == ["NET/AWS Libfabric", "P2P/IPC"]


def test_nccl_human(run_cli: RunCli) -> None:
    result = run_cli("verify", "nccl", _one("10_"))
    assert result.exit_code == 1
    assert "p2p_disabled" in result.stdout and "SHM" in result.stdout


@pytest.mark.parametrize("content", [b"", b"\x00\x01\x02garbage" * 100, None], ids=["empty", "binary", "topo"])
def test_nccl_not_a_log(run_cli: RunCli, tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "x.log"
    path.write_bytes(content if content is not None else Path(_one("04_", TOPO)).read_bytes())
    result = run_cli("verify", "nccl", str(path), "--json")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
    assert "not an NCCL log" in result.stderr


def test_nccl_missing_file(run_cli: RunCli, tmp_path: Path) -> None:
    result = run_cli("verify", "nccl", str(tmp_path / "nope.log"))
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_topo_nvlink_domain(run_cli: RunCli) -> None:
    result = run_cli("verify", "topo", "--smi", _one("04_", TOPO), "--gpus", "0,1,2,3", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["level"] == "nvlink" and data["gpus"] == [0, 1, 2, 3]
    assert data["nvlink_domain"] is not None and data["numa_node"] == 0 and data["reasons"] == []


def test_topo_dgx1_cube_mesh_clique(run_cli: RunCli) -> None:
    ok = run_cli("verify", "topo", "--smi", _one("07_", TOPO), "--gpus", "0,1,2,3", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["level"] == "nvlink"
    bad = run_cli("verify", "topo", "--smi", _one("07_", TOPO), "--gpus", "0,1,2,5", "--json")
    data = json.loads(bad.stdout)
    assert bad.exit_code == 1 and data["ok"] is False and any("SYS" in r for r in data["reasons"])


def test_topo_numa_pair_and_sys(run_cli: RunCli) -> None:
    same = run_cli("verify", "topo", "--smi", _one("05_", TOPO), "--gpus", "0,1", "--json")
    data = json.loads(same.stdout)
    assert same.exit_code == 0 and data["level"] == "numa" and data["numa_node"] == 0 and data["nvlink_domain"] is None
    cross = run_cli("verify", "topo", "--smi", _one("05_", TOPO), "--gpus", "0,2")
    assert cross.exit_code == 1 and "SYS" in cross.stdout


def test_topo_all_sys_box_fails_inside_one_numa(run_cli: RunCli) -> None:
    result = run_cli("verify", "topo", "--smi", _one("28_", TOPO), "--gpus", "0,1", "--json")
    data = json.loads(result.stdout)
    assert result.exit_code == 1 and data["numa_node"] == 0 and data["level"] == "none"


def test_topo_bad_input(run_cli: RunCli) -> None:
    assert run_cli("verify", "topo", "--smi", _one("05_", TOPO), "--gpus", "0,9").exit_code == 2
    assert run_cli("verify", "topo", "--smi", _one("05_", TOPO), "--gpus", "a,b").exit_code == 2
    both = run_cli("verify", "topo", "--gpus", "0,1")
    assert both.exit_code == 2 and "--smi" in both.stderr


def test_nccl_special_file_is_one_error_line(run_cli: RunCli) -> None:
    result = run_cli("verify", "nccl", "/dev/zero", "--json")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: NCCL log '/dev/zero' is not a regular file")
    assert len(result.stderr.strip().splitlines()) <= 2


def test_nccl_log_over_the_bound_says_to_keep_the_nccl_lines(
    run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toposched.sidecar import nccl

    monkeypatch.setattr(nccl, "MAX_LOG_BYTES", 1000)
    result = run_cli("verify", "nccl", _one("03_"))
    assert result.exit_code == 2 and "at most 1,000 are read" in result.stderr and "grep NCCL" in result.stderr


def test_nccl_long_spliced_line(run_cli: RunCli, tmp_path: Path) -> None:
    # A real log whose connection line carries a 200 kB remark: read in linear time, not minutes.
    text = Path(_one("03_")).read_text()
    at = text.index(" via NET/IBext_v8/0/GDRDMA") + len(" via NET/IBext_v8/0/GDRDMA")
    path = tmp_path / "long.log"
    path.write_text(text[:at] + " " + "x" * 200_000 + text[at:])
    result = run_cli("verify", "nccl", str(path), "--json")
    assert result.exit_code == 1 and json.loads(result.stdout)["nranks"] == 8


@pytest.mark.parametrize(("prefix", "code"), [("04_", 0), ("11_", 0), ("12_", 1), ("01_", 1)])
def test_nccl_exit_code_is_one_exactly_when_a_warning_is_found(run_cli: RunCli, prefix: str, code: int) -> None:
    # 04: no findings; 11: only skipped_records (info); 12: net_socket; 01: shm_transport (warnings)
    result = run_cli("verify", "nccl", _one(prefix), "--json")
    severities = {f["severity"] for f in json.loads(result.stdout)["findings"]}
    assert result.exit_code == code and ("warning" in severities) == (code == 1)


def test_topo_from_a_preset_and_a_node_of_a_cluster(run_cli: RunCli) -> None:
    ok = run_cli("verify", "topo", "--preset", "hgx-h100", "--gpus", "0,1,2,3", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["level"] == "nvlink"
    pairs = run_cli("verify", "topo", "--preset", "4gpu-2numa-nvlink-pairs", "--gpus", "1,2")
    assert pairs.exit_code == 1 and "NOT OK" in pairs.stdout
    many = run_cli("verify", "topo", "--preset", "cluster-32x-hgx-h100", "--gpus", "0,1")
    assert many.exit_code == 2 and "--node" in many.stderr
    node = run_cli("verify", "topo", "--preset", "cluster-32x-hgx-h100", "--node", "h100-03", "--gpus", "0,7", "--json")
    assert node.exit_code == 0 and json.loads(node.stdout)["node"] == "h100-03"
