"""The nvidia-smi topo -m reader against every real capture in tests/data/fixtures/topo."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from toposched.errors import TopologyParseError
from toposched.topology.domains import build_domain_map
from toposched.topology.model import Cluster, LinkKind, Node
from toposched.topology.smi import MAX_DEVICES, parse_topo_matrix

TOPO = FIXTURES / "topo"
EIGHT = list(range(8))


@dataclass(frozen=True)
class Expect:
    domains: list[list[int]]
    numa: list[int | None]
    lanes: int | None = None  # NV# on every NVLink pair, when uniform
    pairs: dict[tuple[int, int], str] = field(default_factory=dict)  # spot checks: (a, b) -> cell
    nics: dict[str, str | None] = field(default_factory=dict)  # NIC column -> device
    nic_paths: dict[tuple[int, str], str] = field(default_factory=dict)  # (gpu, nic) -> kind
    hostname: str = "localhost"
    warn: tuple[str, ...] = ()  # one substring per warning the reader must give (and no other warning)


# Transcribed from tests/data/fixtures/README.md ("correct interpretation").
EXPECT: dict[str, Expect] = {
    "02_2x-rtx5090-phb-tabs.txt": Expect([], [0, 0], pairs={(0, 1): "PHB"}),
    "03_1x-h100pcie-kvm-1nic.txt": Expect([], [0], nics={"NIC0": "mlx5_0"}, nic_paths={(0, "NIC0"): "PHB"}),
    "04_8x-h100-nv18-no-gpunumaid.txt": Expect([EIGHT], [0, 0, 0, 0, 1, 1, 1, 1], lanes=18),
    "05_4x-rtx6000ada-4nic-2numa.txt": Expect(
        [],
        [0, 0, 1, 1],
        pairs={(0, 1): "NODE", (2, 3): "NODE", (0, 2): "SYS", (0, 3): "SYS", (1, 2): "SYS", (1, 3): "SYS"},
        nics={f"NIC{i}": f"mlx5_{i}" for i in range(4)},
        nic_paths={
            (0, "NIC0"): "NODE",
            (1, "NIC1"): "NODE",
            (2, "NIC2"): "NODE",
            (3, "NIC3"): "NODE",
            (0, "NIC2"): "SYS",
        },
    ),
    "07_dgx1-v100-1nic-driver440.txt": Expect(
        [EIGHT],
        [None] * 8,
        pairs={
            (0, 1): "NV1",
            (0, 3): "NV2",
            (0, 4): "NV2",
            (1, 5): "NV2",
            (2, 6): "NV1",
            (3, 7): "NV1",
            (4, 7): "NV2",
            (5, 6): "NV2",
            (0, 5): "SYS",
            (1, 4): "SYS",
            (3, 6): "SYS",
        },
        nics={"mlx5_0": "mlx5_0"},
        nic_paths={(2, "mlx5_0"): "PIX", (3, "mlx5_0"): "PIX", (0, "mlx5_0"): "NODE", (4, "mlx5_0"): "SYS"},
    ),
    "08_azure-v100-hybridcube-vm-leftX.txt": Expect(
        [EIGHT],
        [0] * 8,
        pairs={
            (0, 1): "NV2",
            (0, 2): "NV1",
            (0, 3): "NV2",
            (0, 6): "NV1",
            (1, 7): "NV1",
            (2, 4): "NV2",
            (3, 5): "NV2",
            (6, 7): "NV2",
            (0, 4): "NODE",
            (1, 6): "NODE",
            (3, 7): "NODE",
        },
    ),
    "10_2x-rtx3090-nvlink-bridge-nv4.txt": Expect([[0, 1]], [0, 0], lanes=4),
    "12_4x-a100sxm4-nv4-2nic-nolegendheader.txt": Expect(
        [[0, 1, 2, 3]],
        [2, 2, 6, 6],
        lanes=4,
        nics={"NIC0": "mlx5_0", "NIC1": "mlx5_1"},
        nic_paths={(0, "NIC0"): "PXB", (1, "NIC0"): "PXB", (2, "NIC1"): "PXB", (3, "NIC1"): "PXB", (0, "NIC1"): "SYS"},
    ),
    "13_8x-a100-nv12-1nic-numa3157.txt": Expect(
        [EIGHT], [3, 3, 1, 1, 7, 7, 5, 5], lanes=12, nic_paths={(2, "mlx5_0"): "PXB", (3, "mlx5_0"): "PXB"}
    ),
    "15_8x-a100-nv12-3nic-4numa.txt": Expect([EIGHT], [0, 0, 1, 1, 2, 2, 3, 3], lanes=12),
    "16_8x-a100sxm4-80g-nv12-8nic-roce.txt": Expect(
        [EIGHT],
        [0, 0, 0, 0, 1, 1, 1, 1],
        lanes=12,
        nic_paths={(0, "NIC0"): "PXB", (0, "NIC1"): "PXB", (1, "NIC0"): "PXB", (6, "NIC6"): "PXB", (7, "NIC7"): "PXB"},
    ),
    "18_8x-h20-3e-nv18-2nic.txt": Expect(
        [EIGHT], [0, 0, 0, 0, 1, 1, 1, 1], lanes=18, nic_paths={(0, "NIC0"): "PIX", (0, "NIC1"): "PIX"}
    ),
    "21_8x-rtx4090-node-sys-with-prompt.txt": Expect(
        [], [0, 0, 0, 0, 1, 1, 1, 1], pairs={(0, 1): "NODE", (4, 7): "NODE", (0, 4): "SYS"}, hostname="CCT-8xRTX4090"
    ),
    "22_8x-a100-nv12-10nic-nps4-mangled.txt": Expect(
        [EIGHT],
        [3, 3, 1, 1, 7, 7, 5, 5],
        lanes=12,
        nics={f"NIC{i}": f"mlx5_{i}" for i in range(10)},
        nic_paths={(6, "NIC7"): "PXB", (6, "NIC8"): "SYS", (7, "NIC7"): "PXB", (0, "NIC9"): "SYS"},
    ),
    "24_3gpu-5070-2x5060ti-phb-raw-ansi-tabs.txt": Expect([], [0, 0, 0], pairs={(0, 1): "PHB", (1, 2): "PHB"}),
    "25_5gpu-consumer-phb-raw-ansi-tabs.txt": Expect([], [0] * 5, pairs={(0, 4): "PHB", (2, 3): "PHB"}),
    "28_8x-rtx4090-all-sys-2nic-tabs.txt": Expect(
        [],
        [0, 0, 0, 0, 1, 1, 1, 1],
        pairs={(0, 1): "SYS", (4, 5): "SYS", (0, 7): "SYS"},
        nic_paths={(6, "NIC0"): "PHB", (6, "NIC1"): "PHB", (7, "NIC0"): "SYS"},
        nics={"NIC0": None, "NIC1": None},
        warn=("no NIC Legend for NIC0, NIC1",),
    ),
    "30_slurm-2of8-a100-nv12-10nic-TRUNCATED.txt": Expect(
        [[0, 1]],
        [3, 3],
        lanes=12,
        nic_paths={(0, "NIC0"): "PXB", (1, "NIC1"): "PXB"},
        warn=("row NIC3 is cut", "no NIC Legend for NIC0, NIC1, NIC2, NIC3, NIC4, NIC5, NIC6, NIC7, NIC8, NIC9"),
    ),
    "34_2x-h100pcie-nvlink-bridge-nv12-indented6.txt": Expect([[0, 1]], [1, 1], lanes=12, hostname="dl380ag11"),
    "36_1x-gpu-cloud-vm-no-nic-no-legend.txt": Expect([], [0]),
}

# Truncated beyond recovery: (file, line, column or None, a phrase of the message).
FAIL: dict[str, tuple[int, str | None, str]] = {
    "20_8x-pcie-pix-pxb-numa-na-TRUNCATED.txt": (8, "GPU7", "row GPU6 has 7 of 8 link cells"),
    "32_dgx2-16x-v100-nv6-10nic-TRUNCATED.txt": (6, None, "row GPU4 ends the input"),
}


def _read(name: str) -> str:
    return (TOPO / name).read_bytes().decode()


def _cell(node: Node, a: int, b: int) -> str:
    link = node.link(a, b)
    assert link is not None
    return f"NV{link.nvlinks}" if link.kind is LinkKind.NVLINK else link.kind.value


def test_every_fixture_has_an_expectation() -> None:
    files = {p.name for p in TOPO.iterdir() if p.is_file()}
    assert files, f"no fixtures found under {TOPO}"
    assert files == set(EXPECT) | set(FAIL)


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_fixture_reads_as_documented(name: str) -> None:
    want = EXPECT[name]
    result = parse_topo_matrix(_read(name), source=name)
    node = result.node
    assert [g.index for g in node.gpus] == list(range(len(want.numa)))
    assert [g.numa_node for g in node.gpus] == want.numa
    dmap = build_domain_map(Cluster(nodes=(node,)))
    assert [[int(r.split("/")[1]) for r in d.gpus] for d in dmap.domains] == want.domains
    # every GPU pair is present exactly once
    n = len(node.gpus)
    assert len(node.links) == n * (n - 1) // 2
    if want.lanes is not None:
        nv = [link for link in node.links if link.kind is LinkKind.NVLINK]
        assert nv and all(link.nvlinks == want.lanes for link in nv)
    for (a, b), cell in want.pairs.items():
        assert _cell(node, a, b) == cell, (a, b)
    for nic, device in want.nics.items():
        assert {x.name: x.device for x in node.nics}[nic] == device
    paths = {(x.gpu, x.nic): x.kind.value for x in node.nic_links}
    for key, kind in want.nic_paths.items():
        assert paths[key] == kind, key
    assert node.name == want.hostname
    assert len(result.warnings) == len(want.warn), result.warnings
    for phrase in want.warn:
        assert any(phrase in w for w in result.warnings), (phrase, result.warnings)


def test_dgx1_cliques_are_the_quads_and_cross_pairs() -> None:
    node = parse_topo_matrix(_read("07_dgx1-v100-1nic-driver440.txt")).node
    (domain,) = build_domain_map(Cluster(nodes=(node,))).domains
    cliques = {tuple(int(r.split("/")[1]) for r in c) for c in domain.cliques}
    assert cliques == {(0, 1, 2, 3), (4, 5, 6, 7), (0, 4), (1, 5), (2, 6), (3, 7)}
    assert domain.kind == "mesh"
    assert domain.min_nvlinks == 1


def test_cpu_affinity_and_numa_text_are_kept() -> None:
    node = parse_topo_matrix(_read("04_8x-h100-nv18-no-gpunumaid.txt")).node
    assert node.gpu(0).cpu_affinity == "0-51,104-155"
    assert node.gpu(7).cpu_affinity == "52-103,156-207"
    assert node.gpu(7).numa_affinity == "1"


@pytest.mark.parametrize("name", sorted(FAIL))
def test_truncated_fixture_fails_cleanly(name: str) -> None:
    line, column, phrase = FAIL[name]
    with pytest.raises(TopologyParseError) as info:
        parse_topo_matrix(_read(name), source=name)
    err = info.value
    assert (err.line, err.column) == (line, column)
    assert phrase in str(err)
    assert "\n" not in str(err)


@pytest.mark.parametrize(
    ("numa_cell", "expected"),
    [("0", 0), ("12", 12), ("6-7", None), ("0,5-11", None), ("N/A", None), ("3-3", 3)],
)
def test_numa_cell_forms(numa_cell: str, expected: int | None) -> None:
    text = f"        GPU0    GPU1    CPU Affinity    NUMA Affinity\nGPU0     X      NV4     0-7     {numa_cell}\n"
    text += f"GPU1    NV4      X      0-7     {numa_cell}\n"
    node = parse_topo_matrix(text).node
    assert [g.numa_node for g in node.gpus] == [expected, expected]
    assert node.gpu(0).numa_affinity == numa_cell


def test_old_driver_soc_means_sys_and_glued_cells_split() -> None:
    text = (
        "\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tSOC\tPHB\t0-7\nGPU1\tSOCSOC\tSOC\t0-7\nGPU2\tPHB\tSOC\t X \t0-7\n"
    )
    # GPU1's row is glued: 'SOCSOC' reads as two cells, so SYS lands on its diagonal -> clean error
    with pytest.raises(TopologyParseError, match="row GPU1 has 'SYS' on the diagonal"):
        parse_topo_matrix(text)
    fixed = "\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tSOC\tPHB\t0-7\nGPU1\tSOC X\tSOC\t0-7\nGPU2\tPHBSOC X\t0-7\n"
    node = parse_topo_matrix(fixed).node
    assert _cell(node, 0, 1) == "SYS"
    assert _cell(node, 1, 2) == "SYS"
    assert _cell(node, 0, 2) == "PHB"


def test_empty_cpu_affinity_is_right_aligned_with_a_warning() -> None:
    # GB200 in a container prints no CPU set; NUMA and GPU NUMA ID are still there.
    text = (
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tNV18\t\t0\t\t2\n"
        "GPU1\tNV18\t X \t\t0\t\t10\n"
    )
    result = parse_topo_matrix(text)
    assert [g.numa_node for g in result.node.gpus] == [0, 0]
    assert all(g.cpu_affinity is None for g in result.node.gpus)
    assert any("no CPU Affinity" in w for w in result.warnings)


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("", "empty"),
        ("hello world\n", "no `nvidia-smi topo -m` header"),
        (
            "======================= ROCm System Management Interface =======================\n"
            "GPU0  GPU1\nGPU0  0  15\n",
            "rocm-smi",
        ),
        (
            "        GPU0    GPU1\n GPU0   X       OK\n GPU1   OK      X\n",
            "topo -p2p` output (cells such as OK/GNS; pass it as --p2p FILE)",
        ),
        ("Legend:\n  OK   = Status Ok\n  GNS  = GPU not supported\n", "topo -p2p` output (pass it as --p2p FILE)"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\nGPU1\tNV2\t X \t0-7\n", "not symmetric"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\tNV4\tNV4\t0-7\nGPU1\tNV4\t X \t0-7\n", "diagonal"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\tabc\nGPU1\tNV4\t X \t0-7\n", "not a valid CPU Affinity"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\t9\t9\nGPU1\tNV4\t X \t0-7\n", "affinity values"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU1\tNV4\t X \t0-7\nGPU0\t X \tNV4\t0-7\n", "expected the row of GPU0"),
    ],
)
def test_not_a_matrix_or_damaged(text: str, phrase: str) -> None:
    with pytest.raises(TopologyParseError, match=None) as info:
        parse_topo_matrix(text, source="x.txt")
    assert phrase in str(info.value)
    assert str(info.value).startswith("x.txt")


def test_fixture_dir_is_the_shared_one() -> None:
    # Guards against silently testing nothing when tests/data moves.
    assert Path(TOPO).is_dir()


# ---------------------------------------------------------------------------------- hostile input

SMALL = "\tGPU0\tGPU1\tNIC0\tCPU Affinity\nGPU0\t X \tNV4\tPIX\t0-7\nGPU1\tNV4\t X \tSYS\t0-7\nNIC0\tPIX\tSYS\t X \n"


def test_cut_nic_legend_names_the_nics_without_a_device() -> None:
    # Fixture 16 with its NIC Legend cut after NIC3: a launch would list 4 of 8 HCAs as if all.
    text = _read("16_8x-a100sxm4-80g-nv12-8nic-roce.txt")
    cut = text[: text.index("NIC4: mlx5_4")]
    result = parse_topo_matrix(cut, source="cut.txt")
    devices = {nic.name: nic.device for nic in result.node.nics}
    assert devices == {f"NIC{i}": f"mlx5_{i}" if i < 4 else None for i in range(8)}
    (warning,) = result.warnings
    assert "names 4 of 8 NICs and has no entry for NIC4, NIC5, NIC6, NIC7" in warning
    assert "NCCL_IB_HCA" in warning


@pytest.mark.parametrize(
    ("legend", "phrase"),
    [
        ("NIC0: mlx5_0;reboot\n", "NIC Legend device of NIC0 'mlx5_0;reboot' is not valid"),
        ("NIC0: $(id)\n", "is not valid"),
        ("NIC0: mlx5_0\nNIC0: mlx5_1\n", "names NIC0 twice"),
    ],
)
def test_bad_nic_legend_is_a_parse_error(legend: str, phrase: str) -> None:
    with pytest.raises(TopologyParseError) as info:
        parse_topo_matrix(SMALL + "\nNIC Legend:\n\n" + legend, source="x.txt")
    assert phrase in str(info.value) and "\n" not in str(info.value)


def test_nul_byte_in_the_header_is_a_parse_error() -> None:
    text = _read("16_8x-a100sxm4-80g-nv12-8nic-roce.txt").replace("GPU3", "GPU\x003", 1)
    with pytest.raises(TopologyParseError, match="NUL byte") as info:
        parse_topo_matrix(text, source="nul.txt")
    assert info.value.line == 1


@pytest.mark.parametrize("column", ["NIC0é", "mlx5_0\u200b", "eth0$x"])
def test_nic_column_that_is_not_one_word_is_a_parse_error(column: str) -> None:
    with pytest.raises(TopologyParseError):
        parse_topo_matrix(SMALL.replace("NIC0", column))


def test_too_many_columns_is_a_parse_error() -> None:
    header = "GPU0\t" + "\t".join(f"NIC{i}" for i in range(MAX_DEVICES)) + "\n"
    with pytest.raises(TopologyParseError, match=f"names {MAX_DEVICES + 1} GPU and NIC columns"):
        parse_topo_matrix(header)


def test_prompt_host_that_is_not_a_node_name_is_not_used() -> None:
    text = "me@gpu_box:~$ nvidia-smi topo -m\n" + SMALL + "NIC0: mlx5_0\n"
    result = parse_topo_matrix(text)
    assert result.node.name == "localhost"
    assert any("prompt's host is not used" in w for w in result.warnings)
    with pytest.raises(TopologyParseError, match="node name"):
        parse_topo_matrix(SMALL, hostname="bad host")


def test_long_lines_are_read_in_linear_time() -> None:
    # A long word before a prompt-like "topo" made the old prompt search quadratic (80 kB: 9.5 s).
    text = _read("16_8x-a100sxm4-80g-nv12-8nic-roce.txt")
    start = time.process_time()
    for junk in ("a" * 80_000 + " topo", "u@h:" * 20_000 + " nvidia-smi topo", "x GPU0" * 20_000):
        assert len(parse_topo_matrix(junk + "\n" + text).node.gpus) == 8
    assert time.process_time() - start < 3.0  # ~0.05 s expected: a bound against hangs


def _mutate(rng: random.Random, text: str) -> str:
    lines = text.split("\n")
    i = rng.randrange(len(lines))
    op = rng.randrange(7)
    if op == 0:
        return text[: rng.randrange(len(text) + 1)]
    if op == 1:
        del lines[i]
    elif op == 2:
        lines.insert(i, lines[i])
    elif op == 3:
        at = rng.randrange(len(text) + 1)
        return text[:at] + rng.choice(["\x00", "\x1b[4m", "\x1b[", "\t", "X", "NV", "#", ":", "\u00e9"]) + text[at:]
    elif op == 4:
        lines[i] = lines[i] * rng.randrange(2, 400)
    elif op == 5:
        at = rng.randrange(len(text) + 1)
        return text[:at] + chr(rng.randrange(32, 0x2FF)) + text[at + 1 :]
    else:
        lines[i] = lines[i].replace("mlx5_", rng.choice(["", "mlx5_;", "$(x)"]), 1)
    return "\n".join(lines)


def test_seeded_mutations_only_raise_parse_errors() -> None:
    rng = random.Random(13)  # a quick seeded pass; tests/fuzz runs the long hypothesis search
    names = sorted(EXPECT) + sorted(FAIL)
    for _ in range(400):
        text = _read(rng.choice(names))
        for _ in range(rng.randrange(1, 4)):
            text = _mutate(rng, text)
        try:
            result = parse_topo_matrix(text, source="m.txt")
        except TopologyParseError:
            continue
        assert len(result.node.links) == len(result.node.gpus) * (len(result.node.gpus) - 1) // 2


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV0\t0-7\nGPU1\tNV0\t X \t0-7\n", "'NV0' is not a count of 1 to 64"),
        (f"\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV{'9' * 30}\t0-7\nGPU1\tNV{'9' * 30}\t X \t0-7\n", "NVLinks"),
        ("\tGPU0\tGPU00\tCPU Affinity\nGPU0\t X \tNV4\t0-7\nGPU00\tNV4\t X \t0-7\n", "names the same GPU"),
        (f"\tGPU0\tGPU{'9' * 5000}\tCPU Affinity\nGPU0\t X \tNV4\t0-7\nGPU{'9' * 5000}\tNV4\t X \t0-7\n", "too large"),
        ("\tGPU0\tGPU1\tNUMA Affinity\nGPU0\t X \tNV4\t" + "9" * 5000 + "\nGPU1\tNV4\t X \t0\n", "NUMA Affinity"),
        ("\tGPU0\tGPU\u0661\tCPU Affinity\nGPU0\t X \tNV4\t0-7\nGPU\u0661\tNV4\t X \t0-7\n", "cannot read header"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV\u0661\u0668\t0-7\nGPU1\tNV4\t X \t0-7\n", "not a link value"),
    ],
)
def test_numbers_out_of_any_real_range_are_parse_errors(text: str, phrase: str) -> None:
    """Digit runs that no GPU has (NV0, 5,000-digit indices or NUMA nodes, non-ASCII digits that ``int``
    would read): one ``TopologyParseError`` each, not a traceback, and a short message."""
    with pytest.raises(TopologyParseError) as info:
        parse_topo_matrix(text, source="x.txt")
    assert phrase in str(info.value) and len(str(info.value)) < 300, str(info.value)[:300]
