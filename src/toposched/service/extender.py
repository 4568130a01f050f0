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

The body is validated against typed models of the fields read (``Pod``, ``NodeList``; every other field
passes through). A malformed one is never a 5xx but what kube-scheduler's contract expects: the filter
verb answers 200 with ``Error`` set (the scheduling attempt fails, or the extender is skipped when
``ignorable``), the prioritize verb 422 (kube-scheduler then gives no score from this extender).

There is no ``bind`` verb: GPU bookings go through ``POST /v1/placements``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictInt, StrictStr, WithJsonSchema, model_validator
from starlette.exceptions import HTTPException

from toposched.names import MAX_NODE_NAME, NODE_NAME_PATTERN, NodeName
from toposched.service.api import ERRORS, on_worker
from toposched.service.guards import too_large
from toposched.service.schemas import ErrorOut
from toposched.service.state import ServiceState

EXTENDER_PREFIX = "/v1/extender/"
GPU_RESOURCE = "nvidia.com/gpu"
PLACEMENT_KEY = "toposched.io/placement"
MAX_PRIORITY = 10
MAX_GPUS = 1_000_000
"""Most GPUs one pod may ask for (a larger count is refused as malformed, not as "does not fit")."""


# ------------------------------------------------------------------------------------ what kube-scheduler sends
class K8sObject(BaseModel):
    """The fields toposched reads of a Kubernetes object, typed; every other field passes through untouched."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)


K8sNodeName = Annotated[
    NodeName, WithJsonSchema({"type": "string", "pattern": NODE_NAME_PATTERN, "maxLength": MAX_NODE_NAME})
]
"""A node name (``toposched.names``: a DNS-1123 subdomain, as Kubernetes requires), its rule in the OpenAPI spec."""

Quantity = StrictStr | StrictInt
"""A ``resource.Quantity``: Go writes a string ("4", "500m"); a number is accepted too."""


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: the filter answer echoes the node list it was sent (and
    its unknown fields), which may hold text that is not valid UTF-8 (a lone surrogate from a JSON escape
    such as backslash-u-d800); escaped, it is still the JSON that came in, where UTF-8 would fail (a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def gpu_count(value: Quantity) -> int:
    """A ``nvidia.com/gpu`` quantity as a count: a whole number from 0 to MAX_GPUS, else ValueError."""
    text = str(value).strip()
    if not re.fullmatch(r"[0-9]{1,7}", text) or int(text) > MAX_GPUS:  # ASCII digits only (int() takes others)
        raise ValueError(f"{GPU_RESOURCE} is {str(value)[:40]!r}: not a whole number of GPUs (0 to {MAX_GPUS})")
    return int(text)


class ResourceRequirements(K8sObject):
    limits: dict[str, Quantity] | None = None
    requests: dict[str, Quantity] | None = None

    @model_validator(mode="after")
    def _gpus_are_counts(self) -> ResourceRequirements:
        for amounts in (self.limits, self.requests):
            if amounts and GPU_RESOURCE in amounts:
                gpu_count(amounts[GPU_RESOURCE])
        return self

    def gpus(self) -> int:
        """``nvidia.com/gpu`` from the limits, else the requests (Kubernetes makes them equal when both are set)."""
        for amounts in (self.limits, self.requests):
            if amounts and GPU_RESOURCE in amounts:
                return gpu_count(amounts[GPU_RESOURCE])
        return 0


class Container(K8sObject):
    name: str = ""
    resources: ResourceRequirements | None = None


class PodSpec(K8sObject):
    containers: list[Container] | None = None


class ObjectMeta(K8sObject):
    name: str = ""
    namespace: str = ""
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class Pod(K8sObject):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: PodSpec = Field(default_factory=PodSpec)


class NodeMeta(K8sObject):
    name: K8sNodeName


class Node(K8sObject):
    metadata: NodeMeta


class NodeList(K8sObject):
    items: list[Node] | None = None


class ExtenderArgs(BaseModel):
    """``ExtenderArgs``: the pod and its candidate nodes, as ``Nodes`` (full objects) or ``NodeNames``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    pod: Pod = Field(validation_alias=AliasChoices("Pod", "pod"))
    nodes: NodeList | None = Field(default=None, validation_alias=AliasChoices("Nodes", "nodes"))
    node_names: list[K8sNodeName] | None = Field(
        default=None, validation_alias=AliasChoices("NodeNames", "nodeNames", "nodenames")
    )


