"""The topology model: Cluster -> Node -> GPU / NIC, with the links between them.

Every class is an immutable pydantic model, so a snapshot round-trips through JSON
(``Cluster.model_dump_json()`` / ``Cluster.model_validate_json()``) and carries a schema version.

A GPU is addressed inside its node by ``index`` (the ``nvidia-smi`` index as the source gave it)
and across the cluster by ``GpuRef`` ("node/index"). Links between GPUs of one node are stored once
per unordered pair (``a < b``); links between nodes come from the cluster's fabric and from
multi-node NVLink cliques (GB200 NVL72), not from per-pair entries. A link may say whether its two
GPUs can talk peer to peer (``Link.p2p``, from ``nvidia-smi topo -p2p``: ``topology/p2p.py``); the
cost model uses ``Node.peer_to_peer`` to pick the PCIe all-reduce table of a TP group.

Every name that can reach a launch script, a file name, a Kubernetes object or a ledger key is
checked here, by the rules of ``toposched.names``, so that one rule covers every entry (cluster
spec, probe, plan JSON, presets, stored snapshots): node names are RFC 1123 hostnames
(``NodeName``); racks, zones, label keys and values and clique ids are ``Label`` (clique ids keep
their ``/``: ``gb200-nvl72/clique0``, NVML's ``clusterUuid/cliqueId``); NIC names are one ``Word``
(``mlx5_0``, ``mlx5_bond_0``); ``socket_ifname`` is NCCL's interface list (``socket_ifname_problem``:
``eth``, ``=eth0``, ``^docker,lo``, ``^=docker0``), checked by its own strict rule; GPU UUIDs (which
``CUDA_VISIBLE_DEVICES`` lists) use the ``Label`` alphabet and PCI bus ids are one ``Word``.
The fabric's ``rdma_resource`` (the Kubernetes resource that gives multi-node pods their RDMA
devices) must be a Kubernetes extended resource name.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from toposched.names import GpuModel, Label, LabelValue, NodeName, Word

SCHEMA_VERSION = 1


class LinkKind(StrEnum):
    """How two devices talk, best first (``nvidia-smi topo -m`` vocabulary, then between nodes)."""

    NVLINK = "NVLINK"  # NV#: a bonded set of # NVLinks (direct, or through an NVSwitch)
    PIX = "PIX"  # at most one PCIe bridge
    PXB = "PXB"  # several PCIe bridges, no host bridge
    PHB = "PHB"  # through a PCIe host bridge (the CPU)
    NODE = "NODE"  # across PCIe host bridges inside one NUMA node
    SYS = "SYS"  # across NUMA nodes (QPI/UPI/Infinity Fabric)
    MNNVL = "MNNVL"  # multi-node NVLink (GB200 NVL72 clique)
    IB = "IB"  # InfiniBand between nodes
    ROCE = "ROCE"  # RDMA over converged Ethernet between nodes
    ETHERNET = "ETHERNET"  # plain TCP between nodes

    @property
    def rank(self) -> int:
        """0 for the best kind; larger is worse."""
        return _KIND_ORDER.index(self)

    @property
    def intra_node(self) -> bool:
        return self not in (LinkKind.MNNVL, LinkKind.IB, LinkKind.ROCE, LinkKind.ETHERNET)


_KIND_ORDER = list(LinkKind)

# Nominal one-direction bandwidth (GB/s) and latency (us) per link kind, for when a source gives
# only the kind. NVLink is per lane and multiplied by the lane count: 25 GB/s per lane per
# direction for NVLink 2/3/4 (V100 6x25=150, A100 12x25=300, H100 18x25=450 GB/s: NVIDIA
# datasheets, reference/perf-anchors.md section 2); NVLink 5 lanes are 50 GB/s (B200 18x50=900),
# set per GPU model below. PCIe figures are x16 Gen4 ~31 GB/s (perf-anchors section 2); paths
# through more bridges or the CPU lose peer-to-peer efficiency, which the lower figures record as
# an ordering (they are not measured per machine). Latencies are the order of magnitude NCCL sees
# (perf-anchors section 0: NVLink all-reduce floor 6-7 us for 2 GPUs; P2P latency 10 us).
NVLINK_LANE_GBPS = 25.0
NVLINK5_LANE_GBPS = 50.0
NOMINAL: dict[LinkKind, tuple[float, float]] = {
    LinkKind.NVLINK: (NVLINK_LANE_GBPS, 2.0),
    LinkKind.PIX: (31.0, 5.0),
    LinkKind.PXB: (28.0, 6.0),
    LinkKind.PHB: (24.0, 8.0),
    LinkKind.NODE: (20.0, 9.0),
    LinkKind.SYS: (12.0, 12.0),
    # GB200 NVL72: NVLink 5, 18 lanes x 50 GB/s = 900 GB/s per GPU per direction.
    LinkKind.MNNVL: (900.0, 3.0),
    # Per NIC: NDR 400 Gb/s = 50 GB/s (perf-anchors section 2); IB/RoCE ~ 5 us, TCP ~ 30 us.
    LinkKind.IB: (50.0, 5.0),
    LinkKind.ROCE: (50.0, 6.0),
    LinkKind.ETHERNET: (12.5, 30.0),
}


def nvlink_lane_gbps(gpu_model: str | None) -> float:
    """Per-lane NVLink bandwidth for a GPU model name (NVLink 5 on Blackwell, else 25 GB/s)."""
    name = (gpu_model or "").upper()
    if any(tag in name for tag in ("B200", "B300", "GB200", "GB300")):
        return NVLINK5_LANE_GBPS
    return NVLINK_LANE_GBPS


def nominal_link(kind: LinkKind, nvlinks: int = 0, gpu_model: str | None = None) -> tuple[float, float]:
    """(bandwidth GB/s per direction, latency us) for a link described only by its kind."""
    bandwidth, latency = NOMINAL[kind]
    if kind is LinkKind.NVLINK:
        bandwidth = nvlink_lane_gbps(gpu_model) * max(nvlinks, 1)
    return bandwidth, latency


class Health(StrEnum):
    OK = "ok"
    DEGRADED = "degraded"  # e.g. fewer NVLink lanes up than the model has
    UNAVAILABLE = "unavailable"


MAX_GPU_INDEX = 4095
"""Far more GPUs than one node has; an index over it is not real (and would reach CUDA_VISIBLE_DEVICES)."""
MAX_NUMA_NODE = 4095
"""Linux's largest NUMA node number (CONFIG_NODES_SHIFT is at most 10: 1,024 nodes) with room to spare."""


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GPU(_Value):
    """One GPU as a node sees it."""

    index: int = Field(ge=0, le=MAX_GPU_INDEX, description="nvidia-smi index as the source gave it")
    uuid: Label | None = Field(default=None, description="'GPU-<hex>', or MIG's 'MIG-GPU-<hex>/1/0'")
    pci_bus_id: Word | None = Field(default=None, description="e.g. '00000000:18:00.0'")
    model: GpuModel | None = None
    hbm_gib: float | None = Field(default=None, gt=0)
    numa_node: int | None = Field(
        default=None, ge=0, le=MAX_NUMA_NODE, description="single NUMA node, or None when unknown/many"
    )
    numa_affinity: str | None = Field(
        default=None, max_length=1000, description="raw NUMA affinity text (e.g. '0-1', 'N/A')"
    )
    cpu_affinity: str | None = Field(default=None, max_length=4000, description="CPU list, e.g. '0-51,104-155'")
    health: Health = Health.OK


