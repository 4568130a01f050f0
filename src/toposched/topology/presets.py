"""Built-in topologies of well-known machines and clusters (no GPU needed to use them).

Link matrices follow NVIDIA's published system topologies and, where we hold one, a real capture
in tests/data/fixtures/topo (named per preset). Memory is what ``nvidia-smi`` reports as total for
that GPU (MiB / 1024): A100 80GB 81920 MiB, H100 SXM 81559 MiB, H200 143771 MiB, B200 183359 MiB,
V100 32GB 32768 MiB, L40S 46068 MiB. GB200: 186 GB of HBM3e per GPU (13.4 TB per NVL72 rack / 72), about
173 GiB; no capture of its nvidia-smi total was at hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from toposched.errors import UnknownNameError
from toposched.registry import Registry
from toposched.topology.model import (
    GPU,
    NIC,
    Cluster,
    Fabric,
    Link,
    LinkKind,
    NicLink,
    Node,
    NVLinkClique,
    nominal_link,
)

PairFn = Callable[[int, int], tuple[LinkKind, int]]


def _node(
    name: str,
    *,
    model: str,
    hbm_gib: float,
    count: int,
    pair: PairFn,
    numa: Callable[[int], int],
    cpus: Callable[[int], str],
    nic_of: Callable[[int], list[int]] | None = None,
    nics: int = 0,
    nvswitch: bool | None,
    rack: str | None = None,
    zone: str | None = None,
    source: str,
) -> Node:
    gpus = tuple(
        GPU(
            index=i,
            uuid=f"GPU-preset-{name}-{i}",
            pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            model=model,
            hbm_gib=hbm_gib,
            numa_node=numa(i),
            numa_affinity=str(numa(i)),
            cpu_affinity=cpus(i),
        )
        for i in range(count)
    )
    links = []
    for a in range(count):
        for b in range(a + 1, count):
            kind, lanes = pair(a, b)
            bandwidth, latency = nominal_link(kind, lanes, model)
            links.append(Link(a=a, b=b, kind=kind, nvlinks=lanes, bandwidth_gbps=bandwidth, latency_us=latency))
    nic_list = tuple(NIC(name=f"NIC{n}", device=f"mlx5_{n}") for n in range(nics))
    nic_links = []
    if nic_of is not None:
        for i in range(count):
            near = nic_of(i)
            for n in range(nics):
                kind = (
                    LinkKind.PIX
                    if n in near
                    else (LinkKind.NODE if numa(i) == numa(n * count // nics) else LinkKind.SYS)
                )
                nic_links.append(NicLink(gpu=i, nic=f"NIC{n}", kind=kind))
    return Node(
        name=name,
        rack=rack,
        zone=zone,
        gpus=gpus,
        nics=nic_list,
        links=tuple(links),
        nic_links=tuple(nic_links),
        nvswitch=nvswitch,
        source=f"preset: {source}",
    )


def _all_nv(lanes: int) -> PairFn:
    return lambda a, b: (LinkKind.NVLINK, lanes)


def _half(count: int) -> Callable[[int], int]:
    return lambda i: 0 if i < count // 2 else 1


# DGX-1 V100 hybrid cube mesh, as captured in fixtures/topo/07_dgx1-v100-1nic-driver440.txt.
_DGX1 = {
    (0, 1): 1,
    (0, 2): 1,
    (0, 3): 2,
    (0, 4): 2,
    (1, 2): 2,
    (1, 3): 1,
    (1, 5): 2,
    (2, 3): 2,
    (2, 6): 1,
    (3, 7): 1,
    (4, 5): 1,
    (4, 6): 1,
    (4, 7): 2,
    (5, 6): 2,
    (5, 7): 1,
    (6, 7): 2,
}


def _dgx1_pair(a: int, b: int) -> tuple[LinkKind, int]:
    lanes = _DGX1.get((a, b), 0)
    return (LinkKind.NVLINK, lanes) if lanes else (LinkKind.SYS, 0)


def _pcie_two_socket(a: int, b: int) -> tuple[LinkKind, int]:
    """8 PCIe GPUs, two per PCIe switch, four per socket."""
    if a // 4 != b // 4:
        return LinkKind.SYS, 0
    return (LinkKind.PIX, 0) if a // 2 == b // 2 else (LinkKind.NODE, 0)


def _nvlink_pairs(a: int, b: int) -> tuple[LinkKind, int]:
    """GPU0-1 and GPU2-3 joined by NVLink bridges, one pair per socket (seed 004's box)."""
    if a // 2 == b // 2:
        return LinkKind.NVLINK, 12
    return LinkKind.SYS, 0


def dgx1_v100(name: str = "dgx1") -> Node:
    return _node(
        name,
        model="Tesla V100-SXM2-32GB",
        hbm_gib=32.0,
        count=8,
        pair=_dgx1_pair,
        numa=_half(8),
        cpus=lambda i: "0-19,40-59" if i < 4 else "20-39,60-79",
        nvswitch=False,
        source="DGX-1 V100 hybrid cube mesh (fixture topo/07)",
    )


def dgx2(name: str = "dgx2") -> Node:
    return _node(
        name,
        model="Tesla V100-SXM3-32GB",
        hbm_gib=32.0,
        count=16,
        pair=_all_nv(6),
        numa=_half(16),
        cpus=lambda i: "0-23,48-71" if i < 8 else "24-47,72-95",
        nvswitch=True,
        nics=8,
        nic_of=lambda i: [i // 2],
        source="DGX-2 16x V100 on NVSwitch, NV6 (fixture topo/32)",
    )


def dgx_a100(name: str = "dgx-a100") -> Node:
    numa = [3, 3, 1, 1, 7, 7, 5, 5]  # NPS4 EPYC; as fixtures topo/13 and topo/22 show
    cpus = [
        "48-63,176-191",
        "48-63,176-191",
        "16-31,144-159",
        "16-31,144-159",
        "112-127,240-255",
        "112-127,240-255",
        "80-95,208-223",
        "80-95,208-223",
    ]
    return _node(
        name,
        model="NVIDIA A100-SXM4-80GB",
        hbm_gib=80.0,
        count=8,
        pair=_all_nv(12),
        numa=lambda i: numa[i],
        cpus=lambda i: cpus[i],
        nvswitch=True,
        nics=8,
        nic_of=lambda i: [i],
        source="DGX A100, NVSwitch NV12 (fixtures topo/13, topo/22)",
    )


def hgx(name: str, model: str, hbm_gib: float, *, rack: str | None = None, zone: str | None = None) -> Node:
    return _node(
        name,
        model=model,
        hbm_gib=hbm_gib,
        count=8,
        pair=_all_nv(18),
        numa=_half(8),
        cpus=lambda i: "0-55,112-167" if i < 4 else "56-111,168-223",
        nvswitch=True,
        nics=8,
        nic_of=lambda i: [i],
        rack=rack,
        zone=zone,
        source=f"HGX 8x {model}, NVSwitch NV18, one NIC per GPU (fixture topo/04)",
    )


def l40s_pcie(name: str = "l40s") -> Node:
    return _node(
        name,
        model="NVIDIA L40S",
        hbm_gib=44.99,
        count=8,
        pair=_pcie_two_socket,
        numa=_half(8),
        cpus=lambda i: "0-31,64-95" if i < 4 else "32-63,96-127",
        nvswitch=None,
        nics=2,
        nic_of=lambda i: [0] if i < 2 else ([1] if 4 <= i < 6 else []),
        source="8x L40S PCIe, two sockets, two GPUs per PCIe switch",
    )


def nvlink_pairs_4gpu(name: str = "box4") -> Node:
    return _node(
        name,
        model="NVIDIA A100 80GB PCIe",
        hbm_gib=80.0,
        count=4,
        pair=_nvlink_pairs,
        numa=_half(4),
        cpus=lambda i: "0-31" if i < 2 else "32-63",
        nvswitch=False,
        source="4x A100 80GB PCIe, two NUMA nodes, an NVLink-bridged pair in each",
    )


def gb200_nvl72(name: str = "nvl72") -> Cluster:
    """One GB200 NVL72 rack: 18 compute trays of 4 GPUs, all 72 on one NVLink 5 switch fabric."""
    trays = tuple(
        _node(
            f"{name}-tray{t:02d}",
            model="NVIDIA GB200",
            hbm_gib=173.0,
            count=4,
            pair=_all_nv(18),
            numa=lambda i: i // 2,
            cpus=lambda i: "0-71" if i < 2 else "72-143",
            nvswitch=True,
            nics=4,
            nic_of=lambda i: [i],
            rack=name,
            source="GB200 NVL72 compute tray",
        )
        for t in range(18)
    )
    return Cluster(
        name=name,
        nodes=trays,
        fabric=Fabric(kind="IB", nic_gbps=50.0, nics_per_node=4),
        cliques=(NVLinkClique(id=f"{name}/clique0", nodes=tuple(n.name for n in trays), bandwidth_gbps=900.0),),
    )


def mixed_cluster() -> Cluster:
    """A cluster of three generations (issue 35's mixed churn scenario): half a GB200 NVL72 rack (9 trays,
    36 GPUs in one multi-node NVLink domain), 6 x HGX H100 (48 GPUs) and 4 x 8 L40S PCIe boxes (32
    GPUs, no NVLink); 116 GPUs over InfiniBand, one rack per kind."""
    gb = gb200_nvl72("gb200")
    trays = gb.nodes[:9]
    h100 = tuple(hgx(f"h100-{n}", "NVIDIA H100 80GB HBM3", 79.65, rack="h100", zone="zone0") for n in range(6))
    l40s = tuple(l40s_pcie(f"l40s-{n}").model_copy(update={"rack": "l40s", "zone": "zone0"}) for n in range(4))
    trays = tuple(t.model_copy(update={"zone": "zone0"}) for t in trays)
    return Cluster(
        name="mixed-gb200-h100-l40s",
        nodes=(*trays, *h100, *l40s),
        fabric=Fabric(kind="IB", nic_gbps=50.0, nics_per_node=4),
        cliques=(NVLinkClique(id="gb200/clique0", nodes=tuple(t.name for t in trays), bandwidth_gbps=900.0),),
    )


def hgx_h100_cluster(nodes: int = 32, nodes_per_rack: int = 4, racks_per_zone: int = 4) -> Cluster:
    """32 x HGX H100 over 8 x 400 Gb/s InfiniBand (NDR), rail-optimised (seed 000's 256-GPU setting)."""
    members = tuple(
        hgx(
            f"h100-{n:02d}",
            "NVIDIA H100 80GB HBM3",
            79.65,
            rack=f"rack{n // nodes_per_rack}",
            zone=f"zone{n // (nodes_per_rack * racks_per_zone)}",
        )
        for n in range(nodes)
    )
    return Cluster(
        name=f"{nodes}x-hgx-h100",
        nodes=members,
        fabric=Fabric(kind="IB", nic_gbps=50.0, nics_per_node=8, rail_optimized=True),
    )


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    build: Callable[[], Cluster]


def _single(node: Callable[[], Node], name: str) -> Callable[[], Cluster]:
    return lambda: Cluster(name=name, nodes=(node(),))


_PRESETS: Registry[Preset] = Registry("preset")


def register_preset(preset: Preset) -> None:
    """Add a preset; a name can be registered once."""
    _PRESETS.register(preset.name, preset)


for _preset in (
    Preset("dgx1-v100", "DGX-1: 8x V100 SXM2 32GB, hybrid cube mesh (NV1/NV2)", _single(dgx1_v100, "dgx1-v100")),
    Preset("dgx2", "DGX-2: 16x V100 32GB on NVSwitch (NV6)", _single(dgx2, "dgx2")),
    Preset("dgx-a100", "DGX A100: 8x A100 80GB on NVSwitch (NV12), NPS4 NUMA", _single(dgx_a100, "dgx-a100")),
    Preset(
        "hgx-h100",
        "HGX H100: 8x H100 SXM 80GB on NVSwitch (NV18), 2 sockets, 8 NICs",
        _single(lambda: hgx("hgx-h100", "NVIDIA H100 80GB HBM3", 79.65), "hgx-h100"),
    ),
    Preset(
        "hgx-h200",
        "HGX H200: 8x H200 141GB on NVSwitch (NV18), 2 sockets, 8 NICs",
        _single(lambda: hgx("hgx-h200", "NVIDIA H200", 140.4), "hgx-h200"),
    ),
    Preset(
        "hgx-b200",
        "HGX B200: 8x B200 180GB on NVSwitch (NVLink 5, NV18), 2 sockets, 8 NICs",
        _single(lambda: hgx("hgx-b200", "NVIDIA B200", 179.06), "hgx-b200"),
    ),
    Preset("gb200-nvl72", "GB200 NVL72 rack: 72 GPUs, 18 trays, one multi-node NVLink domain", gb200_nvl72),
    Preset("l40s-8x-pcie", "8x L40S PCIe, two sockets, no NVLink", _single(l40s_pcie, "l40s-8x-pcie")),
    Preset(
        "4gpu-2numa-nvlink-pairs",
        "4x A100 80GB PCIe, 2 sockets, GPU0-1 and GPU2-3 each an NVLink-bridged pair (NV12)",
        _single(nvlink_pairs_4gpu, "4gpu-2numa-nvlink-pairs"),
    ),
    Preset(
        "mixed-gb200-h100-l40s",
        "116 GPUs of three kinds: 9 GB200 trays in one NVLink domain, 6 x HGX H100, 4 x 8 L40S PCIe",
        mixed_cluster,
    ),
    Preset(
        "cluster-32x-hgx-h100",
        "256 GPUs: 32 x HGX H100, 8 x 400 Gb/s InfiniBand NDR per node, 8 racks, 2 zones",
        hgx_h100_cluster,
    ),
):
    register_preset(_preset)


def presets() -> list[Preset]:
    return sorted((p for _, p in _PRESETS.items()), key=lambda p: p.name)


def preset_names() -> list[str]:
    return [p.name for p in presets()]


def load_preset(name: str) -> Cluster:
    """Build a preset by name (case-insensitive); unknown names suggest the closest ones."""
    if len(name) > 100:  # no preset name is this long; do not echo (or fuzzy-match) a huge one
        raise UnknownNameError("preset", name[:60] + "...", preset_names())
    return _PRESETS.get(name).build()


def preset_node(name: str) -> Node:
    """A single-node preset's node (for cluster specs that say ``preset: hgx-h100``)."""
    cluster = load_preset(name)
    if len(cluster.nodes) != 1:
        raise UnknownNameError("single-node preset", name, [p.name for p in presets() if len(p.build().nodes) == 1])
    return cluster.nodes[0]
