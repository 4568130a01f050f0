"""The node affinity of a plan's pods: ``node_requirements`` is the one place that decides which nodes a pod may
run on (its planned nodes, the GPU Feature Discovery labels, the request's node selector, racks and zones), so
``lint_nodes`` checks exactly what the scheduler will."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from toposched.binding.k8s_options import K8sOptions, Obj
from toposched.binding.plan_doc import PlanDoc
from toposched.solver.request import Placement
from toposched.topology.model import Cluster

HOSTNAME = "kubernetes.io/hostname"
ZONE = "topology.kubernetes.io/zone"
GPU_PRODUCT = "nvidia.com/gpu.product"
GPU_CLIQUE = "nvidia.com/gpu.clique"
_GFD_CLIQUE = re.compile(r"^[0-9a-fA-F-]{36}[./]\d+$")


@dataclass(frozen=True)
class Requirement:
    """One node-affinity match expression."""

    key: str
    operator: Literal["In", "Exists"]
    values: tuple[str, ...] = ()

    def expression(self) -> Obj:
        expr: Obj = {"key": self.key, "operator": self.operator}
        if self.operator == "In":
            expr["values"] = list(self.values)
        return expr

    def check(self, labels: Mapping[str, str]) -> str | None:
        """Why a node with these labels fails this requirement, or None."""
        if self.key not in labels:
            return f"no label {self.key}"
        if self.operator == "In" and labels[self.key] not in self.values:
            return f"{self.key}={labels[self.key]} is not one of {', '.join(self.values)}"
        return None


def gfd_product(model: str) -> str:
    """The ``nvidia.com/gpu.product`` value GFD writes for a GPU name (spaces become '-', engines.md 6.1)."""
    return "-".join(model.split())


def _node_clique(cluster: Cluster, node: str) -> tuple[str, str | None] | None:
    """(clique id, GFD label value or None when unknown) for a node in a multi-node NVLink clique."""
    labels = cluster.node(node).labels
    for clique in cluster.cliques:
        if node in clique.nodes:
            if GPU_CLIQUE in labels:
                return clique.id, labels[GPU_CLIQUE]
            if _GFD_CLIQUE.match(clique.id):
                return clique.id, clique.id.replace("/", ".")
            return clique.id, None
    return None


def node_requirements(doc: PlanDoc, placement: Placement, nodes: Sequence[str], opts: K8sOptions) -> list[Requirement]:
    """The node-affinity expressions of a pod template that may run on any of ``nodes``."""
    cluster, request = doc.cluster, doc.request
    reqs = [Requirement(HOSTNAME, "In", tuple(nodes))]
    models = sorted({cluster.node(r.node).gpu(r.gpu).model or "" for r in placement.ranks if r.node in nodes} - {""})
    if models:
        reqs.append(Requirement(GPU_PRODUCT, "In", tuple(gfd_product(m) for m in models)))
    placement_nodes = {r.node for r in placement.ranks}
    cliques = {_node_clique(cluster, n) for n in placement_nodes}
    clique = next(iter(cliques)) if len(placement_nodes) > 1 and len(cliques) == 1 else None
    if clique is not None:
        value = clique[1]
        reqs.append(Requirement(GPU_CLIQUE, "In", (value,)) if value else Requirement(GPU_CLIQUE, "Exists"))
    for key, value in sorted(request.node_selector.items()):
        reqs.append(Requirement(key, "In", (value,)))
    for label, wanted, attr in ((opts.rack_label, request.racks, "rack"), (ZONE, request.zones, "zone")):
        if wanted:
            have = sorted({getattr(cluster.node(n), attr) for n in nodes} - {None})
            reqs.append(Requirement(label, "In", tuple(have or wanted)))
    return reqs