# ------------------------------------------------------------------------------------ what toposched answers
class ExtenderFilterResult(BaseModel):
    """``ExtenderFilterResult``; a non-empty ``Error`` fails the call (the pod is not scheduled this round)."""

    nodes: dict[str, Any] | None = Field(alias="Nodes", description="the NodeList sent, with only passing nodes")
    node_names: list[str] | None = Field(alias="NodeNames", description="passing nodes (NodeNames form)")
    failed: dict[str, str] = Field(alias="FailedNodes", description="node: why not (may pass later)")
    unresolvable: dict[str, str] = Field(alias="FailedAndUnresolvableNodes", description="node: why never")
    error: str = Field(alias="Error", description="why the whole call failed (a malformed ExtenderArgs)")


class HostPriority(BaseModel):
    host: str = Field(alias="Host")
    score: int = Field(alias="Score", ge=0, le=MAX_PRIORITY)


def pod_gpus(pod: Pod) -> int:
    """GPUs the pod asks for: the sum over its containers."""
    return sum(c.resources.gpus() for c in pod.spec.containers or () if c.resources is not None)


def pod_placement(pod: Pod) -> str | None:
    meta = pod.metadata
    for labels in (meta.annotations, meta.labels):
        value = (labels or {}).get(PLACEMENT_KEY)
        if value:
            return value
    return None


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def node_names(args: ExtenderArgs) -> list[str]:
    if args.node_names is not None:
        return list(args.node_names)
    return [item.metadata.name for item in (args.nodes.items if args.nodes else None) or ()]


def malformed(exc: RequestValidationError | HTTPException) -> str:
    """The ``Error`` text for a body that is not an ExtenderArgs: the first few problems, each where it is."""
    if isinstance(exc, HTTPException) or any(e["type"] == "json_invalid" for e in exc.errors()):
        return "malformed ExtenderArgs: the body is not a JSON document in UTF-8"
    problems = [f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in exc.errors()[:5]]
    more = f" (and {len(exc.errors()) - 5} more)" if len(exc.errors()) > 5 else ""
    return "malformed ExtenderArgs: " + "; ".join(problems) + more


