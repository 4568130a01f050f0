"""Prefill/decode disaggregation: prefill and decode instances, paired by rack, and the KV-cache stores.

A disaggregated deployment (seed 003) runs prompts on *prefill* instances and token generation on
*decode* instances; each request's KV cache moves from a prefill instance to a decode instance over
RDMA, and an optional KV-cache store (Mooncake) keeps caches in host memory for reuse. Every hop is
kept local:

* **sizing**: prefill instances are placed for the TTFT SLO alone, decode instances for the TPOT SLO
  and the KV capacity of their concurrent sequences alone (the cost model and the ``slo`` policy
  already choose degrees that way: a request with only ``slo_ttft_ms`` is sized by its prefill);
* **pairing**: decode instance ``i`` pairs with prefill instance ``i mod N`` and is placed in the same
  rack through the request model's role affinity (``near`` / ``near_level="rack"``); when that rack
  is full it tries the other prefill instances' racks, then (unless ``same_rack_required``) anywhere;
* **KV NICs**: every rank records the RDMA device it moves KV through, the nearest NIC of its GPU
  (``DomainMap.nearest_nics``) on the GPU's NUMA node, and the NUMA node its host memory binds to;
* **stores**: one store per rack the decode instances use, on the node of that rack holding the
  most decode ranks (same server beats same rack), with that node's RDMA NICs; no GPUs.

Everything is booked in the scheduler given (``Scheduler.place``), so the ledger, the index and the
cross-domain budget see a disaggregated deployment as the instances it is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from toposched.errors import InputError
from toposched.names import Label, NodeName, PlacementId, Word
from toposched.perf.hardware import GpuSpec
from toposched.perf.kv_transfer import KvLane, KvLinks, kv_links, rank_kv_bytes_per_token
from toposched.solver.constraints import near_node
from toposched.solver.outcome import Outcome
from toposched.solver.request import ConstraintCheck, Placement, PlacementRequest, Role, Unplaced, instance_ids
from toposched.topology.domains import DomainMap, gpu_ref
from toposched.topology.model import Cluster, LinkKind, Node
from toposched.workload.dtypes import KvDtype
from toposched.workload.spec import ModelSpec

if TYPE_CHECKING:  # plans are booked in the scheduler given: no import circle at run time
    from toposched.solver.scheduler import Scheduler

KvStoreKind = Literal["mooncake"]
KV_STORES: tuple[str, ...] = ("mooncake",)
"""KV-cache stores a plan can place (``--kv-store``)."""


class Disaggregation(BaseModel):
    """What a disaggregated plan asked for, and which prefill instance each decode instance pairs with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill: int = Field(ge=1, le=1024)
    """Prefill instances."""
    decode: int = Field(ge=1, le=1024)
    """Decode instances."""
    kv_store: KvStoreKind | None = None
    """The KV-cache store placed beside the decode instances (None: none)."""
    same_rack_required: bool = False
    """A decode instance that cannot share a rack with a prefill instance is not placed (else: placed anywhere)."""
    pairs: dict[PlacementId, PlacementId] = Field(default_factory=dict)
    """Decode placement id -> the prefill placement id it pairs with (filled by ``place_pd``)."""

    @model_validator(mode="after")
    def _check(self) -> Disaggregation:
        if len(self.pairs) > self.decode:
            raise ValueError(f"{len(self.pairs)} pairs for {self.decode} decode instances")
        return self


class KvStore(BaseModel):
    """One KV-cache store process: host memory and RDMA NICs of one node, no GPUs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: NodeName
    rack: Label | None
    nics: tuple[Word, ...] = Field(min_length=1)
    """RDMA devices of the node the store serves through (``mlx5_0`` ...)."""


def role_request_id(base_id: str, role: Role) -> str:
    """The request id a role's placements carry: ``ID-prefill`` / ``ID-decode``."""
    return f"{base_id}-{role}"


