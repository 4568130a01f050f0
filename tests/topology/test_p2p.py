"""``nvidia-smi topo -p2p`` captures: every real fixture, hostile input, and what the P2P status does
to a node's links and to the PCIe all-reduce table a TP group gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, RunCli
from toposched.errors import InputError, TopologyParseError
from toposched.perf.links import NO_P2P_LINK, pcie_link
from toposched.topology.model import Link, LinkKind
from toposched.topology.p2p import P2PStatus, apply_p2p, parse_p2p_matrix, read_p2p_file, set_p2p
from toposched.topology.presets import preset_node
from toposched.topology.smi import parse_topo_matrix

P2P = FIXTURES / "p2p"
OK, GNS = P2PStatus.OK, P2PStatus.GNS


@pytest.mark.parametrize(
    ("name", "gpus", "cell"),
    [
        ("01_2x-rtx3090-nvlink-p2p-ok.txt", 2, OK),  # spaces, 1 leading space on row labels
        ("02_2x-rtx5090-p2p-rw-gns-tabs.txt", 2, GNS),  # tabs, trailing tab, legend without final newline
        ("03_3gpu-5070-2x5060ti-p2p-ansi-tabs.txt", 3, OK),  # ANSI underline header, legend without DR
        ("04_5gpu-consumer-p2p-ansi-tabs-runA.txt", 5, OK),
        ("05_5gpu-consumer-p2p-ansi-tabs-runB.txt", 5, OK),
    ],
)
def test_every_fixture(name: str, gpus: int, cell: P2PStatus) -> None:
    matrix = read_p2p_file(P2P / name)
    assert matrix.gpus == tuple(range(gpus))
    assert dict(matrix.status) == {(a, b): cell for a in range(gpus) for b in range(gpus) if a != b}
    assert matrix.refused() == ([(0, 1)] if cell is GNS else [])
    assert matrix.pair(1, 0) is (cell is OK)


def test_every_fixture_file_is_covered() -> None:
    assert len(list(P2P.iterdir())) == 5


def _bad(text: str) -> TopologyParseError:
    with pytest.raises(TopologyParseError) as info:
        parse_p2p_matrix(text, source="cap.txt")
    return info.value


@pytest.mark.parametrize(
    ("text", "line", "phrase"),
    [
        ("", None, "the input is empty"),
        ("\n \t\n", None, "the input is empty"),
        ("Legend:\n  OK = Status Ok\n", None, "no `nvidia-smi topo -p2p` header"),
        (
            "\tGPU0\tGPU1\n GPU0\tX\tOK\n GPU1\tOK\n",
            3,
            "row GPU1 has 1 cells for 2 GPU columns; the matrix is not square",
        ),
        ("\tGPU0\tGPU1\n GPU0\tX\tOK\tOK\n", 2, "row GPU0 has 3 cells for 2 GPU columns"),
        ("\tGPU0\tGPU1\n GPU0\tX\tOK\n GPU1\tOK\tX\n GPU2\tOK\tOK\tX\n", 4, "row GPU2 comes after the last row"),
        ("\tGPU0\tGPU1\n GPU0\tX\tOK\n", 3, "expected the row of GPU1 but the matrix ends (1 of 2 rows read)"),
        ("\tGPU0\tGPU1\n GPU0\tX\tOK", 2, "expected the row of GPU1 but the matrix ends"),
        ("\tGPU0\tGPU1\n GPU0\tX\tYES\n GPU1\tOK\tX\n", 2, "'YES' is not a P2P status (known: OK, CNS, GNS"),
        ("\tGPU0\tGPU1\n GPU0\tX\tok\n GPU1\tOK\tX\n", 2, "'ok' is not a P2P status"),
        ("\tGPU0\tGPU0\n GPU0\tX\tOK\n", 1, "GPU0 appears twice in the header"),
        ("\tGPU0\tGPU1\n GPU0\tX\tOK\n GPU0\tOK\tX\n", 3, "expected the row of GPU1 but found 'GPU0' again"),
        ("\tGPU0\tGPU1\n GPU1\tOK\tX\n GPU0\tX\tOK\n", 2, "expected the row of GPU0 but found 'GPU1' again"),
        ("\tGPU0\tGPU1\n GPU0\tOK\tOK\n GPU1\tOK\tX\n", 2, "the diagonal cell is 'OK', expected 'X'"),
        ("\tGPU0\tGPU1\n GPU0\tX\tX\n GPU1\tOK\tX\n", 2, "'X' is not a P2P status"),
        ("\tGPU0\tGPU1\n GPU0\tX\tOK\n\n GPU1\tOK\tX\n", 3, "expected the row of GPU1 but the matrix ends"),
        ("\tGPU0\tNIC0\n GPU0\tX\tOK\n", 1, "this is `nvidia-smi topo -m` output"),
        ("\tGPU0\tGPU1\tFOO\n GPU0\tX\tOK\tOK\n", 1, "header column 'FOO' is not a GPU"),
        ("\tGPU0\tGPU1\n GPU0\tX\tPIX\n GPU1\tPIX\tX\n", 2, "(a `topo -m` path: pass `nvidia-smi topo -p2p r` output)"),
        ("\tGPU0\tGPU1\tCPU Affinity\n GPU0\tX\tPIX\t0-7\n", 1, "this is `nvidia-smi topo -m` output"),
        ("GPU0\tX\tOK\n", 1, "expected the header (GPU0 GPU1 ...) but found a row"),
        ("\tGPU0\tGPU1\n GPU0\tX\tOK\n GPU1\tOK\tX\x00\n", 3, "contains a NUL byte"),
    ],
)
def test_hostile_input_fails_naming_the_file_and_line(text: str, line: int | None, phrase: str) -> None:
    err = _bad(text)
    assert phrase in str(err)
    assert err.line == line and err.source == "cap.txt"
    assert str(err).startswith("cap.txt" + (f", line {line}" if line is not None else ""))
    assert "\n" not in str(err)


def test_real_topo_m_capture_is_named() -> None:
    text = (FIXTURES / "topo" / "24_3gpu-5070-2x5060ti-phb-raw-ansi-tabs.txt").read_text()
    assert "this is `nvidia-smi topo -m` output" in str(_bad(text))


def test_too_many_columns_is_refused() -> None:
    header = "\t".join(f"GPU{i}" for i in range(513))
    assert "513 columns (at most 512" in str(_bad(header + "\n"))


def test_asymmetric_and_unknown_pairs() -> None:
    text = " \tGPU0\tGPU1\tGPU2\n GPU0\tX\tOK\tU\n GPU1\tDR\tX\tOK\n GPU2\tU\tOK\tX\n"
    matrix = parse_p2p_matrix(text)
    assert matrix.pair(0, 1) is False  # refused one way: off
    assert matrix.pair(0, 2) is None  # unknown both ways
    assert matrix.pair(1, 2) is True
    assert matrix.refused() == [(0, 1)]


def test_prompt_lines_before_the_header_are_skipped() -> None:
    text = "user@box:~$ nvidia-smi topo -p2p r\n \tGPU0\tGPU1\n GPU0\tX\tNS\n GPU1\tNS\tX\n"
    assert parse_p2p_matrix(text).refused() == [(0, 1)]


def test_capture_applies_to_the_topology_of_the_same_node() -> None:
    topo = parse_topo_matrix((FIXTURES / "topo" / "24_3gpu-5070-2x5060ti-phb-raw-ansi-tabs.txt").read_text()).node
    assert all(link.p2p is None and link.kind is LinkKind.PHB for link in topo.links)
    node = apply_p2p(topo, read_p2p_file(P2P / "03_3gpu-5070-2x5060ti-p2p-ansi-tabs.txt"))
    assert [link.p2p for link in node.links] == [True, True, True] and node.peer_to_peer([0, 1, 2])
    off = apply_p2p(
        topo, parse_p2p_matrix(" \tGPU0\tGPU1\tGPU2\n GPU0\tX\tOK\tCNS\n GPU1\tOK\tX\tOK\n GPU2\tOK\tOK\tX\n")
    )
    assert not off.peer_to_peer([0, 1, 2]) and off.peer_to_peer([0, 1]) and off.peer_to_peer([1, 2])
    with pytest.raises(InputError, match=r"lists GPUs 0,1,2,3,4 but node .* has GPUs 0,1,2"):
        apply_p2p(topo, read_p2p_file(P2P / "04_5gpu-consumer-p2p-ansi-tabs-runA.txt"))


def test_peer_to_peer_rule() -> None:
    def link(kind: LinkKind, p2p: bool | None) -> Link:
        return Link(a=0, b=1, kind=kind, bandwidth_gbps=20.0, latency_us=5.0, p2p=p2p)

    assert link(LinkKind.PHB, None).peer_to_peer  # unknown inside one socket: on
    assert link(LinkKind.PIX, True).peer_to_peer
    assert not link(LinkKind.PIX, False).peer_to_peer  # reported refused
    assert not link(LinkKind.SYS, None).peer_to_peer  # across sockets
    assert not link(LinkKind.SYS, True).peer_to_peer


def test_l40s_preset_gets_the_p2p_on_table_unless_told_otherwise() -> None:
    box = preset_node("l40s-8x-pcie")  # two sockets, GPUs 0-3 and 4-7
    assert pcie_link("pcie4", peer_to_peer=box.peer_to_peer([0, 1])) == "pcie4"
    assert pcie_link("pcie4", peer_to_peer=box.peer_to_peer([0, 1, 2, 3])) == "pcie4"
    assert pcie_link("pcie4", peer_to_peer=box.peer_to_peer(range(8))) == NO_P2P_LINK  # crosses sockets
    off = set_p2p(box, False)
    assert pcie_link("pcie4", peer_to_peer=off.peer_to_peer([0, 1])) == NO_P2P_LINK
    assert pcie_link("pcie5", peer_to_peer=False) == NO_P2P_LINK and pcie_link("pcie5", peer_to_peer=True) == "pcie5"


def test_cli_show_reads_the_capture_beside_the_smi_file(run_cli: RunCli) -> None:
    smi = str(FIXTURES / "topo" / "24_3gpu-5070-2x5060ti-phb-raw-ansi-tabs.txt")
    result = run_cli(
        "topo", "show", "--smi", smi, "--p2p", str(P2P / "03_3gpu-5070-2x5060ti-p2p-ansi-tabs.txt"), "--json"
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert [link["p2p"] for link in data["links"]] == [True, True, True] and "+ p2p:" in data["source"]
    human = run_cli("topo", "show", "--smi", smi, "--p2p", str(P2P / "03_3gpu-5070-2x5060ti-p2p-ansi-tabs.txt"))
    assert "peer-to-peer OK on all 3 GPU pairs" in human.stdout
    mismatch = run_cli("topo", "show", "--smi", smi, "--p2p", str(P2P / "02_2x-rtx5090-p2p-rw-gns-tabs.txt"))
    assert mismatch.exit_code == 2 and "lists GPUs 0,1 but node" in mismatch.stderr
    assert "Traceback" not in mismatch.stderr


def test_cli_p2p_needs_a_source(run_cli: RunCli, tmp_path: Path) -> None:
    result = run_cli(
        "topo", "show", "--p2p", str(P2P / "01_2x-rtx3090-nvlink-p2p-ok.txt"), "--state", str(tmp_path / "s")
    )
    assert result.exit_code == 2 and "--p2p adds peer-to-peer status to a topology source" in result.stderr


def test_refresh_keeps_the_capture_in_the_stored_source(run_cli: RunCli, tmp_path: Path) -> None:
    smi = str(FIXTURES / "topo" / "24_3gpu-5070-2x5060ti-phb-raw-ansi-tabs.txt")
    capture = tmp_path / "p2p.txt"
    capture.write_text(" \tGPU0\tGPU1\tGPU2\n GPU0\tX\tOK\tDR\n GPU1\tOK\tX\tOK\n GPU2\tDR\tOK\tX\n")
    state = f"sqlite:{tmp_path / 'state.db'}"
    first = run_cli("topo", "refresh", "--smi", smi, "--p2p", str(capture), "--state", state, "--json")
    assert first.exit_code == 0, first.stderr
    again = run_cli("topo", "refresh", "--state", state, "--json")  # the stored source, capture included
    assert again.exit_code == 0 and json.loads(again.stdout)["changed"] is False
    shown = run_cli("topo", "show", "--state", state)
    assert "peer-to-peer refused on 1 of 3 GPU pairs: 0-2" in shown.stdout
