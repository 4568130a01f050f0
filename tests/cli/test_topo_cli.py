"""`toposched topo ...` end to end, including the JSON contract and clean failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, CliResult, RunCli

TOPO = FIXTURES / "topo"


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOPOSCHED_STATE", str(tmp_path / "state.sqlite3"))
    monkeypatch.delenv("TOPOSCHED_TOPO_MAX_AGE", raising=False)


def test_show_smi_json_contract(run_cli: RunCli) -> None:
    result: CliResult = run_cli("topo", "show", "--smi", str(TOPO / "13_8x-a100-nv12-1nic-numa3157.txt"), "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert [g["index"] for g in data["gpus"]] == list(range(8))
    assert [g["numa_node"] for g in data["gpus"]] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert data["nvlink_domains"] == [list(range(8))]
    assert {g["nvlink_domain"] for g in data["gpus"]} == {"localhost/nv0"}
    assert len(data["links"]) == 28
    assert {(link["kind"], link["nvlinks"]) for link in data["links"]} == {("NVLINK", 12)}
    assert set(data["links"][0]) >= {"a", "b", "kind", "nvlinks"}


def test_show_smi_json_pcie_box_has_no_domains(run_cli: RunCli) -> None:
    result = run_cli("topo", "show", "--smi", str(TOPO / "05_4x-rtx6000ada-4nic-2numa.txt"), "--json")
    data = json.loads(result.stdout)
    assert data["nvlink_domains"] == []
    assert [g["nvlink_domain"] for g in data["gpus"]] == [None] * 4
    assert {(x["a"], x["b"]): x["kind"] for x in data["links"]}[(0, 1)] == "NODE"
    assert [g["numa_node"] for g in data["gpus"]] == [0, 0, 1, 1]
    assert data["gpus"][0]["nearest_nics"] == ["NIC0", "NIC1"]


def test_numa_is_null_where_the_file_gives_none(run_cli: RunCli) -> None:
    result = run_cli("topo", "show", "--smi", str(TOPO / "07_dgx1-v100-1nic-driver440.txt"), "--json")
    data = json.loads(result.stdout)
    assert [g["numa_node"] for g in data["gpus"]] == [None] * 8
    assert data["domains"][0]["cliques"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    "name", ["20_8x-pcie-pix-pxb-numa-na-TRUNCATED.txt", "32_dgx2-16x-v100-nv6-10nic-TRUNCATED.txt"]
)
def test_unreadable_input_fails_cleanly_through_the_real_entry_point(name: str) -> None:
    env = {**os.environ, "TOPOSCHED_DEBUG": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "toposched.cli.main", "topo", "show", "--smi", str(TOPO / name), "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0] and "line" in lines[0]


def test_missing_file_and_rocm_output(run_cli: RunCli, tmp_path: Path) -> None:
    result = run_cli("topo", "show", "--smi", str(tmp_path / "nope.txt"))
    assert result.exit_code == 2 and "does not exist" in result.stderr and result.stdout == ""
    rocm = tmp_path / "rocm.txt"
    rocm.write_text("============ ROCm System Management Interface ============\nGPU  Temp\n0    40c\n")
    result = run_cli("topo", "show", "--smi", str(rocm), "--json")
    assert result.exit_code == 2 and "rocm-smi" in result.stderr and result.stdout == ""


def test_two_sources_is_an_error(run_cli: RunCli) -> None:
    result = run_cli("topo", "show", "--preset", "dgx2", "--live")
    assert result.exit_code == 2
    assert "give one topology source" in result.stderr


def test_live_without_driver(run_cli: RunCli) -> None:
    result = run_cli("topo", "show", "--live")
    assert result.exit_code == 1
    assert "no NVIDIA driver" in result.stderr and "fix:" in result.stderr


def test_human_output_draws_matrix_and_domains(run_cli: RunCli) -> None:
    result = run_cli("topo", "show", "--preset", "4gpu-2numa-nvlink-pairs")
    assert result.exit_code == 0
    assert "NV12" in result.stdout and "SYS" in result.stdout
    assert "box4/nv0" in result.stdout and "box4/nv1" in result.stdout
    assert "NUMA groups" in result.stdout


def test_refresh_then_show_from_state_and_staleness(run_cli: RunCli, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_cli("topo", "show")
    assert result.exit_code == 2 and "topo refresh" in result.stderr
    result = run_cli("topo", "refresh", "--preset", "hgx-h200", "--json")
    assert json.loads(result.stdout)["version"] == 1
    result = run_cli("topo", "refresh", "--json")  # same source again
    data = json.loads(result.stdout)
    assert (data["version"], data["changed"], data["source"]) == (2, False, "preset:hgx-h200")
    result = run_cli("topo", "show", "--json")
    data = json.loads(result.stdout)
    assert (data["version"], data["stale"]) == (2, False)
    assert result.stderr == ""
    monkeypatch.setenv("TOPOSCHED_TOPO_MAX_AGE", "0.000001")
    result = run_cli("topo", "show", "--json")
    assert json.loads(result.stdout)["stale"] is True
    assert "is " in result.stderr and "old" in result.stderr and "topo refresh" in result.stderr
    monkeypatch.setenv("TOPOSCHED_TOPO_MAX_AGE", "-5")
    result = run_cli("topo", "show")
    assert result.exit_code == 2 and "TOPOSCHED_TOPO_MAX_AGE" in result.stderr


def test_state_is_spelled_as_for_every_command(run_cli: RunCli, tmp_path: Path) -> None:
    path = tmp_path / "elsewhere.sqlite3"
    stored = run_cli("topo", "refresh", "--preset", "hgx-h100", "--state", f"sqlite:{path}", "--json")
    assert stored.exit_code == 0 and json.loads(stored.stdout)["state"] == f"sqlite:{path}"
    shown = run_cli("topo", "show", "--state", str(path), "--json")  # a bare path is the SQLite file
    assert shown.exit_code == 0 and json.loads(shown.stdout)["version"] == 1


def test_fabric_is_described_in_units_people_use(run_cli: RunCli) -> None:
    result = run_cli("topo", "show", "--preset", "cluster-32x-hgx-h100")
    assert "fabric IB NDR, 8 x 400 Gb/s NICs (50 GB/s each)" in " ".join(result.stdout.split())


def test_presets_json(run_cli: RunCli) -> None:
    data = json.loads(run_cli("topo", "presets", "--json").stdout)
    names = {p["name"]: p for p in data}
    assert names["gb200-nvl72"]["gpus"] == 72
    assert names["cluster-32x-hgx-h100"]["nodes"] == 32
    assert len(names) >= 10


def test_version_flag(run_cli: RunCli) -> None:
    assert run_cli("--version").stdout.startswith("toposched ")


def test_special_file_fails_fast_through_the_real_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "toposched.cli.main", "topo", "show", "--smi", "/dev/zero"],
        capture_output=True,
        text=True,
        env={**os.environ, "TOPOSCHED_DEBUG": "0"},
        check=False,
        timeout=60,  # the old reader never returned
    )
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: topology file '/dev/zero' is not a regular file")


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        ((TOPO / "05_4x-rtx6000ada-4nic-2numa.txt").read_bytes().replace(b"GPU1", b"GPU\x001", 1), "NUL byte"),
        (b"\tGPU0\tGPU1\n\xff\xfe\n", "not UTF-8"),
        (None, "is a directory"),
    ],
    ids=["nul-header", "not-utf8", "directory"],
)
@pytest.mark.parametrize("command", [("topo", "show"), ("topo", "refresh"), ("verify", "topo", "--gpus", "0")])
def test_hostile_capture_is_one_error_line(
    run_cli: RunCli, tmp_path: Path, content: bytes | None, phrase: str, command: tuple[str, ...]
) -> None:
    path = tmp_path / "dir"
    if content is not None:
        path = tmp_path / "topo.txt"
        path.write_bytes(content)
    else:
        path.mkdir()
    result = run_cli(*command, "--smi", str(path))
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and phrase in lines[0]
    assert len(lines) <= 2 and all(line.startswith("  fix: ") for line in lines[1:])


def test_cut_nic_legend_is_a_warning_naming_the_nics(run_cli: RunCli, tmp_path: Path) -> None:
    text = (TOPO / "16_8x-a100sxm4-80g-nv12-8nic-roce.txt").read_text()
    path = tmp_path / "cut.txt"
    path.write_text(text[: text.index("NIC4: mlx5_4")])
    result = run_cli("topo", "show", "--smi", str(path), "--json")
    assert result.exit_code == 0
    assert "no entry for NIC4, NIC5, NIC6, NIC7" in result.stderr
    data = json.loads(result.stdout)
    assert any("NIC4, NIC5, NIC6, NIC7" in w for w in data["warnings"])
    devices = {nic["name"]: nic["device"] for nic in data["cluster"]["nodes"][0]["nics"]}
    assert devices["NIC3"] == "mlx5_3" and devices["NIC4"] is None


@pytest.mark.parametrize(
    ("preset", "cpus"),
    [("hgx-h100", "GPU4-7 (NUMA 1): 56-111,168-223"), ("dgx-a100", "GPU4-5 (NUMA 7): 112-127,240-255")],
)
def test_the_link_matrix_fits_80_columns_with_the_cpus_on_their_own_lines(
    run_cli: RunCli, preset: str, cpus: str
) -> None:
    # the CPU lists were a matrix column that wrapped inside each row at 80 columns (issue 38 item 4)
    result = run_cli("topo", "show", "--preset", preset)  # captured output: Rich's 80 columns
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    rows = [line for line in lines if line.startswith("GPU")]
    assert len(rows) == 8 and all(line.rstrip().endswith("nv0") for line in rows)  # one line per GPU, whole
    assert f"  {cpus}" in lines