def role_ids(base_id: str, role: Role, count: int) -> list[str]:
    """The placement ids of a role's instances (``ID-prefill``, or ``ID-prefill-0`` ...)."""
    return instance_ids(role_request_id(base_id, role), count)


def _derive(base: PlacementRequest, **update: object) -> PlacementRequest:
    """``base`` with ``update``, validated again (ids are checked names)."""
    return PlacementRequest.model_validate({**base.model_dump(), **update})


def prefill_request(base: PlacementRequest, count: int) -> PlacementRequest:
    """The prefill instances: sized by the TTFT SLO only (they never generate past the first token); the
    prompts per pass are their operating point (``perf/serving.py prefill_point``), whatever
    ``concurrent_seqs`` says of the decode instances' running sequences."""
    return _derive(
        base, id=role_request_id(base.id, "prefill"), replicas=count, slo_tpot_ms=None, serving_role="prefill",
        concurrent_seqs=None,
    )  # fmt: skip


def decode_request(
    base: PlacementRequest, decode_id: str, prefill_id: str, *, required: bool, level: Literal["rack", "node"] = "rack"
) -> PlacementRequest:
    """One decode instance: sized by the TPOT SLO and KV capacity, in the rack (or node) of ``prefill_id``."""
    return _derive(
        base,
        id=decode_id,
        replicas=1,
        slo_ttft_ms=None,
        serving_role="decode",
        near=prefill_id,
        near_level=level,
        near_required=required,
    )


# --------------------------------------------------------------------------------------- KV NICs


def _numa_local(node: Node, gpu: int, nic: str) -> bool:
    """Whether NIC ``nic`` sits on GPU ``gpu``'s NUMA node: by the NIC's NUMA node when the source gives
    it, else by the PCIe path between them (anything short of ``SYS`` stays inside one NUMA node)."""
    spec = next((n for n in node.nics if n.name == nic), None)
    numa = node.gpu(gpu).numa_node
    if spec is not None and spec.numa_node is not None and numa is not None:
        return spec.numa_node == numa
    kinds = [nl.kind for nl in node.nic_links if nl.gpu == gpu and nl.nic == nic]
    return bool(kinds) and min(k.rank for k in kinds) < LinkKind.SYS.rank


def kv_nics(placement: Placement, nodes: dict[str, Node], dmap: DomainMap) -> tuple[str, ...]:
    """Per rank, the RDMA device its KV transfers use: a nearest NIC of its GPU (the DomainMap's) that
    has an RDMA device and sits on the GPU's NUMA node; ties go to the NIC the fewest ranks use so far.

    A GPU without one cannot move KV over RDMA from its own NUMA node: that is an input error (the
    topology lacks the NICs, or their RDMA device names), not a placement to make quietly worse.
    """
    used: Counter[str] = Counter()
    chosen: list[str] = []
    for r in placement.ranks:
        node = nodes[r.node]
        devices = {n.name: n.device for n in node.nics if n.device}
        nearest = dmap.nearest_nics.get(gpu_ref(r.node, r.gpu), ())
        local = [devices[n] for n in nearest if n in devices and _numa_local(node, r.gpu, n)]
        if not local:
            raise InputError(
                f"GPU {r.node}/{r.gpu} of {placement.id} has no nearest NIC with an RDMA device on its NUMA node "
                f"(nearest: {', '.join(nearest) or 'none'})",
                fix="give the topology its NICs' RDMA devices (nvidia-smi topo -m lists mlx5_N), or plan without PD",
            )
        pick = min(local, key=lambda d: (used[d], d))
        used[pick] += 1
        chosen.append(pick)
    return tuple(chosen)


def with_role(placement: Placement, role: Role, request_id: str, nodes: dict[str, Node], dmap: DomainMap) -> Placement:
    """``placement`` as an instance of ``role``: its role's request id, KV NICs and host NUMA nodes."""
    numa = tuple(nodes[r.node].gpu(r.gpu).numa_node for r in placement.ranks)
    return placement.model_copy(
        update={"role": role, "request_id": request_id, "kv_nics": kv_nics(placement, nodes, dmap), "host_numa": numa}
    )


