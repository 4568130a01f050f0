"""KubeletConfiguration for the nodes a plan uses (engines.md section 5).

The Topology Manager policy comes from the plan: ``single-numa-node`` only where every pod planned on
a node has its GPUs in one NUMA node; otherwise ``best-effort`` (``restricted`` would also reject the
pods whenever their CPUs or memory fit in fewer NUMA nodes than their GPUs). Each config carries the
reason it was chosen.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError

Obj = dict[str, Any]


# --- KubeletConfiguration (engines.md section 5) -------------------------------------------------

KUBELET_POLICIES = ("auto", "single-numa-node", "restricted", "best-effort", "none")
# The kubelet's Linux hard-eviction defaults; setting evictionHard replaces the whole map, so all are kept.
EVICTION_HARD_DEFAULTS = {
    "memory.available": "100Mi",
    "nodefs.available": "10%",
    "nodefs.inodesFree": "5%",
    "imagefs.available": "15%",
}


def _mib(quantity: str) -> int:
    match = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    if not match:
        raise InputError(f"memory quantity {quantity!r} must be a whole number of Mi or Gi")
    return int(match.group(1)) * (1024 if match.group(2) == "Gi" else 1)


@dataclass(frozen=True)
class KubeletConfig:
    """A KubeletConfiguration for ``nodes``, and why its Topology Manager policy was chosen."""

    nodes: list[str]
    config: Obj
    reason: str

    def document(self) -> Obj:
        """What ``launch k8s --kubelet`` prints: the nodes, the reason, the config (in that order)."""
        return {"nodes": list(self.nodes), "reason": self.reason, "config": self.config}


def _pod_numas(doc: PlanDoc) -> dict[str, list[tuple[str, tuple[int, ...] | None]]]:
    """Per node: (placement id, the NUMA nodes of that pod's GPUs, or None when one is unknown)."""
    out: dict[str, list[tuple[str, tuple[int, ...] | None]]] = {}
    for p in doc.placements:
        gpus: dict[str, list[int]] = {}
        for r in p.ranks:
            gpus.setdefault(r.node, []).append(r.gpu)
        for node, indices in gpus.items():
            numas = [doc.cluster.node(node).gpu(g).numa_node for g in indices]
            known = None if any(n is None for n in numas) else tuple(sorted({n for n in numas if n is not None}))
            out.setdefault(node, []).append((p.id, known))
    return out


def topology_policy(pods: Sequence[tuple[str, tuple[int, ...] | None]]) -> tuple[str, str]:
    """The Topology Manager policy (pod scope) that admits every pod planned on a node, and why.

    ``single-numa-node`` refuses a pod whose GPUs span NUMA nodes (TopologyAffinityError), and so
    does ``restricted`` whenever the pod's CPUs or memory fit in fewer NUMA nodes than its GPUs (the
    kubelet prefers a merged hint only when every resource prefers the same NUMA set).
    """
    spans = sorted({numas for _, numas in pods if numas is not None and len(numas) > 1})
    if spans:
        shown = " and ".join(",".join(str(n) for n in numas) for numas in spans)
        return "best-effort", (
            f"a pod planned here has its GPUs on NUMA nodes {shown}: single-numa-node would refuse it "
            "(TopologyAffinityError) and restricted refuses it whenever its CPUs or memory fit in fewer NUMA "
            "nodes; best-effort admits it and still aligns what it can"
        )
    if any(numas is None for _, numas in pods):
        return "best-effort", (
            "the plan does not know the NUMA node of every GPU planned here, so it cannot promise that "
            "single-numa-node would admit the pods; best-effort admits them and aligns what it can"
        )
    return "single-numa-node", (
        "every pod planned here has its GPUs in one NUMA node, so single-numa-node admits it and keeps its "
        "CPUs and memory beside its GPUs"
    )


def kubelet_configs(
    doc: PlanDoc,
    *,
    policy: str = "auto",
    scope: Literal["container", "pod"] = "pod",
    kube_reserved: str = "1Gi",
    system_reserved: str = "1Gi",
    eviction_memory: str = "100Mi",
    reserved_system_cpus: str = "0-1",
) -> list[KubeletConfig]:
    """KubeletConfiguration snippets for the plan's nodes, one per distinct NUMA layout and policy.

    ``policy="auto"`` chooses per node with :func:`topology_policy`; a named policy is used as given,
    except ``single-numa-node`` where a planned pod spans NUMA nodes, which is refused (the kubelet
    would reject that pod). The Static memory manager needs ``reservedMemory`` summing, per memory
    type, to kube-reserved + system-reserved + the hard eviction threshold (Kubernetes docs,
    engines.md 5); the sum is split evenly over the node's NUMA nodes, the remainder on the first.
    """
    if policy not in KUBELET_POLICIES:
        raise InputError(f"topology manager policy {policy!r} is not one of {', '.join(KUBELET_POLICIES)}")
    total = _mib(kube_reserved) + _mib(system_reserved) + _mib(eviction_memory)
    pods = _pod_numas(doc)
    groups: dict[tuple[tuple[int, ...], str, str], list[str]] = {}
    for name in sorted(pods):
        numa = tuple(sorted({g.numa_node for g in doc.cluster.node(name).gpus if g.numa_node is not None})) or (0,)
        chosen, reason = topology_policy(pods[name])
        if policy != "auto":
            span = next(((pid, n) for pid, n in pods[name] if n is not None and len(n) > 1), None)
            if policy == "single-numa-node" and span is not None:
                raise InputError(
                    f"--topology-policy single-numa-node: the kubelet of node {name} would refuse the pod of "
                    f"placement {span[0]} (its GPUs are on NUMA nodes {','.join(str(n) for n in span[1])})",
                    fix="use --topology-policy auto (the default), restricted or best-effort",
                )
            chosen, reason = policy, f"--topology-policy {policy} as asked (auto would choose {chosen})"
        groups.setdefault((numa, chosen, reason), []).append(name)
    out: list[KubeletConfig] = []
    for (numa, chosen, reason), nodes in groups.items():
        share, rest = divmod(total, len(numa))
        reserved = [
            {"numaNode": n, "limits": {"memory": f"{share + (rest if i == 0 else 0)}Mi"}} for i, n in enumerate(numa)
        ]
        config: Obj = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cpuManagerPolicy": "static",
            "reservedSystemCPUs": reserved_system_cpus,
            "memoryManagerPolicy": "Static",
            "topologyManagerPolicy": chosen,
            "topologyManagerScope": scope,
            # Stable in current Kubernetes; beta behind TopologyManagerPolicyBetaOptions in older releases.
            "topologyManagerPolicyOptions": {"prefer-closest-numa-nodes": "true"},
            "kubeReserved": {"memory": kube_reserved},
            "systemReserved": {"memory": system_reserved},
            "evictionHard": {**EVICTION_HARD_DEFAULTS, "memory.available": eviction_memory},
            "reservedMemory": reserved,
        }
        out.append(KubeletConfig(nodes, config, reason))
    return out
