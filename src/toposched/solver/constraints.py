"""Constraints as plugins: node filters (which nodes a request may use) and checks (does one choice hold).

Two kinds, in the shape of the Kubernetes scheduling framework's Filter plugins:

* a **node filter** looks at one node for one request and returns a ``Status`` (``ok``, or the
  plugin's name and why the node is out). ``Scheduler.group_filter`` accepts a group when every
  filter passes on each of its nodes; ``Scheduler.why_not`` runs them on *every* node and counts the
  reasons, so an unplaced request says why each node was out (``0/8,192 nodes ...: 8,000 with at
  most 3 free GPUs in one nvlink group, 192 excluded by node_selector``), not only the first few;
* a **check** looks at one concrete choice of GPUs after the cost model has predicted it and returns
  a ``ConstraintCheck`` (the model every ``Placement`` carries in ``constraints``, by name).

Adding a constraint is one function and one line in ``NODE_FILTERS`` or ``CHECKS``; callers find a
check by name (``Placement.check``), never by position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from toposched.solver.request import ConstraintCheck, Placement, PlacementRequest, ValueCache

if TYPE_CHECKING:
    from toposched.topology.model import Node

LEVEL_ORDER = ("nvlink", "pcie-switch", "numa", "node", "none")
"""Affinity levels, tightest first."""


@dataclass(frozen=True)
class Status:
    """One plugin's verdict on one node: ``ok``, or the plugin's name and why the node is out."""

    plugin: str
    ok: bool = True
    reason: str = ""


OK = Status("", True)


# ---------------------------------------------------------------------- node filters


@dataclass(frozen=True)
class FilterContext:
    """What the node filters of one decision read."""

    request: PlacementRequest
    nodes: frozenset[str]  # nodes of the candidate's GPU type
    replica_nodes: set[str]  # nodes the request's earlier replicas use
    near: Placement | None  # the placement ``request.near`` names, when placed here
    near_strict: bool  # the near preference is being tried as a requirement


NodeFilter = Callable[[FilterContext, "Node"], str | None]
"""Returns why ``node`` is out for this request, or None when it may be used."""


def _gpu_type(ctx: FilterContext, node: Node) -> str | None:
    return None if node.name in ctx.nodes else "another GPU type than the degree option's"


def _node_selector(ctx: FilterContext, node: Node) -> str | None:
    bad = [f"{k}={v}" for k, v in ctx.request.node_selector.items() if node.labels.get(k) != v]
    return f"labels lack {', '.join(bad)}" if bad else None


def _racks(ctx: FilterContext, node: Node) -> str | None:
    racks = ctx.request.racks
    return None if racks is None or node.rack in racks else f"rack {node.rack} is not in racks"


def _zones(ctx: FilterContext, node: Node) -> str | None:
    zones = ctx.request.zones
    return None if zones is None or node.zone in zones else f"zone {node.zone} is not in zones"


def _spread(ctx: FilterContext, node: Node) -> str | None:
    if ctx.request.spread_replicas and node.name in ctx.replica_nodes:
        return "holds another replica (spread_replicas)"
    return None


def near_node(near: Placement, node: Node, nodes: dict[str, Node], level: str) -> bool:
    """Whether ``node`` is near ``near`` at ``level`` (the same node, rack or zone as one of its ranks)."""
    for rank in near.ranks:
        theirs = nodes[rank.node]
        if level == "node" and theirs.name == node.name:
            return True
        if level == "rack" and theirs.rack is not None and theirs.rack == node.rack:
            return True
        if level == "zone" and theirs.zone is not None and theirs.zone == node.zone:
            return True
    return False


@dataclass(frozen=True)
class _Near:
    """Role affinity: bound to the cluster's nodes (the ranks of the other placement are looked up)."""

    nodes: dict[str, Node] = field(hash=False)

    def __call__(self, ctx: FilterContext, node: Node) -> str | None:
        request, near = ctx.request, ctx.near
        if near is None or not (request.near_required or ctx.near_strict):
            return None
        if near_node(near, node, self.nodes, request.near_level):
            return None
        return f"not in the same {request.near_level} as placement {near.id}"


def node_filters(nodes: dict[str, Node]) -> tuple[tuple[str, NodeFilter], ...]:
    """The node filters, in the order they run (the first that fails names the reason)."""
    return (
        ("gpu-type", _gpu_type),
        ("node-selector", _node_selector),
        ("racks", _racks),
        ("zones", _zones),
        ("spread", _spread),
        ("near", _Near(nodes)),
    )