# --------------------------------------------------------------------------------------- stores


def place_stores(decodes: list[Placement], nodes: dict[str, Node]) -> list[KvStore]:
    """One store per rack the decode instances use (per node for nodes without a rack), on the rack's
    node with the most decode ranks and RDMA NICs (then the first by name)."""
    ranks_on: Counter[str] = Counter(r.node for p in decodes for r in p.ranks)
    racks: dict[str, list[Node]] = {}
    for name in ranks_on:  # first-appearance order: the first decode's rack first
        node = nodes[name]
        racks.setdefault(node.rack or f"node:{name}", [])
    for node in nodes.values():
        key = node.rack or f"node:{node.name}"
        if key in racks:
            racks[key].append(node)
    stores = []
    for key, members in racks.items():
        rdma = [n for n in members if any(nic.device for nic in n.nics)]
        if not rdma:
            raise InputError(
                f"no node of {key.removeprefix('node:')} has an RDMA NIC for the KV-cache store",
                fix="give the topology its NICs' RDMA devices, or plan without --kv-store",
            )
        best = min(rdma, key=lambda n: (-ranks_on[n.name], n.name))
        stores.append(KvStore(node=best.name, rack=best.rack, nics=tuple(n.device for n in best.nics if n.device)))
    return stores


# --------------------------------------------------------------------------------------- KV transfer lanes


def placement_lanes(placement: Placement, nodes: dict[str, Node]) -> tuple[KvLane, ...]:
    """Per rank (rank order) the lane its KV moves through (``perf/kv_transfer.py``): its node, rack,
    GPU and KV NIC (``kv_nics``; a placement without them uses its node's first RDMA NIC)."""
    lanes = []
    for i, r in enumerate(placement.ranks):
        node = nodes[r.node]
        nic = (
            placement.kv_nics[i] if i < len(placement.kv_nics) else next((n.device for n in node.nics if n.device), "")
        )
        lanes.append(KvLane(node=r.node, rack=node.rack, nic=nic or "", gpu=r.gpu))
    return tuple(lanes)


def store_lanes(store: KvStore) -> tuple[KvLane, ...]:
    """A store's lanes: one per RDMA NIC of its node, into host memory."""
    return tuple(KvLane(node=store.node, rack=store.rack, nic=nic) for nic in store.nics)


def rank_kv_needs(spec: ModelSpec, placement: Placement) -> tuple[float, ...]:
    """Per rank, the KV bytes per prompt token it holds: its TP shard of its pipeline stage's layers,
    in the placement's KV dtype (what a decode rank must receive)."""
    dtype: KvDtype = placement.kv_dtype  # type: ignore[assignment]  # a KvDtype name, set by the solver
    return tuple(
        rank_kv_bytes_per_token(spec, placement.tp, placement.stage_layers[r.stage], dtype) for r in placement.ranks
    )


def cluster_kv_links(cluster: Cluster, gpu: GpuSpec, *, oversubscription: float = 1.0) -> KvLinks:
    """The links KV crosses in ``cluster`` (``perf.kv_transfer.kv_links``): the fabric's link per NIC,
    each rack's uplink its RDMA NICs / ``oversubscription``, the fabric's latency across racks."""
    fabric = cluster.fabric
    racks: Counter[str] = Counter()
    for node in cluster.nodes:
        if node.rack is not None:
            racks[node.rack] += sum(1 for n in node.nics if n.device)
    net = fabric.perf_link if fabric is not None else "tcp-100"
    latency = fabric.latency_us if fabric is not None else 5.0
    return kv_links(gpu, net, dict(racks), oversubscription=oversubscription, spine_latency_us=latency)


# --------------------------------------------------------------------------------------- the whole deployment


@dataclass
class PdOutcome:
    """A disaggregated plan: prefill then decode placements (with roles), what was not placed, the stores."""

    outcome: Outcome
    stores: list[KvStore] = field(default_factory=list)
    layout: Disaggregation | None = None


