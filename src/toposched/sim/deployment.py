"""Deployments: a tenant's placement request, its in-domain reference figures and its request router.

The **in-domain reference** of a tenant is what its instance would do with every TP group inside
one NVLink domain, at the design batch (``batch`` sequences of the mean lengths), from the same
step cost the simulation steps with, in the steady state of continuous batching
(``perf/serving_run.py``, what a plan predicts):

    per-token  = (TTFT + (output - 1) x TPOT) / output                                 (ms per token)
    capacity   = batch / (per-token x output)                                          (requests/s)

with one request's TTFT inside the engine (half a step of the others, then its prefill riding with
their decodes) and its mean TPOT (the decode step plus the prefills of the ``batch - 1`` others, each
in a pass of its own over the request's life). Until issue 34 the reference was the static batch (all
``batch`` prompts in one pass, then the decode steps): with the host cost of a prefill pass fitted on
the vLLM/SGLang rows that figure is out of reach under continuous batching (short outputs pay a pass
per arriving prompt), and every policy met the SLO for 0.38 of churn-tiny's requests. ``slo_factor`` scales the
per-token reference into the per-token SLO, and the same factor scales the in-domain TPOT into the
``slo_tpot_ms`` the scheduler checks placements against (its predictions are per step, without the
prefill share). A tenant with ``slo_ms`` passes it as ``slo_tpot_ms`` unchanged (as before issue 15).

Requests of a deployment go to the live instance with the fewest requests given and not finished
(join-shortest-queue; ties: the instance that reached that load first); with no live instance they
wait in the deployment's fair queue.

A disaggregated deployment (``Scenario.pd``) is laid out by ``place_pd_layout``: prefill instance
``i`` on the ``i``-th node of a round-robin over the racks (one per node, every rack before a second
node of any), decode instance ``j`` paired with prefill ``j mod N`` on a node the layout names (its
node, another node of its rack, a node of another rack), each booked through the scheduler with a
node selector, so the ledger and the scheduler see them as the service would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

from toposched.errors import InputError
from toposched.perf.links import get_link
from toposched.perf.serving_run import ServingRun
from toposched.perf.step import StepCost
from toposched.sim.scenario import Pd, Tenant
from toposched.solver.candidates import Candidate
from toposched.solver.pd import KvStore, with_role
from toposched.solver.place import fabric_link
from toposched.solver.queue import FairQueue
from toposched.solver.request import Placement, PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.model import Cluster, Node
from toposched.workload.memory_config import MemoryConfig

if TYPE_CHECKING:
    from toposched.sim.units import SimInstance


class Router:
    """Join-shortest-queue over live instances: buckets by load, so a pick is a short walk."""

    def __init__(self) -> None:
        self._buckets: list[dict[SimInstance, None]] = []
        self._load: dict[SimInstance, int] = {}

    def __len__(self) -> int:
        return len(self._load)

    def __contains__(self, inst: object) -> bool:
        return inst in self._load

    def _put(self, inst: SimInstance, load: int) -> None:
        while len(self._buckets) <= load:
            self._buckets.append({})
        self._buckets[load][inst] = None
        self._load[inst] = load

    def add(self, inst: SimInstance) -> None:
        self._put(inst, inst.batcher.load)

    def remove(self, inst: SimInstance) -> None:
        load = self._load.pop(inst, None)
        if load is not None:
            del self._buckets[load][inst]

    def update(self, inst: SimInstance) -> None:
        old = self._load.get(inst)
        load = inst.batcher.load
        if old is None or old == load:
            return
        del self._buckets[old][inst]
        self._put(inst, load)

    def best(self) -> SimInstance | None:
        """The least-loaded live instance, or None."""
        if not self._load:
            return None
        for bucket in self._buckets:
            if bucket:
                return next(iter(bucket))
        return None

    def instances(self) -> list[SimInstance]:
        return list(self._load)


@dataclass(eq=False)
class Deployment:
    """One tenant's instances, request queue and reference figures."""

    index: int
    tenant: Tenant
    template: PlacementRequest
    slo_ms: float
    ref_per_token_ms: float
    ref_tpot_ms: float
    capacity_rps: float
    ref_tp: int
    ref_gpus: int
    queue: FairQueue = field(default_factory=FairQueue)
    router: Router = field(default_factory=Router)
    units: int = 0


def placement_template(tenant: Tenant, slo_tpot_ms: float | None) -> PlacementRequest:
    """The placement request of a tenant's instances (its id is replaced per instance)."""
    return PlacementRequest(
        id=tenant.name,
        model=tenant.model,
        weight_dtype=tenant.weight_dtype,
        kv_dtype=tenant.kv_dtype,
        engine=tenant.engine,
        engine_version=tenant.engine_version,
        max_model_len=tenant.max_model_len,
        concurrent_seqs=tenant.batch,
        input_len=tenant.input_len.mean,
        output_len=tenant.output_len.mean,
        slo_tpot_ms=slo_tpot_ms,
        slo_class=tenant.slo_class,
        allowed_tp=None if tenant.tp == "auto" else (tenant.tp,),
    )