class NIC(_Value):
    """A network interface the topology source lists (``NICn`` / ``mlx5_N``)."""

    name: Word = Field(description="column name in the source: 'NIC0' or 'mlx5_0'")
    device: Word | None = Field(default=None, description="RDMA device, e.g. 'mlx5_0'")
    numa_node: int | None = None


class Link(_Value):
    """A link between two GPUs of one node, stored once with ``a < b``."""

    a: int
    b: int
    kind: LinkKind
    nvlinks: int = Field(default=0, ge=0, le=64, description="NVLink lane count (NV#, at most 18 today), 0 for PCIe")
    bandwidth_gbps: float = Field(gt=0, description="GB/s per direction")
    latency_us: float = Field(ge=0)
    p2p: bool | None = Field(
        default=None,
        description="peer-to-peer access both ways (nvidia-smi topo -p2p r: True OK, False refused, None unknown)",
    )

    @property
    def peer_to_peer(self) -> bool:
        """Whether GPU-to-GPU copies take this path: not when P2P is reported refused, nor across CPU
        sockets (``SYS``); unknown P2P inside one socket counts as on (the driver's default)."""
        return self.p2p is not False and self.kind is not LinkKind.SYS

    @model_validator(mode="after")
    def _check(self) -> Link:
        if self.a >= self.b:
            raise ValueError(f"link endpoints must satisfy a < b (got a={self.a}, b={self.b})")
        if (self.kind is LinkKind.NVLINK) != (self.nvlinks > 0):
            raise ValueError(f"nvlinks={self.nvlinks} does not match kind {self.kind.value}")
        return self


class NicLink(_Value):
    """The PCIe path between a GPU and a NIC of the same node."""

    gpu: int
    nic: Word
    kind: LinkKind