class FilterRoute(APIRoute):
    """The filter verb answers a malformed body per kube-scheduler's contract: 200 with ``Error`` set."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except (RequestValidationError, HTTPException) as exc:
                if isinstance(exc, HTTPException) and (exc.status_code != 400 or too_large(exc)):
                    raise  # 413: the app's handler answers
                return AsciiJSONResponse(filter_error(malformed(exc)))

        return answer


def drop_validation_answer(schema: dict[str, Any]) -> dict[str, Any]:
    """Take out the 422 FastAPI documents for every body: the filter verb answers 200 with ``Error`` instead."""
    schema["paths"][EXTENDER_PREFIX + "filter"]["post"]["responses"].pop("422", None)
    return schema


def filter_error(error: str) -> dict[str, Any]:
    return {"Nodes": None, "NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": error}


class Verdicts:
    """Per node: why not (failed or unresolvable) or a score; computed once per call under the state lock."""

    def __init__(self, state: ServiceState, pod: Pod, names: list[str]) -> None:
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
        shown = wanted if len(wanted) <= 128 else wanted[:125] + "..."
        hosts = {
            r.node
            for group in state.placed_groups()  # incomplete requests (being booked or cleaned up) excluded
            for i in group
            if key in (_norm(i.placement.id), _norm(i.request_id))
            for r in i.placement.ranks
        }
        for name in names:
            if not hosts:
                self.unresolvable[name] = f"toposched has no placement {shown}"
            elif name in hosts:
                self.scores[name] = MAX_PRIORITY
            else:
                self.failed[name] = f"placement {shown} has no rank on this node (it uses {', '.join(sorted(hosts))})"

    def _by_gpus(self, state: ServiceState, gpus: int, names: list[str]) -> None:
        index = state.scheduler.index
        nvlink, node_level = index.levels["nvlink"], index.levels["node"]
        domains_of: dict[str, list[int]] = {}  # NVLink domains inside one node, by node
        for i, group in enumerate(nvlink.groups):
            if len(group.nodes) == 1:
                domains_of.setdefault(next(iter(group.nodes)), []).append(i)
        node_free: dict[str, int] = {}
        for i, group in enumerate(node_level.groups):
            for node in group.nodes:
                node_free[node] = node_free.get(node, 0) + node_level.free_count[i]
        for name in names:
            if name not in index.nodes:
                self.unresolvable[name] = "node is not in toposched's topology"
                continue
            domains = domains_of.get(name, [])
            sizes = [len(nvlink.groups[i].gpus) for i in domains]
            fits = [nvlink.free_count[i] for i in domains if nvlink.free_count[i] >= gpus]
            if fits:
                self.scores[name] = max(1, round(MAX_PRIORITY * gpus / min(fits)))
                continue
            if gpus > max(sizes, default=0):
                free = node_free.get(name, 0)
                if free >= gpus:
                    self.scores[name] = max(1, round(MAX_PRIORITY * gpus / free))
                    continue
                self.failed[name] = f"{free} free GPU(s) on the node, the pod asks for {gpus}"
                continue
            best = max((nvlink.free_count[i] for i in domains), default=0)
            self.failed[name] = f"no NVLink domain with {gpus} free GPUs (best has {best})"


def build_extender(state: ServiceState) -> APIRouter:
    """The two verbs; a malformed ExtenderArgs gets ``Error`` from filter and a 422 from prioritize, never a 5xx."""
    router = APIRouter(prefix=EXTENDER_PREFIX.rstrip("/"), tags=["kubernetes"])
    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorOut, **ERRORS[code]}
        for code in (401, 413, 503)
        if code != 401 or (state.config.auth and not state.config.open_extender)
    }

    async def extender_filter(args: ExtenderArgs) -> JSONResponse:
        names = node_names(args)
        verdicts = await on_worker(state, Verdicts, state, args.pod, names)
        passed = [n for n in names if n in verdicts.scores]
        result: dict[str, Any] = {
            "Nodes": None,
            "NodeNames": None,
            "FailedNodes": verdicts.failed,
            "FailedAndUnresolvableNodes": verdicts.unresolvable,
            "Error": "",
        }
        if args.node_names is not None:
            result["NodeNames"] = passed
        elif args.nodes is not None:
            keep = set(passed)
            sent = args.nodes.model_dump(mode="json", by_alias=True, exclude_unset=True)
            kept = [
                item.model_dump(mode="json", by_alias=True, exclude_unset=True)
                for item in args.nodes.items or ()
                if item.metadata.name in keep
            ]
            result["Nodes"] = {**sent, "items": kept}
        return AsciiJSONResponse(result)

    router.add_api_route(
        "/filter",
        extender_filter,
        methods=["POST"],
        route_class_override=FilterRoute,
        responses={200: {"model": ExtenderFilterResult}, **errors},
        summary="kube-scheduler extender filter (ExtenderArgs -> ExtenderFilterResult; malformed: Error set)",
    )

    @router.post(
        "/prioritize",
        responses={200: {"model": list[HostPriority]}, 422: {"model": ErrorOut, **ERRORS[422]}, **errors},
        summary="kube-scheduler extender prioritize (ExtenderArgs -> HostPriorityList; malformed: 422)",
    )
    async def extender_prioritize(args: ExtenderArgs) -> JSONResponse:
        names = node_names(args)
        verdicts = await on_worker(state, Verdicts, state, args.pod, names)
        return JSONResponse([{"Host": n, "Score": verdicts.scores.get(n, 0)} for n in names])

    return router