def build_deployment(index: int, tenant: Tenant, scheduler: Scheduler, *, where: str) -> Deployment:
    """The tenant's deployment on this cluster; InputError when its model fits no degree here."""
    probe = placement_template(tenant, tenant.slo_ms)
    try:
        cands, dropped = scheduler.candidates(probe)
    except InputError as exc:  # an unknown model, a context longer than the model's
        raise InputError(f"{where}: tenant {tenant.name!r}: {exc.message}", fix=exc.fix) from None
    if not cands:
        why = "; ".join(dropped[:3]) or "no degree within the limits"
        raise InputError(
            f"{where}: tenant {tenant.name!r} ({tenant.model}) fits no degree on this cluster: {why}",
            fix="allow another tp, a smaller batch or shorter lengths, or a larger GPU",
        )
    # the option the scheduler tries first (with an SLO in ms: the fewest GPUs meeting it on an empty
    # cluster; with a factor: the layout rule without an SLO, which the factor is relative to)
    cand = cands[0]
    if tenant.slo_ms is not None:
        meeting = [c for c in cands if c.options.meets_slo(c.options.latency(c.option, c.options.gpu.native_link))]
        cand = meeting[0] if meeting else cands[0]
    batch, inp, out = tenant.batch, tenant.input_len.mean, tenant.output_len.mean

    def reference(c: Candidate) -> tuple[float, float]:
        """(per-token ms, TPOT ms) of candidate ``c`` in one NVLink domain, in the steady state."""
        o, g = c.option, c.options.gpu
        pp_link = get_link(fabric_link(scheduler.cluster.fabric)) if o.pp > 1 else None
        cost = StepCost(
            o.spec, g, tp=o.tp, pp=o.pp, link=get_link(g.native_link), pp_link=pp_link, engine=tenant.cost_engine
        )
        tpot = cost.decode_ms(batch, inp + out / 2)
        # the steady state of continuous batching (perf/serving_run.py, what a plan predicts): one request's
        # TTFT inside the engine, then its mean TPOT with the others' prompts prefilled in passes of their own
        run = ServingRun(cost.model, batch, inp, out, max(MemoryConfig().max_num_batched_tokens, batch))
        return (run.ttft_ms(client=False) + (out - 1) * run.tpot_ms()) / out, tpot

    per_token, tpot = reference(cand)
    if tenant.slo_factor is not None:
        # a cluster of several GPU kinds: the reference is the slowest kind that runs the first option's
        # degrees (its first option there), so the SLO is one every such kind can meet (issue 35's
        # churn-mixed); relative to the fastest kind, instances on the others could never meet it and
        # would be sent more requests than they can serve. The degrees (and GPUs) stay the first option's.
        degrees = (cand.option.tp, cand.option.pp)
        for other in cands:
            same = (other.option.tp, other.option.pp) == degrees and other.options.gpu.name != cand.options.gpu.name
            if same and other is _first_of_kind(cands, other):
                figures = reference(other)
                if figures[0] > per_token:
                    per_token, tpot = figures
    option = cand.option
    if tenant.slo_factor is not None:
        slo_ms = tenant.slo_factor * per_token
        template = placement_template(tenant, tenant.slo_factor * tpot)
    else:
        assert tenant.slo_ms is not None  # one of the two, checked by Tenant
        slo_ms = tenant.slo_ms
        template = probe
    return Deployment(
        index=index,
        tenant=tenant,
        template=template,
        slo_ms=slo_ms,
        ref_per_token_ms=per_token,
        ref_tpot_ms=tpot,
        capacity_rps=batch / (per_token * out / 1000.0),
        ref_tp=option.tp,
        ref_gpus=option.gpus,
    )


T = TypeVar("T")


def _first_of_kind(cands: list[Candidate], c: Candidate) -> Candidate:
    """The first candidate on ``c``'s GPU kind (the option the scheduler tries first there)."""
    return next(x for x in cands if x.options.gpu.name == c.options.gpu.name)


NODE_LABEL = "sim.toposched.io/node"
"""The label a disaggregated run gives every node (its name), so a layout can name a node."""


def label_nodes(cluster: Cluster) -> Cluster:
    """``cluster`` with every node labelled ``NODE_LABEL=<its name>``."""
    nodes = tuple(n.model_copy(update={"labels": {**n.labels, NODE_LABEL: n.name}}) for n in cluster.nodes)
    return cluster.model_copy(update={"nodes": nodes})


@dataclass
class PdLayout:
    """One layout of a disaggregated deployment: its instances (booked) and the store each decode uses."""

    name: str
    prefills: list[tuple[Placement, PlacementRequest]]
    decodes: list[tuple[Placement, PlacementRequest, str]]  # (decode, its request, its prefill's id)
    stores: dict[str, KvStore]  # decode id -> the store its KV goes through (kv_via: store)


def _racks(nodes: list[Node]) -> dict[str, list[Node]]:
    racks: dict[str, list[Node]] = {}
    for node in nodes:
        racks.setdefault(node.rack or f"node:{node.name}", []).append(node)
    return racks