def first_failure(filters: tuple[tuple[str, NodeFilter], ...], ctx: FilterContext, node: Node) -> Status:
    """The first filter that rules ``node`` out, or ``OK``."""
    for name, check in filters:
        reason = check(ctx, node)
        if reason is not None:
            return Status(name, False, reason)
    return OK


# ---------------------------------------------------------------------- checks on one choice


@dataclass(frozen=True)
class CheckContext:
    """What the checks of one concrete choice read (computed once by ``place.assess``)."""

    request: PlacementRequest
    level: str  # the loosest level any TP group of the choice sits at
    required_level: str | None
    cross_gbps: float
    budget_left_gbps: float
    fits: bool
    budget_gib: float
    kv_tokens: int
    expert_copies: int
    tpot_ms: float
    ttft_ms: float
    tpot_p95_ms: float | None = None
    """The 95th percentile of one request's mean TPOT (``perf/serving.py``): what a TPOT SLO is checked
    against when given; None: ``tpot_ms`` (the simulator's design batch)."""


def _make_check(name: str, held: bool, detail: str) -> ConstraintCheck:
    return ConstraintCheck(name=name, held=held, detail=detail)


_check = ValueCache(_make_check)
"""The checks of one decision repeat those of the last (the same level, capacity, latency): built once."""


def _domain_affinity(ctx: CheckContext) -> ConstraintCheck:
    held = ctx.required_level is None or LEVEL_ORDER.index(ctx.level) <= LEVEL_ORDER.index(ctx.required_level)
    required = f" (required {ctx.required_level})" if ctx.required_level else ""
    return _check("domain-affinity", held, f"TP groups at level {ctx.level}{required}")


def _cross_domain_budget(ctx: CheckContext) -> ConstraintCheck:
    """Traffic between NVLink domains against what is left of the SLO class's share of the cluster's
    cross-domain budget (``Scheduler.budget_gbps``, split by class weight)."""
    share = f"{ctx.budget_left_gbps:.2f} GB/s left of class {ctx.request.slo_class}'s cross-domain budget"
    if ctx.cross_gbps == 0:
        detail = "no traffic between NVLink domains"
    else:
        detail = f"{ctx.cross_gbps:.2f} GB/s between NVLink domains; {share}"
    return _check("cross-domain-budget", ctx.cross_gbps <= ctx.budget_left_gbps + 1e-9, detail)


def _capacity(ctx: CheckContext) -> ConstraintCheck:
    copies = f" after {ctx.expert_copies} hot-expert copies" if ctx.expert_copies else ""
    return _check("capacity", ctx.fits, f"{ctx.budget_gib:.2f} GiB per GPU; KV holds {ctx.kv_tokens} tokens{copies}")


def _slo(ctx: CheckContext) -> ConstraintCheck:
    request = ctx.request
    tpot = ctx.tpot_ms if ctx.tpot_p95_ms is None else ctx.tpot_p95_ms
    held = (request.slo_tpot_ms is None or tpot <= request.slo_tpot_ms) and (
        request.slo_ttft_ms is None or ctx.ttft_ms <= request.slo_ttft_ms
    )
    p95 = f"95th percentile {ctx.tpot_p95_ms:.2f}" if ctx.tpot_p95_ms is not None and request.slo_tpot_ms else ""
    slo = f"SLO {request.slo_tpot_ms:g}" if request.slo_tpot_ms else ""
    detail = (
        f"TPOT {ctx.tpot_ms:.2f} ms"
        + (f" ({', '.join(x for x in (p95, slo) if x)})" if slo else "")
        + f", TTFT {ctx.ttft_ms:.1f} ms"
        + (f" (SLO {request.slo_ttft_ms:g})" if request.slo_ttft_ms else "")
    )
    return _check("slo", held, detail)


CHECKS: tuple[Callable[[CheckContext], ConstraintCheck], ...] = (
    _domain_affinity,
    _cross_domain_budget,
    _capacity,
    _slo,
)
"""The checks every placement carries, in this order (read them by name: ``Placement.check``)."""


def run_checks(ctx: CheckContext) -> tuple[ConstraintCheck, ...]:
    return tuple(check(ctx) for check in CHECKS)


__all__ = [
    "CHECKS",
    "LEVEL_ORDER",
    "OK",
    "CheckContext",
    "FilterContext",
    "NodeFilter",
    "Status",
    "first_failure",
    "near_node",
    "node_filters",
    "run_checks",
]
