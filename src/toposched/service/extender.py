"""Kubernetes scheduler extender: kube-scheduler asks toposched to filter and rank nodes for a pod.

The JSON is kube-scheduler's extender API (``k8s.io/kube-scheduler/extender/v1``): ``ExtenderArgs``
``{"Pod", "Nodes" | "NodeNames"}`` in, ``ExtenderFilterResult`` or ``HostPriorityList`` out (Go decodes
field names case-insensitively; we answer in Go's spelling). A sample ``KubeSchedulerConfiguration`` is in
``deploy/kubernetes/``. What is decided:

* a pod labelled or annotated ``toposched.io/placement: ID`` (what ``toposched launch k8s`` writes) may
  only go to the nodes that placement's ranks use; score 10 there;
* another pod asking for ``nvidia.com/gpu: G`` passes on a node where one NVLink domain has ``G`` free
  GPUs (or, for ``G`` larger than any domain on the node, where the node has ``G`` free); the score favours
  the tightest fit (``10 x G / free GPUs of the best domain``), keeping large domains whole;
* a pod without GPUs passes everywhere with score 0; a node toposched does not know fails a GPU pod.

There is no ``bind`` verb: GPU bookings go through ``POST /v1/placements``.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from toposched.service.api import on_worker
from toposched.service.state import ServiceState

GPU_RESOURCE = "nvidia.com/gpu"
PLACEMENT_KEY = "toposched.io/placement"
MAX_PRIORITY = 10


class ExtenderArgs(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    pod: dict[str, Any] | None = Field(default=None, validation_alias=AliasChoices("Pod", "pod"))
    nodes: dict[str, Any] | None = Field(default=None, validation_alias=AliasChoices("Nodes", "nodes"))
    node_names: list[str] | None = Field(default=None, validation_alias=AliasChoices("NodeNames", "nodenames"))


def _gpu_count(value: object) -> int:
    try:
        return max(0, int(str(value)))
    except ValueError:
        return 0


def pod_gpus(pod: dict[str, Any]) -> int:
    """GPUs the pod asks for: the sum over containers of ``nvidia.com/gpu`` limits (else requests)."""
    spec = pod.get("spec") or {}
    total = 0
    for container in spec.get("containers") or []:
        resources = (container or {}).get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        total += _gpu_count(limits.get(GPU_RESOURCE, requests.get(GPU_RESOURCE, 0)))
    return total


def pod_placement(pod: dict[str, Any]) -> str | None:
    meta = pod.get("metadata") or {}
    for where in ("annotations", "labels"):
        value = (meta.get(where) or {}).get(PLACEMENT_KEY)
        if value:
            return str(value)
    return None


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def node_names(args: ExtenderArgs) -> list[str]:
    if args.node_names is not None:
        return list(args.node_names)
    items = (args.nodes or {}).get("items") or []
    return [str((item.get("metadata") or {}).get("name", "")) for item in items if isinstance(item, dict)]


class Verdicts:
    """Per node: None (fits) or why not, plus a score; computed once per call under the state lock."""

    def __init__(self, state: ServiceState, pod: dict[str, Any], names: list[str]) -> None:
        self.failed: dict[str, str] = {}
        self.unresolvable: dict[str, str] = {}
        self.scores: dict[str, int] = {}
        wanted = pod_placement(pod)
        gpus = pod_gpus(pod)
        with state.lock:
            if wanted is not None:
                self._by_placement(state, wanted, names)
            elif gpus:
                self._by_gpus(state, gpus, names)
            else:
                self.scores = dict.fromkeys(names, 0)

    def _by_placement(self, state: ServiceState, wanted: str, names: list[str]) -> None:
        key = _norm(wanted)
        hosts = {
            r.node
            for i in state.instances.values()
            if key in (_norm(i.placement.id), _norm(i.request_id))
            for r in i.placement.ranks
        }
        for name in names:
            if not hosts:
                self.unresolvable[name] = f"toposched has no placement {wanted}"
            elif name in hosts:
                self.scores[name] = MAX_PRIORITY
            else:
                self.failed[name] = f"placement {wanted} has no rank on this node (it uses {', '.join(sorted(hosts))})"

    def _by_gpus(self, state: ServiceState, gpus: int, names: list[str]) -> None:
        index = state.scheduler.index
        nvlink, node_level = index.levels["nvlink"], index.levels["node"]
        for name in names:
            if name not in index.nodes:
                self.unresolvable[name] = "node is not in toposched's topology"
                continue
            domains = [i for i, g in enumerate(nvlink.groups) if name in g.nodes and len(g.nodes) == 1]
            sizes = [len(nvlink.groups[i].gpus) for i in domains]
            fits = [nvlink.free_count[i] for i in domains if nvlink.free_count[i] >= gpus]
            if fits:
                self.scores[name] = max(1, round(MAX_PRIORITY * gpus / min(fits)))
                continue
            if gpus > max(sizes, default=0):
                free = sum(node_level.free_count[i] for i, g in enumerate(node_level.groups) if name in g.nodes)
                if free >= gpus:
                    self.scores[name] = max(1, round(MAX_PRIORITY * gpus / free))
                    continue
                self.failed[name] = f"{free} free GPU(s) on the node, the pod asks for {gpus}"
                continue
            best = max((nvlink.free_count[i] for i in domains), default=0)
            self.failed[name] = f"no NVLink domain with {gpus} free GPUs (best has {best})"


def build_extender(state: ServiceState) -> APIRouter:
    router = APIRouter(prefix="/v1/extender", tags=["kubernetes"])

    @router.post("/filter", summary="kube-scheduler extender filter (ExtenderArgs -> ExtenderFilterResult)")
    async def extender_filter(args: ExtenderArgs) -> dict[str, Any]:
        names = node_names(args)
        verdicts = await on_worker(state, Verdicts, state, args.pod or {}, names)
        passed = [n for n in names if n in verdicts.scores]
        result: dict[str, Any] = {
            "FailedNodes": verdicts.failed,
            "FailedAndUnresolvableNodes": verdicts.unresolvable,
            "Error": "",
        }
        if args.node_names is not None:
            result["NodeNames"] = passed
            result["Nodes"] = None
        else:
            items = (args.nodes or {}).get("items") or []
            keep = set(passed)
            kept = [i for i in items if isinstance(i, dict) and (i.get("metadata") or {}).get("name") in keep]
            result["Nodes"] = {**(args.nodes or {}), "items": kept}
            result["NodeNames"] = None
        return result

    @router.post("/prioritize", summary="kube-scheduler extender prioritize (ExtenderArgs -> HostPriorityList)")
    async def extender_prioritize(args: ExtenderArgs) -> list[dict[str, Any]]:
        names = node_names(args)
        verdicts = await on_worker(state, Verdicts, state, args.pod or {}, names)
        return [{"Host": n, "Score": verdicts.scores.get(n, 0)} for n in names]

    return router