def _level(placement: Placement, nodes: dict[str, Node]) -> Literal["rack", "node"]:
    """Where a decode instance goes to be near ``placement``: its rack, or its node when it has none."""
    return "rack" if all(nodes[r.node].rack is not None for r in placement.ranks) else "node"


def near_check(decode: Placement, prefill: Placement, nodes: dict[str, Node]) -> ConstraintCheck:
    level = _level(prefill, nodes)
    held = all(near_node(prefill, nodes[r.node], nodes, level) for r in decode.ranks)
    where = sorted({str(nodes[r.node].rack if level == "rack" else r.node) for r in decode.ranks})
    verdict = f"the same {level} as" if held else f"not in the {level} of"
    return ConstraintCheck(name="near", held=held, detail=f"{level} {', '.join(where)}: {verdict} prefill {prefill.id}")


@dataclass
class _Planner:
    """One disaggregated plan in the making, booked in ``scheduler`` as it goes."""

    scheduler: Scheduler
    base: PlacementRequest
    spec: Disaggregation
    policy: str
    nodes: dict[str, Node] = field(init=False)
    degrees: dict[Role, tuple[int, int]] = field(default_factory=dict)
    """(tp, pp) each role must use (``--pd auto`` sized them, ``solver/sizing.py``); absent: the policy's."""
    prefills: dict[str, Placement] = field(default_factory=dict)
    decodes: dict[str, tuple[Placement, str]] = field(default_factory=dict)  # decode id -> (placement, prefill id)

    def __post_init__(self) -> None:
        self.nodes = {n.name: n for n in self.scheduler.cluster.nodes}

    def one(self, request: PlacementRequest) -> Placement | Unplaced:
        role = request.serving_role
        if role is not None and role in self.degrees:
            tp, pp = self.degrees[role]
            request = _derive(request, allowed_tp=(tp,), max_pp=pp)
        out = self.scheduler.place(request, self.policy)
        return out.placements[0] if out.placements else out.unplaced[0]

    def decode(self, decode_id: str, prefill: Placement, *, required: bool) -> Placement | Unplaced:
        level = _level(prefill, self.nodes)
        return self.one(decode_request(self.base, decode_id, prefill.id, required=required, level=level))

    def racks_tightest_first(self) -> list[str]:
        """The racks with free GPUs, fewest free first (best fit: keep roomy racks for larger groups)."""
        free: Counter[str] = Counter()
        for ref in self.scheduler.index.free:
            rack = self.nodes[ref.split("/", 1)[0]].rack
            if rack is not None:
                free[rack] += 1
        return sorted(free, key=lambda rack: (free[rack], rack))

    def group_in_one_rack(self, prefill_id: str, decode_ids: list[str]) -> bool:
        """Place a prefill instance and the decode instances pairing with it in one rack, the tightest
        that holds them all; nothing stays booked for a rack that does not."""
        allowed = self.base.racks
        for rack in self.racks_tightest_first():
            if allowed is not None and rack not in allowed:
                continue
            one = _derive(prefill_request(self.base, 1), id=prefill_id, racks=(rack,))
            prefill = self.one(one)
            if isinstance(prefill, Unplaced):
                continue
            placed: list[Placement] = []
            for did in decode_ids:
                decode = self.decode(did, prefill, required=True)
                if isinstance(decode, Unplaced):
                    break
                placed.append(decode)
            if len(placed) == len(decode_ids):
                self.prefills[prefill_id] = prefill
                self.decodes.update((d.id, (d, prefill_id)) for d in placed)
                return True
            for p in (*placed, prefill):
                self.scheduler.release(p.id)
        return False

    def pair(self, decode_id: str, i: int) -> Unplaced | None:
        """Place decode instance ``i`` near prefill ``i mod N``, else near another, else (when allowed) anywhere."""
        prefills = list(self.prefills.values())
        if not prefills:
            return Unplaced(request_id=decode_id, replica=i, status="queued", reasons=("no prefill instance placed",))
        order = [prefills[(i + k) % len(prefills)] for k in range(len(prefills))]
        refusal: Unplaced | None = None
        for prefill in order:
            decode = self.decode(decode_id, prefill, required=True)
            if isinstance(decode, Placement):
                self.decodes[decode_id] = (decode, prefill.id)
                return None
            refusal = refusal or decode
        if not self.spec.same_rack_required:
            decode = self.decode(decode_id, order[0], required=False)
            if isinstance(decode, Placement):
                self.decodes[decode_id] = (decode, order[0].id)
                return None
            refusal = decode
        return refusal


