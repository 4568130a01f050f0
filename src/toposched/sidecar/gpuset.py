"""Is a set of GPUs well placed? (seed 004 section 6: ``nvidia-smi topo -m`` between the GPUs of a pod).

The set passes when it sits inside one NVLink clique (every pair ``NV#``), or else inside one NUMA
node with no ``SYS`` pair. The answer names the domain, the NUMA node, the worst pair and why it
fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Any, Literal

from toposched.errors import InputError
from toposched.topology.domains import build_domain_map, gpu_ref
from toposched.topology.model import Cluster, LinkKind, Node

Level = Literal["nvlink", "numa", "none"]


@dataclass(frozen=True)
class GpuSetVerdict:
    node: str
    gpus: tuple[int, ...]
    nvlink_domain: str | None
    numa_node: int | None
    ok: bool
    level: Level
    worst_link: str | None
    reasons: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "gpus": list(self.gpus),
            "nvlink_domain": self.nvlink_domain,
            "numa_node": self.numa_node,
            "ok": self.ok,
            "level": self.level,
            "worst_link": self.worst_link,
            "reasons": list(self.reasons),
        }


def parse_gpu_list(text: str) -> tuple[int, ...]:
    try:
        gpus = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise InputError(f"--gpus {text!r}: expected GPU indices like 0,1,2,3") from exc
    if not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise InputError(f"--gpus {text!r}: give distinct non-negative GPU indices like 0,1,2,3")
    return gpus


def verify_gpu_set(node: Node, gpus: tuple[int, ...]) -> GpuSetVerdict:
    known = {g.index for g in node.gpus}
    missing = [g for g in gpus if g not in known]
    if missing:
        raise InputError(f"node {node.name} has no GPU {missing} (it has {sorted(known)})")
    dmap = build_domain_map(Cluster(name=node.name, nodes=(node,)))
    refs = {gpu_ref(node.name, g) for g in gpus}
    reasons: list[str] = []
    worst: LinkKind | None = None
    sys_pairs: list[str] = []
    non_nv: list[str] = []
    for a, b in combinations(sorted(gpus), 2):
        link = node.link(a, b)
        kind = link.kind if link is not None else LinkKind.SYS
        if worst is None or kind.rank > worst.rank:
            worst = kind
        label = f"NV{link.nvlinks}" if link is not None and kind is LinkKind.NVLINK else kind.value
        if kind is not LinkKind.NVLINK:
            non_nv.append(f"GPU{a}-GPU{b} {label}")
        if kind is LinkKind.SYS:
            sys_pairs.append(f"GPU{a}-GPU{b}")
    domain = None
    in_clique = False
    for d in dmap.domains:
        if refs <= set(d.gpus):
            domain = d.id
            in_clique = any(refs <= set(c) for c in d.cliques)
    numas = {node.gpu(g).numa_node for g in gpus}
    numa = next(iter(numas)) if len(numas) == 1 else None
    groups = {grp.id for grp in dmap.numa_groups for ref in refs if ref in grp.gpus}
    one_numa = len(groups) == 1 and all(any(ref in grp.gpus for grp in dmap.numa_groups) for ref in refs)
    if len(gpus) > 1 and in_clique and not non_nv:
        return GpuSetVerdict(node.name, gpus, domain, numa, True, "nvlink", _name(worst), ())
    if len(gpus) == 1:
        return GpuSetVerdict(node.name, gpus, domain, numa, True, "nvlink" if domain else "numa", None, ())
    reasons.append(
        "not inside one NVLink clique: " + (", ".join(non_nv[:6]) if non_nv else f"spans domains of {node.name}")
    )
    if one_numa and not sys_pairs:
        return GpuSetVerdict(node.name, gpus, domain, numa, True, "numa", _name(worst), tuple(reasons))
    if not one_numa:
        where = sorted(str(n) for n in numas) if None not in numas else sorted(g.split("/", 1)[1] for g in groups)
        reasons.append(f"not inside one NUMA node ({', '.join(where) or 'NUMA unknown'})")
    if sys_pairs:
        reasons.append("SYS (cross-socket) between " + ", ".join(sys_pairs[:6]))
    return GpuSetVerdict(node.name, gpus, domain, numa, False, "none", _name(worst), tuple(reasons))


def _name(kind: LinkKind | None) -> str | None:
    return None if kind is None else kind.value
