"""Topology sources read files through toposched.inputs: bounded, regular files, strict UTF-8."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from toposched.errors import InputError, TopologyParseError
from toposched.topology import sources
from toposched.topology.sources import SourceRef, load_source

CAPTURE = FIXTURES / "topo" / "16_8x-a100sxm4-80g-nv12-8nic-roce.txt"


def _smi(path: str | Path) -> sources.Loaded:
    return load_source(SourceRef(kind="smi", ref=str(path)))


def test_capture_loads() -> None:
    loaded = _smi(CAPTURE)
    assert loaded.cluster.gpu_count == 8 and loaded.warnings == ()
    assert [nic.device for nic in loaded.cluster.nodes[0].nics] == [f"mlx5_{i}" for i in range(8)]


def test_special_file_is_refused_without_reading() -> None:
    with pytest.raises(InputError, match="not a regular file") as info:
        _smi("/dev/zero")
    assert str(info.value).startswith("topology file '/dev/zero'")


def test_capture_over_the_bound_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "MAX_SMI_BYTES", 1000)
    with pytest.raises(InputError, match="at most 1,000 are read"):
        _smi(CAPTURE)


@pytest.mark.parametrize(
    ("content", "error", "phrase"),
    [
        (b"\xff\xfe GPU0", InputError, "not UTF-8"),
        (CAPTURE.read_bytes().replace(b"GPU1", b"GPU\x001", 1), TopologyParseError, "NUL byte"),
    ],
)
def test_damaged_bytes_are_one_line_errors(tmp_path: Path, content: bytes, error: type[Exception], phrase: str) -> None:
    path = tmp_path / "topo.txt"
    path.write_bytes(content)
    with pytest.raises(error) as info:
        _smi(path)
    assert phrase in str(info.value) and "\n" not in str(info.value)


def test_nul_in_the_path_is_an_input_error() -> None:
    with pytest.raises(InputError, match="cannot contain a NUL byte"):
        _smi("topo\x00.txt")


def test_spec_passes_on_the_warnings_of_its_captures(tmp_path: Path) -> None:
    text = CAPTURE.read_text()
    (tmp_path / "cut.txt").write_text(text[: text.index("NIC4: mlx5_4")])
    spec = tmp_path / "spec.yaml"
    spec.write_text("nodes:\n  - {name: 'a100-{i}', count: 2, smi: cut.txt}\n")
    loaded = load_source(SourceRef(kind="cluster", ref=str(spec)))
    assert len(loaded.warnings) == 1  # one per capture file, not per node it stamps out
    assert "cut.txt" in loaded.warnings[0] and "no entry for NIC4, NIC5, NIC6, NIC7" in loaded.warnings[0]


P2P_OK = FIXTURES / "p2p" / "03_3gpu-5070-2x5060ti-p2p-ansi-tabs.txt"
PHB3 = FIXTURES / "topo" / "24_3gpu-5070-2x5060ti-phb-raw-ansi-tabs.txt"


def test_p2p_capture_rides_with_a_one_node_source() -> None:
    loaded = load_source(SourceRef(kind="smi", ref=str(PHB3), p2p=str(P2P_OK)))
    assert [link.p2p for link in loaded.cluster.nodes[0].links] == [True, True, True]
    assert loaded.source.p2p == str(P2P_OK.resolve()) and loaded.source.describe().endswith(f"+ p2p:{P2P_OK.resolve()}")
    again = load_source(loaded.source)  # what `topo refresh` does with the stored reference
    assert again.cluster == loaded.cluster
    # a reference stored before P2P existed still reads
    assert SourceRef.model_validate_json('{"kind": "preset", "ref": "dgx-a100"}').p2p == ""


def test_p2p_capture_errors_name_the_capture(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="a P2P capture describes one node, but preset:gb200-nvl72 has 18"):
        load_source(SourceRef(kind="preset", ref="gb200-nvl72", p2p=str(P2P_OK)))
    with pytest.raises(InputError, match=r"P2P capture .*missing\.txt.* does not exist"):
        load_source(SourceRef(kind="smi", ref=str(PHB3), p2p=str(tmp_path / "missing.txt")))
    bad = tmp_path / "p2p.txt"
    bad.write_text("\tGPU0\tGPU1\tGPU2\n GPU0\tX\tOK\tOK\n GPU1\tOK\tX\n")
    with pytest.raises(TopologyParseError, match=r"p2p\.txt, line 3: row GPU1 has 2 cells for 3 GPU columns"):
        load_source(SourceRef(kind="smi", ref=str(PHB3), p2p=str(bad)))
