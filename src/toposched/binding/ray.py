"""Ray placement groups for a plan: one GPU per bundle, each bundle tied to its NVLink domain.

Ray cannot be told which physical GPU of a node a bundle takes, but it can be told which node (and
so which NVLink domain) through a custom resource (engines.md section 9: bundles may mix
``{"GPU": 1, "<custom>": 1}``). Each GPU's bundle asks for one unit of a resource that names its
NVLink domain (``nvl_<domain>``) when that domain lies within one node, or else its node
(``host_<node>``): PCIe machines, whose GPUs are in no domain, and the trays of a multi-node NVLink
domain (GB200 NVL72), where a domain resource would be declared on every tray and let Ray put the
bundles on trays, and in numbers per tray, other than the plan's. ``ray_start`` gives the
``ray start`` flags that declare those resources on each node.

Bundles are in rank order, so ``VLLM_RAY_BUNDLE_INDICES`` (engines.md 1.3: comma-separated, one
per worker, no duplicates) is ``0,1,...``; the strategy is ``STRICT_PACK`` for a one-node placement
and ``PACK`` otherwise (the domain resources already decide the nodes). vLLM uses a placement group
when it runs inside one (``ray.util.get_current_placement_group()``), with
``--distributed-executor-backend ray``.

Ray itself is an optional extra (``pip install toposched[ray]``); this module does not import it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from toposched.binding.engines import build_launches, vllm_ray_argv
from toposched.binding.node_launch import Engine
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError
from toposched.solver.request import Placement
from toposched.topology.domains import DomainMap, build_domain_map, gpu_ref


class RayPlacement(BaseModel):
    """A placement group spec for one placement, and how to run vLLM in it."""

    model_config = ConfigDict(frozen=True)

    placement: str
    name: str
    strategy: Literal["STRICT_PACK", "PACK"]
    bundles: list[dict[str, float]]
    env: dict[str, str]
    argv: list[str]
    node_resources: dict[str, dict[str, float]]
    """Per node, the custom resources this placement needs declared there (``ray start --resources``)."""


def resource_name(kind: Literal["nvl", "host"], ident: str) -> str:
    """A Ray custom-resource name for an NVLink domain or a node: ``nvl_h100_00_nv0``."""
    return f"{kind}_" + re.sub(r"[^A-Za-z0-9]+", "_", ident).strip("_")


def gpu_resource(dmap: DomainMap, node: str, gpu: int) -> str:
    """The resource a GPU's bundle asks for: its NVLink domain when that lies within one node, else its node.

    A domain that spans nodes (the trays of an NVL72) names no node, so it would not hold a bundle to
    the planned tray: the node is named instead (it implies the domain).
    """
    domain = dmap.domain_of(gpu_ref(node, gpu))
    if domain is not None and len(domain.nodes) == 1:
        return resource_name("nvl", domain.id)
    return resource_name("host", node)


def _check_unique(dmap: DomainMap, nodes: set[str]) -> None:
    """Two domains must not collapse to one resource name."""
    names: dict[str, str] = {}
    for ident, name in [(d.id, resource_name("nvl", d.id)) for d in dmap.domains] + [
        (n, resource_name("host", n)) for n in sorted(nodes)
    ]:
        if names.setdefault(name, ident) != ident:
            raise InputError(f"{ident!r} and {names[name]!r} both become the Ray resource {name!r}; rename one")


def placement_group_spec(doc: PlanDoc, placement: Placement, dmap: DomainMap, argv: list[str]) -> RayPlacement:
    ranks = sorted(placement.ranks, key=lambda r: r.rank)
    bundles: list[dict[str, float]] = []
    node_resources: dict[str, dict[str, float]] = {}
    for r in ranks:
        res = gpu_resource(dmap, r.node, r.gpu)
        bundles.append({"GPU": 1.0, res: 1.0})
        node = doc.cluster.node(r.node)
        # Declare the whole domain's (or node's) GPUs on the node, not only the planned ones.
        members = [g.index for g in node.gpus if gpu_resource(dmap, r.node, g.index) == res]
        node_resources.setdefault(r.node, {})[res] = float(len(members))
    nodes = {r.node for r in ranks}
    return RayPlacement(
        placement=placement.id,
        name=f"toposched-{placement.id}",
        strategy="STRICT_PACK" if len(nodes) == 1 else "PACK",
        bundles=bundles,
        env={"VLLM_RAY_BUNDLE_INDICES": ",".join(str(i) for i in range(len(bundles)))},
        argv=argv,
        node_resources=node_resources,
    )


def ray_specs(doc: PlanDoc, *, model_path: str | None = None) -> list[RayPlacement]:
    """One placement-group spec per placement of the plan (vLLM with the Ray executor)."""
    dmap = build_domain_map(doc.cluster)
    _check_unique(dmap, {n.name for n in doc.cluster.nodes})
    launches = build_launches(doc.placements, doc.request, doc.cluster, "vllm", model_path=model_path)
    port = {launch.placement: launch.port for launch in launches if launch.node_rank == 0}
    return [
        placement_group_spec(doc, p, dmap, vllm_ray_argv(p, doc.request, model_path=model_path, port=port[p.id]))
        for p in doc.placements
    ]


def ray_start_args(specs: list[RayPlacement], doc: PlanDoc) -> dict[str, list[str]]:
    """Per node, the ``ray start`` flags that declare its GPUs and the domain resources of all specs."""
    merged: dict[str, dict[str, float]] = {}
    for spec in specs:
        for node, res in spec.node_resources.items():
            merged.setdefault(node, {}).update(res)
    out: dict[str, list[str]] = {}
    for node in sorted(merged):
        gpus = len(doc.cluster.node(node).gpus)
        resources = {k: int(v) if v.is_integer() else v for k, v in sorted(merged[node].items())}
        out[node] = ["--num-gpus", str(gpus), "--resources", json.dumps(resources, separators=(",", ":"))]
    return out


UNSUPPORTED: dict[Engine, str] = {
    "sglang": "toposched hands placement groups only to vLLM's Ray executor; launch SGLang per node "
    "(`launch sglang` or `launch k8s --engine sglang`)",
    "trtllm": "no Ray executor was found in what could be read of TensorRT-LLM here: trtllm-serve's options at "
    "commit 00209af1 (tensorrt_llm/commands/serve.py) have none, and its LLM-API fields could "
    "not be read (PyPI's tensorrt-llm 1.2.1 and 1.4.0rc1 are source-less placeholders); its ranks run under "
    "mpirun or srun (`launch trtllm`, `launch k8s --engine trtllm`)",
}
"""Engines ``launch ray`` cannot launch, and why: only vLLM's Ray executor takes a placement group."""


