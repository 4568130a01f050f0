"""The NCCL log reader against every captured log in tests/data/fixtures/nccl (figures from its README)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import FIXTURES
from toposched.errors import InputError
from toposched.sidecar import nccl
from toposched.sidecar.nccl import family_of, read_nccl_file, read_nccl_log
from toposched.sidecar.nccl_report import NcclReport

NCCL = FIXTURES / "nccl"

# file prefix -> (nranks, nnodes, transports, gdrdma, findings that must be there, findings that must not)
EXPECTED: dict[str, tuple[int, int | None, list[str], bool, set[str], set[str]]] = {
    "01_": (4, None, ["P2P/CUMEM", "SHM"], False, {"shm_transport"}, {"p2p_disabled", "spans_nodes"}),
    "03_": (
        8,
        4,
        ["COLLNET", "NET/IB", "P2P/CUMEM"],
        True,
        {"collnet_fallback", "spans_nodes"},
        {"gdrdma_off", "net_socket", "intra_node_network"},
    ),
    "04_": (8, None, ["NVLS", "P2P/direct"], False, set(), {"nvls_unavailable", "net_socket", "spans_nodes"}),
    "06_": (16, None, ["NET/Socket", "P2P/IPC"], False, {"net_socket", "spans_nodes"}, {"intra_node_network"}),
    "08_": (16, None, ["NET/AWS Libfabric", "P2P/IPC"], True, {"spans_nodes"}, {"gdrdma_off", "net_socket"}),
    "10_": (2, 1, ["SHM"], False, {"p2p_disabled", "skipped_records"}, {"spans_nodes", "intra_node_network"}),
    "11_": (2, 1, ["P2P/CUMEM"], False, {"skipped_records"}, {"p2p_disabled", "shm_transport", "spans_nodes"}),
    "12_": (2, None, ["NET/Socket"], False, {"net_socket", "spans_nodes"}, {"gdrdma_off"}),
}


def _fixture(prefix: str) -> Path:
    (path,) = NCCL.glob(prefix + "*")
    return path


def test_every_fixture_has_expected_figures() -> None:
    names = sorted(p.name[:3] for p in NCCL.iterdir())
    assert names == sorted(EXPECTED), "a new NCCL fixture needs its figures here"


@pytest.mark.parametrize("prefix", sorted(EXPECTED))
def test_fixture_figures(prefix: str) -> None:
    nranks, nnodes, transports, gdrdma, present, absent = EXPECTED[prefix]
    report = read_nccl_file(_fixture(prefix))
    data = report.to_json()
    assert data["nranks"] == nranks
    assert data["nnodes"] == nnodes
    assert data["transports"] == transports
    assert data["gdrdma"] is gdrdma
    codes = report.finding_codes()
    assert present <= codes, codes
    assert not absent & codes, codes


def test_fixture_details() -> None:
    r01 = read_nccl_file(_fixture("01_"))
    assert r01.nranks_source == "connections" and r01.hosts == ("dbaaa2700fd2",)
    assert {(c.src, c.dst) for c in r01.connections if c.family == "SHM"} == {(3, 0), (1, 2)}
    r03 = read_nccl_file(_fixture("03_"))
    assert r03.nccl_version == "2.23.4" and r03.hosts == ("gpu34", "gpu36", "gpu40", "gpu41")
    proxy = [c for c in r03.connections if c.transport == "NET/IBext_v8/5(2)/GDRDMA"]
    assert proxy and all(c.family == "NET/IB" and c.gdrdma for c in proxy)
    r04 = read_nccl_file(_fixture("04_"))
    assert r04.nccl_version == "2.18.3" and r04.nvls and len(r04.connections) == 240
    assert {c.transport for c in r04.connections} == {"P2P/direct pointer"}
    r08 = read_nccl_file(_fixture("08_"))
    assert r08.nranks_source == "ring" and r08.ranks == tuple(range(16))
    assert r08.hosts == ("nccl-tests-efa-worker-0", "nccl-tests-efa-worker-1")
    r10 = read_nccl_file(_fixture("10_"))
    assert r10.nccl_version == "2.28.9" and r10.hosts == ("proxmox",)  # the spliced "0.000proxmox" is repaired
    assert len([c for c in r10.connections if c.family == "SHM"]) == 4
    assert len(r10.communicators) == 2 and all(c["nranks"] == 2 for c in r10.communicators)
    r11 = read_nccl_file(_fixture("11_"))
    assert [c.transport for c in r11.connections] == ["P2P/CUMEM"] * 4
    r12 = read_nccl_file(_fixture("12_"))
    assert [c.kind for c in r12.connections] == ["Ring", "Ring"] and r12.nccl_version is None


@pytest.mark.parametrize(
    ("token", "family", "gdr"),
    [
        ("P2P/CUMEM/read", "P2P/CUMEM", False),
        ("P2P/direct pointer", "P2P/direct", False),
        ("P2P/IPC/read", "P2P/IPC", False),
        ("P2P/MNNVL", "P2P/MNNVL", False),
        ("SHM/direct/direct", "SHM", False),
        ("NET/IBext_v8/5(2)/GDRDMA", "NET/IB", True),
        ("NET/IB/0", "NET/IB", False),
        ("NET/IB/3/GDRDMA/Shared", "NET/IB", True),
        ("NET/AWS Libfabric/0/GDRDMA", "NET/AWS Libfabric", True),
        ("NET/Socket/0", "NET/Socket", False),
        ("NET/Socket/0/Shared", "NET/Socket", False),
        ("COLLNET/SHARP/1/GDRDMA", "COLLNET", True),
    ],
)
def test_transport_families(token: str, family: str, gdr: bool) -> None:
    assert family_of(token) == (family, gdr)


def test_spliced_token_is_not_read() -> None:
    assert family_of("NET/IB/0/GDR(Worker_TP0") is None


LINE = "host1:10:11 [0] NCCL INFO "


def _log(*bodies: str, host: str = "host1") -> str:
    return "".join(f"{host}:10:11 [0] NCCL INFO {b}\n" for b in bodies)


def test_remarks_timestamps_and_blank_lines() -> None:
    text = (
        "2025-01-02T03:04:05.123Z " + LINE + "comm 0x1 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0\n"
        "\n\n"
        "[2025-01-02 03:04:06] " + LINE + "Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read   <-- NVLink, good\n"
        "   \n" + LINE + "Channel 01/0 : 0[0] -> 1[1] via P2P/IPC/read # user: fast\n"
    )
    report = read_nccl_log(text)
    assert report.transports == ("P2P/IPC",) and len(report.connections) == 2
    assert (report.nranks, report.nnodes) == (2, 1)


def test_intra_node_socket_and_no_gdr() -> None:
    text = _log(
        "comm 0x1 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0",
        "Channel 00/0 : 1[1] -> 0[0] [receive] via NET/Socket/0",
        "Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0",
    )
    codes = read_nccl_log(text).finding_codes()
    assert {"intra_node_network", "gdrdma_off"} <= codes
    assert "net_socket" not in codes and "spans_nodes" not in codes


def test_nvls_unavailable_on_nvswitch() -> None:
    text = _log(
        "comm 0x1 rank 0 nRanks 8 nNodes 1 localRanks 8 localRank 0 MNNVL 0",
        "NVLS multicast support is not available on dev 0 (NVLS_NCHANNELS 0)",
        "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
    )
    assert "nvls_unavailable" in read_nccl_log(text, nvswitch=True).finding_codes()
    assert "nvls_unavailable" not in read_nccl_log(text, nvswitch=False).finding_codes()
    named = "#  Rank  0 Group  0 Pid 1 on h device  0 [0x0f] NVIDIA H100 80GB HBM3\n" + text
    assert "nvls_unavailable" in read_nccl_log(named).finding_codes()


def test_nnodes_wrong_on_one_host() -> None:
    text = _log(
        "comm 0x1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0",
        "Channel 00/0 : 1[1] -> 0[0] [receive] via NET/Socket/0",
    ) + _log(
        "comm 0x2 rank 1 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0",
        "Channel 00/0 : 0[0] -> 1[1] [receive] via NET/Socket/0",
    )
    report = read_nccl_log(text)
    assert report.nnodes == 2
    assert {"nnodes_mismatch", "intra_node_network"} <= report.finding_codes()


def test_mnnvl() -> None:
    text = _log("Channel 00/0 : 0[0] -> 5[1] via P2P/MNNVL", "comm 0x1 rank 0 nRanks 8 nNodes 2 MNNVL 1")
    report = read_nccl_log(text)
    assert report.transports == ("P2P/MNNVL",) and "mnnvl" in report.finding_codes()


@pytest.mark.parametrize(
    "content",
    [b"", b"   \n\n", bytes(range(256)) * 20, b"just some text\nno nccl here\n"],
    ids=["empty", "blank", "binary", "text"],
)
def test_not_nccl(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.log"
    path.write_bytes(content)
    with pytest.raises(InputError) as info:
        read_nccl_file(path)
    assert "not an NCCL log" in str(info.value) and "\n" not in str(info.value)


def test_topo_matrix_is_not_nccl() -> None:
    with pytest.raises(InputError, match="no NCCL INFO/WARN records"):
        read_nccl_file(FIXTURES / "topo" / "04_8x-h100-nv18-no-gpunumaid.txt")


TEXTS = {p.name: p.read_text(errors="replace") for p in sorted(NCCL.iterdir())}


def _check_invariants(data: dict[str, Any]) -> None:
    assert data["transports"] == sorted(data["transports"])
    assert data["nranks"] is None or data["nranks"] >= 1
    assert isinstance(data["gdrdma"], bool)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(TEXTS)), start=st.integers(0, 40_000), length=st.integers(0, 40_000))
def test_random_truncations_never_crash(name: str, start: int, length: int) -> None:
    text = TEXTS[name][start : start + length]
    try:
        report = read_nccl_log(text)
    except InputError:
        return
    _check_invariants(report.to_json())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    a=st.sampled_from(sorted(TEXTS)),
    b=st.sampled_from(sorted(TEXTS)),
    cuts=st.lists(st.integers(0, 120_000), min_size=1, max_size=12),
)
def test_random_interleavings_never_crash(a: str, b: str, cuts: list[int]) -> None:
    left, right = TEXTS[a], TEXTS[b]
    pieces: list[str] = []
    i = j = 0
    for n, cut in enumerate(sorted(cuts)):
        if n % 2 == 0:
            pieces.append(left[i:cut])
            i = max(i, cut)
        else:
            pieces.append(right[j:cut])
            j = max(j, cut)
    pieces.append(left[i:] + right[j:])
    try:
        report = read_nccl_log("".join(pieces))
    except InputError:
        return
    _check_invariants(report.to_json())


def test_interleaving_keeps_complete_records() -> None:
    one = "h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via NET/IB/0/GDRDMA\n"
    two = "h:2:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct\n"
    spliced = one[:40] + two + one[40:]  # the cut record's tail lands on a line of its own
    report = read_nccl_log(spliced)
    assert report.transports == ("SHM",) and report.skipped_records == 1 and not report.gdrdma


# ---------------------------------------------------------------------------------- hostile input

FIXTURE_03 = TEXTS["03_4node-2gpu-a100-ib-gdrdma-collnet-fallback.log"]
RECORDS_03 = [line for line in FIXTURE_03.splitlines() if " NCCL INFO " in line]


def _cpu(text: str) -> tuple[float, NcclReport]:
    start = time.process_time()
    report = read_nccl_log(text)
    return time.process_time() - start, report


def test_long_remark_line_is_linear() -> None:
    # A real connection line with an 80 kB remark: the old header search took 22 s (quadratic).
    line = next(x for x in RECORDS_03 if " via NET/" in x)
    seconds, report = _cpu(line + " " + "x" * 80_000 + "\n")
    assert len(report.connections) == 1 and report.connections[0].family == "NET/IB"
    assert seconds < 2.0  # ~0.002 s expected: a bound against hangs, not a benchmark


def test_spliced_records_on_one_long_line() -> None:
    # Real records glued into one 80 kB line: every record but the last was cut, so only it is read.
    glued = " ".join(RECORDS_03 * (80_000 // len(FIXTURE_03) + 1))
    seconds, report = _cpu(glued + "\n")
    assert report.records == 1 and report.skipped_records >= len(RECORDS_03)
    assert seconds < 2.0


def _big_log(size: int) -> tuple[str, int]:
    """Fixture 03 repeated to ``size`` bytes, each copy from other hosts, all on one node (nNodes 1)."""
    copies: list[str] = []
    total = 0
    while total < size:
        copy = FIXTURE_03.replace("nNodes 4", "nNodes 1").replace("gpu", f"c{len(copies)}-gpu")
        copies.append(copy)
        total += len(copy)
    return "".join(copies), len(copies)


def test_ten_megabyte_log_is_linear() -> None:
    # The old reader was quadratic in hosts (pairwise suffix checks) and in intra-node network
    # connections (list membership): a 10 MB log never finished.
    (small, _), (big, copies) = _big_log(2_500_000), _big_log(10_000_000)
    t_small, _ = _cpu(small)
    t_big, report = _cpu(big)
    one = read_nccl_log(FIXTURE_03)
    assert len(report.connections) == copies * len(one.connections)
    assert len(report.hosts) == copies * len(one.hosts)
    assert "intra_node_network" in report.finding_codes()
    assert t_big < 20.0  # ~1.5 s expected: a bound against hangs
    assert t_big / max(t_small, 0.05) < 8  # 4x the input: ~4x the time; quadratic would be ~16x


def test_host_repair_takes_the_longest_more_frequent_suffix() -> None:
    text = (
        _log("Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read", host="node1") * 3
        + _log("Channel 01/0 : 0[0] -> 1[1] via P2P/IPC/read", host="de1") * 5
        + _log("Channel 02/0 : 0[0] -> 1[1] via P2P/IPC/read", host="0.000node1")
        + _log("Channel 03/0 : 0[0] -> 1[1] via P2P/IPC/read", host="x" * 300 + "node1")
    )
    report = read_nccl_log(text)
    assert report.hosts == ("de1", "node1")  # "0.000node1" -> node1 (longer than de1), as is the 305-char one


def test_log_over_the_bound_is_refused_with_a_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccl, "MAX_LOG_BYTES", 1000)
    path = tmp_path / "job.log"
    path.write_text(FIXTURE_03)
    with pytest.raises(InputError) as info:
        read_nccl_file(path)
    assert "at most 1,000" in str(info.value) and "grep NCCL" in (info.value.fix or "")


def test_special_file_is_refused() -> None:
    with pytest.raises(InputError, match="not a regular file"):
        read_nccl_file("/dev/zero")


def test_bad_utf8_is_replaced_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    path.write_bytes(FIXTURE_03.encode()[:5000] + b"\xe2\x82" + FIXTURE_03.encode()[5000:])  # a cut character
    assert read_nccl_file(path).nranks == 8


def _mutate(rng: random.Random, text: str) -> str:
    i = rng.randrange(len(text) + 1)
    op = rng.randrange(6)
    if op == 0:
        return text[:i]
    if op == 1:
        return text[:i] + rng.choice(["\x00", "\x1b[31m", "\ufffd", "\r", ":1:2 [0] NCCL INFO "]) + text[i:]
    if op == 2:
        return text[:i] + text[i : i + 200] * rng.randrange(2, 50) + text[i:]
    if op == 3:
        j = rng.randrange(len(text) + 1)
        return text[:i] + text[j:]
    if op == 4:
        return text[:i] + "a" * rng.choice([1_000, 50_000]) + text[i:]
    return text[:i] + chr(rng.randrange(32, 0x2FF)) + text[i + 1 :]


def test_seeded_mutations_only_raise_input_errors() -> None:
    rng = random.Random(13)  # a quick seeded pass; tests/fuzz runs the long hypothesis search
    names = sorted(TEXTS)
    for _ in range(100):
        text = TEXTS[rng.choice(names)]
        for _ in range(rng.randrange(1, 4)):
            text = _mutate(rng, text)
        try:
            report = read_nccl_log(text)
        except InputError:
            continue
        _check_invariants(report.to_json())