def place_pd(
    scheduler: Scheduler,
    base: PlacementRequest,
    spec: Disaggregation,
    policy: str = "slo",
    *,
    degrees: dict[Role, tuple[int, int]] | None = None,
) -> PdOutcome:
    """Place ``spec.prefill`` prefill and ``spec.decode`` decode instances of ``base``, and the stores.

    Decode instance ``i`` pairs with prefill instance ``i mod N``. Each prefill instance and its decode
    instances go to one rack together when one has room (tightest first); the others are paired one by
    one (``_Planner.pair``). ``base`` carries the model, lengths and SLOs; its ``replicas`` is not read.
    ``degrees``: the (tp, pp) a role must use (a sizing chose them); else the policy chooses.
    """
    planner = _Planner(scheduler, base, spec, policy, degrees=dict(degrees or {}))
    nodes, dmap = planner.nodes, scheduler.index.dmap
    prefill_ids = role_ids(base.id, "prefill", spec.prefill)
    decode_ids = role_ids(base.id, "decode", spec.decode)
    unplaced: list[Unplaced] = []
    for j, pid in enumerate(prefill_ids):
        if not planner.group_in_one_rack(pid, decode_ids[j :: len(prefill_ids)]):
            prefill = planner.one(_derive(prefill_request(base, 1), id=pid))
            if isinstance(prefill, Placement):
                planner.prefills[pid] = prefill
            else:
                unplaced.append(prefill.model_copy(update={"replica": j}))
    for i, did in enumerate(decode_ids):
        if did not in planner.decodes:
            refusal = planner.pair(did, i)
            if refusal is not None:
                unplaced.append(refusal.model_copy(update={"replica": i}))
    prefill_rid, decode_rid = role_request_id(base.id, "prefill"), role_request_id(base.id, "decode")
    prefills = {pid: with_role(p, "prefill", prefill_rid, nodes, dmap) for pid, p in planner.prefills.items()}
    decodes: list[Placement] = []
    for did in decode_ids:
        if did in planner.decodes:
            decode, pid = planner.decodes[did]
            decode = with_role(decode, "decode", decode_rid, nodes, dmap)
            near = near_check(decode, prefills[pid], nodes)
            decodes.append(decode.model_copy(update={"constraints": (*decode.constraints, near)}))
    outcome = Outcome(
        placements=[*(prefills[pid] for pid in prefill_ids if pid in prefills), *decodes],
        unplaced=[  # under the role's request id, as the placements
            u.model_copy(update={"request_id": prefill_rid if u.request_id in prefill_ids else decode_rid})
            for u in unplaced
        ],
    )
    stores = place_stores(decodes, nodes) if spec.kv_store and decodes else []
    pairs = {did: planner.decodes[did][1] for did in decode_ids if did in planner.decodes}
    return PdOutcome(outcome, stores, spec.model_copy(update={"pairs": pairs}))


__all__ = [
    "KV_STORES",
    "Disaggregation",
    "KvStore",
    "PdOutcome",
    "cluster_kv_links",
    "decode_request",
    "kv_nics",
    "near_check",
    "place_pd",
    "place_stores",
    "placement_lanes",
    "prefill_request",
    "rank_kv_needs",
    "role_ids",
    "role_request_id",
    "store_lanes",
    "with_role",
]