class Node(_Value):
    """One machine: its GPUs, NICs and the links between them."""

    name: NodeName = Field(description="hostname (RFC 1123, as Kubernetes node names)")
    rack: Label | None = None
    zone: Label | None = None
    labels: dict[Label, LabelValue] = Field(default_factory=dict)
    gpus: tuple[GPU, ...] = ()
    nics: tuple[NIC, ...] = ()
    links: tuple[Link, ...] = ()
    nic_links: tuple[NicLink, ...] = ()
    nvswitch: bool | None = Field(default=None, description="NVLinks end at NVSwitches (None: unknown)")
    source: str = Field(default="", description="where this node's topology came from")

    @model_validator(mode="after")
    def _check(self) -> Node:
        indices = [g.index for g in self.gpus]
        if len(set(indices)) != len(indices):
            raise ValueError(f"node {self.name}: duplicate GPU indices {sorted(indices)}")
        known = set(indices)
        seen: set[tuple[int, int]] = set()
        for link in self.links:
            if link.a not in known or link.b not in known:
                raise ValueError(f"node {self.name}: link {link.a}-{link.b} names an unknown GPU")
            if (link.a, link.b) in seen:
                raise ValueError(f"node {self.name}: link {link.a}-{link.b} given twice")
            seen.add((link.a, link.b))
        return self

    def gpu(self, index: int) -> GPU:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"node {self.name} has no GPU {index}")

    def peer_to_peer(self, indices: Iterable[int]) -> bool:
        """Whether every pair of these GPUs talks peer to peer (``Link.peer_to_peer``; a pair with no
        link entry counts as on)."""
        group = set(indices)
        return all(link.peer_to_peer for link in self.links if link.a in group and link.b in group)

    def link(self, a: int, b: int) -> Link | None:
        lo, hi = min(a, b), max(a, b)
        for link in self.links:
            if link.a == lo and link.b == hi:
                return link
        return None


# A Kubernetes extended resource name: ``domain/name`` (``rdma/ib``, ``nvidia.com/hostdev``); the
# domain is a lower-case DNS subdomain outside kubernetes.io, the name a qualified-name part (63 at
# most). Checked here so the value is a valid resource key wherever it is written.
_RESOURCE_DOMAIN = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?)*"
_RESOURCE_NAME = re.compile(rf"{_RESOURCE_DOMAIN}/[A-Za-z0-9](?:[-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?")


def _resource_name(value: str) -> str:
    domain = value.split("/", 1)[0]
    if len(value) > 253 or not _RESOURCE_NAME.fullmatch(value):
        raise ValueError(
            f"{value[:60]!r} is not a Kubernetes extended resource name (DOMAIN/NAME, lower-case domain, "
            "e.g. rdma/ib or nvidia.com/hostdev)"
        )
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        raise ValueError(f"{value!r}: the kubernetes.io domain is not for device resources")
    return value


ResourceName = Annotated[str, AfterValidator(_resource_name)]

# NCCL_SOCKET_IFNAME, as NCCL reads it (reference/engines.md section 7; NCCL's matchIfList checks a
# leading '^' before a leading '='): an optional '^' (use every interface except these), then an
# optional '=' (exact names instead of prefixes), then a comma list of interface names or prefixes.
# A Linux interface name is at most 15 bytes (IFNAMSIZ 16) and has no '/', ':' or white space; this
# rule keeps to a letter or digit, then letters, digits, '.', '_' and '-' (eth0, enp1s0f0, bond0.100,
# ib0, br-1a2b), which also keeps the value inert in a shell word and a YAML scalar. At most 16 entries.
_IFNAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}"
_IFNAME_LIST = re.compile(rf"\^?=?{_IFNAME}(?:,{_IFNAME}){{0,15}}")
MAX_IFNAME_LIST = 16 * 16 + 2


def socket_ifname_problem(value: object) -> str | None:
    """Why ``value`` is not an ``NCCL_SOCKET_IFNAME`` value, or None when it is."""
    if not isinstance(value, str):
        return f"socket_ifname must be a string, got {type(value).__name__}"
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    if len(value) > MAX_IFNAME_LIST or not _IFNAME_LIST.fullmatch(value):
        return (
            f"socket_ifname {shown} is not an NCCL_SOCKET_IFNAME list: an optional '^' (exclude), an optional "
            "'=' (exact names), then up to 16 comma-separated interface names or prefixes of 1-15 letters, "
            "digits, '.', '_', '-' starting with a letter or digit (e.g. eth0, =eth0, ^docker,lo)"
        )
    return None


def _socket_ifname(value: str) -> str:
    problem = socket_ifname_problem(value)
    if problem:
        raise ValueError(problem)
    return value


SocketIfname = Annotated[str, AfterValidator(_socket_ifname)]


NIC_MAX_GBPS = 100.0
"""Fastest NIC port made: InfiniBand XDR or 800 GbE, 800 Gb/s = 100 GB/s per direction. A per-NIC
figure above it is a unit mistake (a "400G" NIC written as 400 GB/s), not a faster network."""