def check_ray_engine(engine: Engine) -> None:
    """Refuse an engine ``launch ray`` cannot launch, saying why."""
    if engine in UNSUPPORTED:
        raise InputError(f"launch ray --engine {engine}: not supported: {UNSUPPORTED[engine]}", fix="use --engine vllm")


def ray_warnings(doc: PlanDoc) -> list[str]:
    """A placement that takes part of a node: Ray's bundles pin the node (or NVLink domain), not the GPUs, so
    Ray may hand the workers other GPUs of that node than the planned ones (ones the plan counts busy)."""
    out = []
    for p in doc.placements:
        for node in sorted({r.node for r in p.ranks}):
            planned = sorted(r.gpu for r in p.ranks if r.node == node)
            total = len(doc.cluster.node(node).gpus)
            if len(planned) < total:
                out.append(
                    f"placement {p.id} uses GPUs {planned} of the {total} of node {node}; Ray bundles pin the node "
                    "(or NVLink domain), not the GPUs, so Ray may give its workers others on that node: start Ray "
                    "there with CUDA_VISIBLE_DEVICES set to the planned GPUs and --num-gpus to their count"
                )
    return out


def ray_document(doc: PlanDoc, *, model_path: str | None = None, engine: Engine = "vllm") -> dict[str, Any]:
    """What ``toposched launch ray`` prints: the specs and the per-node ``ray start`` flags."""
    check_ray_engine(engine)
    specs = ray_specs(doc, model_path=model_path)
    return {
        "placement_groups": [s.model_dump(mode="json", exclude={"node_resources"}) for s in specs],
        "ray_start": ray_start_args(specs, doc),
    }
