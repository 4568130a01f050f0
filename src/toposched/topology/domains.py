"""DomainMap: which GPUs share an NVLink domain, a NUMA node, a PCIe switch.

* **NVLink domains** are the connected components (of two or more GPUs) of the NVLink graph of a
  node, or a whole multi-node NVLink clique (GB200 NVL72). Inside a component, ``cliques`` lists
  the maximal sets in which every pair has a direct NVLink: for NVSwitch systems and bridged pairs
  the clique is the component; for a hybrid cube mesh (DGX-1 V100) it is each quad plus the
  cross pairs. A tensor-parallel group that must keep all its traffic on NVLink fits in a clique.
* **NUMA groups** group a node's GPUs by their NUMA node; when the source gives none (old drivers
  print only ``CPU Affinity``) GPUs with the same CPU set form a group, labelled by that set.
* **PCIe-switch groups** are the connected components of ``PIX`` links (``nvidia-smi topo -m``
  shows ``NV#`` instead when two GPUs also share NVLink, so on NVLink machines these groups are
  known only from NVML's common-ancestor query or a preset).

A DomainMap is a value computed from a ``Cluster``; ``version`` and ``created_at`` are stamped
when it is stored (see ``store.py``).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from toposched.topology.model import Cluster, LinkKind, Node

DomainKind = Literal["nvswitch", "mesh", "bridge", "mnnvl"]


def gpu_ref(node: str, index: int) -> str:
    """Cluster-wide GPU name: ``node/index``."""
    return f"{node}/{index}"


class NVLinkDomain(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    kind: DomainKind
    nodes: tuple[str, ...]
    gpus: tuple[str, ...] = Field(description="GPU refs 'node/index'")
    cliques: tuple[tuple[str, ...], ...] = Field(description="maximal all-pairs-NVLink sets, largest first")
    min_nvlinks: int = Field(description="fewest NVLink lanes between any linked pair in the domain")

    @property
    def size(self) -> int:
        return len(self.gpus)

    @property
    def largest_clique(self) -> int:
        return max((len(c) for c in self.cliques), default=0)


class GpuGroup(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    node: str
    gpus: tuple[str, ...]


class DomainMap(BaseModel):
    """GPU -> NVLink domain, NUMA group and PCIe-switch group for a whole cluster."""

    model_config = ConfigDict(frozen=True)

    cluster_fingerprint: str
    domains: tuple[NVLinkDomain, ...]
    numa_groups: tuple[GpuGroup, ...]
    pcie_groups: tuple[GpuGroup, ...]
    gpu_domain: dict[str, str | None]
    nearest_nics: dict[str, tuple[str, ...]] = Field(
        default_factory=dict, description="per GPU ref, the NICs on its best PCIe path"
    )

    def domain_of(self, ref: str) -> NVLinkDomain | None:
        domain_id = self.gpu_domain.get(ref)
        return next((d for d in self.domains if d.id == domain_id), None)


_LAST_DIGEST: tuple[Cluster, str] | None = None


def cluster_digest(cluster: Cluster) -> str:
    """SHA-256 (hex) of the cluster's JSON. The last cluster's digest is kept: ``plan`` needs it twice (the
    DomainMap's fingerprint, the plan's cluster summary), and at 65,536 GPUs the JSON is 59 MB and 0.7-0.9 s
    of CPU. A Cluster is a frozen model and toposched never changes one in place (a changed topology is a new
    Cluster), so the same object has the same digest; only a node's ``labels`` dict could be changed in place,
    and a caller that did so would get the digest from before. The kept cluster is the one being planned."""
    global _LAST_DIGEST
    last = _LAST_DIGEST
    if last is not None and last[0] is cluster:
        return last[1]
    digest = hashlib.sha256(cluster.model_dump_json().encode()).hexdigest()
    _LAST_DIGEST = (cluster, digest)
    return digest


def fingerprint(cluster: Cluster) -> str:
    """Stable hash of a cluster snapshot; equal topologies give equal fingerprints."""
    return cluster_digest(cluster)[:16]


def _components(vertices: Iterable[int], edges: Iterable[tuple[int, int]]) -> list[list[int]]:
    parent = {v: v for v in vertices}

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for a, b in edges:
        parent[find(a)] = find(b)
    groups: dict[int, list[int]] = {}
    for v in parent:
        groups.setdefault(find(v), []).append(v)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


def _maximal_cliques(adjacency: dict[int, set[int]]) -> Iterator[set[int]]:
    """Bron-Kerbosch with pivoting; graphs here have at most a few dozen vertices."""

    def expand(r: set[int], p: set[int], x: set[int]) -> Iterator[set[int]]:
        if not p and not x:
            yield r
            return
        pivot = max(p | x, key=lambda v: len(adjacency[v] & p))
        for v in list(p - adjacency[pivot]):
            yield from expand(r | {v}, p & adjacency[v], x & adjacency[v])
            p = p - {v}
            x = x | {v}

    yield from expand(set(), set(adjacency), set())


_DomainShape = tuple[str, tuple[int, ...], tuple[tuple[int, ...], ...], int]
"""One NVLink domain of a node in GPU indices: kind, members, maximal cliques (in ``_node_domains``'s
order), fewest lanes."""


@functools.lru_cache(maxsize=256)
def _domain_shapes(nvswitch: bool | None, nv_links: tuple[tuple[int, int, int], ...]) -> tuple[_DomainShape, ...]:
    """The NVLink domains of a node with these NVLink links ``(a, b, lanes)`` and NVSwitch flag.

    A pure function of its arguments, kept for the nodes of one shape (a cluster of 8,192 HGX nodes finds
    the cliques of one 8-GPU graph once instead of 8,192 times: issue 17's build)."""
    members = sorted({i for a, b, _lanes in nv_links for i in (a, b)})
    shapes: list[_DomainShape] = []
    for component in (c for c in _components(members, [(a, b) for a, b, _lanes in nv_links]) if len(c) > 1):
        inside = set(component)
        adjacency: dict[int, set[int]] = {v: set() for v in component}
        lanes = []
        for a, b, count in nv_links:
            if a in inside:
                adjacency[a].add(b)
                adjacency[b].add(a)
                lanes.append(count)
        # ordered as the GPU refs are (largest first, then by the refs, which compare as the indices' text:
        # every ref of one node starts with the same "node/")
        cliques = sorted(
            (tuple(sorted(c)) for c in _maximal_cliques(adjacency) if len(c) > 1),
            key=lambda c: (-len(c), tuple(str(i) for i in c)),
        )
        full = len(cliques) == 1 and len(cliques[0]) == len(component)
        if len(component) == 2:
            kind: DomainKind = "bridge" if nvswitch is not True else "nvswitch"
        elif full and nvswitch is not False:
            kind = "nvswitch" if nvswitch or len(component) > 4 else "mesh"
        else:
            kind = "mesh"
        shapes.append((kind, tuple(component), tuple(cliques), min(lanes)))
    return tuple(shapes)


def _node_domains(node: Node) -> list[NVLinkDomain]:
    nv_links = tuple((link.a, link.b, link.nvlinks) for link in node.links if link.kind is LinkKind.NVLINK)
    name = node.name
    return [
        NVLinkDomain(
            id=f"{name}/nv{n}",
            kind=kind,
            nodes=(name,),
            gpus=tuple(gpu_ref(name, i) for i in component),
            cliques=tuple(tuple(gpu_ref(name, i) for i in clique) for clique in cliques),
            min_nvlinks=lanes,
        )
        for n, (kind, component, cliques, lanes) in enumerate(_domain_shapes(node.nvswitch, nv_links))
    ]


def build_domain_map(cluster: Cluster) -> DomainMap:
    """Compute the DomainMap of a cluster (pure; no I/O)."""
    domains: list[NVLinkDomain] = []
    clique_of = {node: clique for clique in cluster.cliques for node in clique.nodes}
    for clique in cluster.cliques:
        gpus = tuple(gpu_ref(n.name, g.index) for n in cluster.nodes if n.name in clique.nodes for g in n.gpus)
        if len(gpus) > 1:
            domains.append(
                NVLinkDomain(
                    id=clique.id,
                    kind="mnnvl",
                    nodes=clique.nodes,
                    gpus=gpus,
                    cliques=(gpus,),
                    min_nvlinks=min(
                        (link.nvlinks for n in cluster.nodes if n.name in clique.nodes for link in n.links),
                        default=18,
                    ),
                )
            )
    numa_groups: list[GpuGroup] = []
    pcie_groups: list[GpuGroup] = []
    nearest: dict[str, tuple[str, ...]] = {}
    for node in cluster.nodes:
        if node.name not in clique_of:
            domains.extend(_node_domains(node))
        by_numa: dict[str, list[str]] = {}
        for gpu in node.gpus:
            if gpu.numa_node is not None:
                key = f"numa{gpu.numa_node}"
            elif gpu.cpu_affinity:
                key = f"cpus:{gpu.cpu_affinity}"
            else:
                continue
            by_numa.setdefault(key, []).append(gpu_ref(node.name, gpu.index))
        numa_groups.extend(GpuGroup(id=f"{node.name}/{k}", node=node.name, gpus=tuple(v)) for k, v in by_numa.items())
        pix = [(link.a, link.b) for link in node.links if link.kind is LinkKind.PIX]
        pix_members = sorted({i for edge in pix for i in edge})
        for n, component in enumerate(c for c in _components(pix_members, pix) if len(c) > 1):
            refs = tuple(gpu_ref(node.name, i) for i in component)
            pcie_groups.append(GpuGroup(id=f"{node.name}/pcie{n}", node=node.name, gpus=refs))
        paths: dict[int, list[tuple[int, str]]] = {}  # GPU index -> (rank, NIC), in nic_links' order
        for nl in node.nic_links:
            paths.setdefault(nl.gpu, []).append((nl.kind.rank, nl.nic))
        for gpu in node.gpus:
            mine = paths.get(gpu.index)
            if mine:
                best = min(rank for rank, _nic in mine)
                nearest[gpu_ref(node.name, gpu.index)] = tuple(nic for rank, nic in mine if rank == best)
    gpu_domain: dict[str, str | None] = {gpu_ref(n.name, g.index): None for n in cluster.nodes for g in n.gpus}
    for domain in domains:
        for ref in domain.gpus:
            gpu_domain[ref] = domain.id
    return DomainMap(
        cluster_fingerprint=fingerprint(cluster),
        domains=tuple(domains),
        numa_groups=tuple(numa_groups),
        pcie_groups=tuple(pcie_groups),
        gpu_domain=gpu_domain,
        nearest_nics=nearest,
    )