def _round_robin(racks: dict[str, list[Node]]) -> list[Node]:
    """The nodes rack by rack: the first node of every rack, then the second ..."""
    order: list[Node] = []
    depth = max(len(v) for v in racks.values())
    for k in range(depth):
        order.extend(members[k] for members in racks.values() if k < len(members))
    return order


def _rotate(items: list[T], start: int) -> list[T]:
    """``items`` starting at ``start`` (mod its length), wrapping around."""
    if not items:
        return items
    start %= len(items)
    return items[start:] + items[:start]


def _store(node: Node) -> KvStore:
    return KvStore(node=node.name, rack=node.rack, nics=tuple(n.device for n in node.nics if n.device))


def place_pd_layout(
    scheduler: Scheduler,
    template: PlacementRequest,
    pd: Pd,
    layout: Literal["same-server", "rack-local", "spread"],
    policy: str,
    *,
    where: str,
) -> PdLayout:
    """Book ``pd.prefill`` prefill and ``pd.decode`` decode instances of ``template`` in ``layout``
    (the module docstring); InputError naming the instance when one fits no node the layout allows.

    The scheduler's cluster must carry ``NODE_LABEL`` (``label_nodes``)."""
    cluster = scheduler.cluster
    nodes = [n for n in cluster.nodes if n.gpus]
    by_name = {n.name: n for n in cluster.nodes}
    racks = _racks(nodes)
    rack_names = list(racks)
    rack_of = {n.name: key for key, members in racks.items() for n in members}
    order = _round_robin(racks)
    dmap = scheduler.index.dmap

    def book(request: PlacementRequest, candidates: list[Node]) -> Placement | None:
        for node in candidates:
            out = scheduler.place(request.model_copy(update={"node_selector": {NODE_LABEL: node.name}}), policy)
            if out.placements:
                return out.placements[0]
        return None

    def refuse(what: str, allowed: str) -> InputError:
        return InputError(
            f"{where}: layout {layout}: {what} fits no node {allowed}",
            fix="use fewer pd instances, smaller prefill_tp/decode_tp, or a larger cluster",
        )

    base = template.model_copy(update={"replicas": 1})
    prefills: list[tuple[Placement, PlacementRequest]] = []
    for i in range(pd.prefill):
        request = PlacementRequest.model_validate(
            {**base.model_dump(), "id": f"{template.id}-prefill-{i}", "slo_tpot_ms": None,
             "allowed_tp": (pd.prefill_tp,) if pd.prefill_tp else base.allowed_tp}
        )  # fmt: skip
        placed = book(request, _rotate(order, i % len(order)))
        if placed is None:
            raise refuse(f"prefill instance {i}", "of the cluster")
        prefills.append((with_role(placed, "prefill", request.id, by_name, dmap), request))
    decodes: list[tuple[Placement, PlacementRequest, str]] = []
    stores: dict[str, KvStore] = {}
    half = max(1, len(rack_names) // 2)
    for j in range(pd.decode):
        prefill = prefills[j % pd.prefill][0]
        home = prefill.ranks[0].node
        rack = rack_of[home]
        mates = racks[rack]
        at = mates.index(by_name[home])
        far = rack_names[(rack_names.index(rack) + half) % len(rack_names)]
        if layout == "same-server":
            candidates, allowed = [by_name[home]], f"of prefill {prefill.id} ({home})"
        elif layout == "rack-local":
            candidates, allowed = [n for n in _rotate(mates, at + 1) if n.name != home], f"of rack {rack} but {home}"
        else:
            candidates = [n for key in _rotate(rack_names, rack_names.index(far)) if key != rack for n in racks[key]]
            allowed = f"outside rack {rack}"
        request = PlacementRequest.model_validate(
            {**base.model_dump(), "id": f"{template.id}-decode-{j}", "slo_ttft_ms": None,
             "allowed_tp": (pd.decode_tp,) if pd.decode_tp else base.allowed_tp}
        )  # fmt: skip
        placed = book(request, candidates)
        if placed is None:
            raise refuse(f"decode instance {j}", allowed)
        decode = with_role(placed, "decode", request.id, by_name, dmap)
        decodes.append((decode, request, prefill.id))
        node = decode.ranks[0].node
        if layout == "same-server":
            stores[decode.id] = _store(by_name[node])
        elif layout == "rack-local":  # another node of the decode's rack, not the prefill's when it can
            own = racks[rack_of[node]]
            spare = [n for n in _rotate(own, own.index(by_name[node]) + 1) if n.name not in (node, home)]
            stores[decode.id] = _store(spare[0] if spare else by_name[node])
        else:  # a rack of neither the decode nor the prefill; else the prefill's (not its node)
            third = [k for k in rack_names if k not in (rack, rack_of[node])]
            away = [n for k in third for n in racks[k]] or [n for n in racks[rack] if n.name != home]
            stores[decode.id] = _store(away[j % len(away)] if away else by_name[home])
    return PdLayout(layout, prefills, decodes, stores)


__all__ = ["NODE_LABEL", "Deployment", "PdLayout", "Router", "build_deployment", "label_nodes", "place_pd_layout"]