IB_GENERATIONS: tuple[tuple[str, float, str], ...] = (
    # (InfiniBand generation, GB/s per port per direction, perf/links.py key)
    ("HDR", 25.0, "ib-hdr"),  # 200 Gb/s
    ("NDR", 50.0, "ib-ndr"),  # 400 Gb/s
    ("XDR", 100.0, "ib-xdr"),  # 800 Gb/s
)
"""InfiniBand port speeds, slowest first (perf/links.py has no table for slower ones)."""


class Fabric(_Value):
    """The network between nodes, and how multi-node pods reach it on Kubernetes.

    ``nic_gbps`` is gigaBYTES per second per NIC per direction (NDR, sold as 400 Gb/s, is 50); a
    cluster spec may give the line rate instead as ``nic_gbit_per_s`` (``topology/spec.py``).
    """

    kind: Literal["IB", "ROCE", "ETHERNET"] = "IB"
    nic_gbps: float = Field(
        default=50.0, gt=0, le=NIC_MAX_GBPS, description="GB/s (bytes) per NIC per direction (NDR 400 Gb/s = 50)"
    )
    nics_per_node: int = Field(default=8, ge=0)
    rail_optimized: bool = True
    latency_us: float = Field(default=5.0, ge=0)
    socket_ifname: SocketIfname | None = Field(
        default=None,
        description="NCCL_SOCKET_IFNAME as NCCL reads it: 'eth' (prefix), '=eth0' (exact), '^docker,lo' (exclude)",
    )
    rdma_resource: ResourceName | None = Field(
        default=None,
        description="extended resource that gives a pod RDMA devices ('rdma/ib', 'nvidia.com/hostdev'); None: none",
    )
    rdma_per_pod: int = Field(default=1, ge=1, le=64, description="how many rdma_resource each multi-node pod asks for")
    host_network: bool = Field(
        default=False, description="multi-node pods use the node's network (hostNetwork, ClusterFirstWithHostNet DNS)"
    )

    @property
    def link_kind(self) -> LinkKind:
        return LinkKind(self.kind)

    @property
    def generation(self) -> str | None:
        """The InfiniBand generation whose port speed its NICs have (HDR, NDR, XDR), else None."""
        if self.kind != "IB":
            return None
        return next((name for name, gbps, _ in IB_GENERATIONS if self.nic_gbps == gbps), None)

    @property
    def perf_link(self) -> str:
        """The ``perf/links.py`` key of traffic between nodes: RoCE, TCP, or the table of the slowest
        InfiniBand generation at least as fast as the NICs (HDR's for anything up to 200 Gb/s)."""
        if self.kind == "ROCE":
            return "roce-400"
        if self.kind == "ETHERNET":
            return "tcp-100"
        return next(key for _, gbps, key in IB_GENERATIONS if self.nic_gbps <= gbps)

    def describe(self) -> str:
        """One phrase for people: ``IB NDR, 8 x 400 Gb/s NICs (50 GB/s each)``."""
        kind = f"{self.kind} {self.generation}" if self.generation else self.kind
        return f"{kind}, {self.nics_per_node} x {self.nic_gbps * 8:g} Gb/s NICs ({self.nic_gbps:g} GB/s each)"


class NVLinkClique(_Value):
    """A multi-node NVLink domain (e.g. one GB200 NVL72 rack: 72 GPUs over 18 trays)."""

    id: Label = Field(description="e.g. 'gb200-nvl72/clique0' or NVML's 'clusterUuid/cliqueId'")
    nodes: tuple[NodeName, ...] = Field(min_length=1)
    bandwidth_gbps: float = Field(default=900.0, gt=0)


class Cluster(_Value):
    """A whole cluster: nodes, the fabric between them and multi-node NVLink cliques."""

    schema_version: int = SCHEMA_VERSION
    name: str = "cluster"
    nodes: tuple[Node, ...] = Field(min_length=1)
    fabric: Fabric | None = None
    cliques: tuple[NVLinkClique, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Cluster:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {self.schema_version} is not supported (this toposched reads {SCHEMA_VERSION})"
            )
        names = [n.name for n in self.nodes]
        dupes = sorted(n for n, count in Counter(names).items() if count > 1)
        if dupes:
            raise ValueError(f"duplicate node names: {', '.join(dupes)}")
        known = set(names)
        in_clique: dict[str, str] = {}
        for clique in self.cliques:
            for node in clique.nodes:
                if node not in known:
                    raise ValueError(f"clique {clique.id} names unknown node {node!r}")
                if node in in_clique:
                    raise ValueError(f"node {node} is in two cliques ({in_clique[node]}, {clique.id})")
                in_clique[node] = clique.id
        return self

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"cluster has no node {name!r}")

    @property
    def gpu_count(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)
