"""The plan document's schema, for both directions: ``PlanDocument``, version ``PLAN_SCHEMA_VERSION``.

``toposched plan --json`` prints ``PlanDocument.write(...)``; ``toposched launch --plan`` reads a file
through ``binding/plan_doc.py``, which checks what a model cannot say in one line (degrees against
ranks, GPUs against the cluster, memory against the GPU) and then validates the document with
``PlanDocument``. A key added or renamed here changes both sides at once.

The document embeds the request and the part of the topology snapshot its placements use (their nodes,
the fabric, the cliques among them: ``used_cluster``), plus ``cluster_summary`` with the whole
cluster's name, size and SHA-256 fingerprint, so it can be launched on another machine.

A placement is stored as ``solver.request.Placement`` with three differences, converted by
``StoredPlacement`` in both directions:

* ranks without ``tp_rank`` (it is ``rank % tp``; ``stage`` may be left out too: ``rank // tp``);
* ``hbm_per_gpu`` with its ``total`` (a reader checks it is the sum of the parts);
* ``predicted``: TTFT (one request's), TPOT and the running batch together, for readers of the JSON
  (the same figures as ``ttft_ms`` / ``tpot_ms`` / ``max_num_seqs``), and ``batch_prefill_ms``, the
  prefill of the whole batch at once (a static batch's TTFT, labelled as such).

A placement's operating point (``perf/serving.py``): ``max_num_seqs``, ``max_num_batched_tokens``,
``goodput_tokens_per_s``, ``served_rps``, ``batch_prefill_ms`` and ``operating_limit``; all optional, so
plans written before them read as before (``launch`` then runs the request's ``concurrent_seqs``, else 8).
With ``--request-rate`` the document has ``capacity`` (``solver/sizing.py``: the rate asked, the
replicas, their GPUs and the requests/s they serve).

And an expert report written before ``redundant_experts`` existed reads as if the copies were spread
one slot at a time over the EP ranks.

A disaggregated plan (``solver/pd.py``) adds, all optional so that every plan written before reads the
same: per placement ``role`` (``prefill`` | ``decode``), ``kv_nics`` and ``host_numa`` (one per rank),
and at the top ``disaggregation`` (the counts, the store kind and the decode -> prefill pairs) and
``stores`` (``{node, rack, nics}`` per KV-cache store). A plain plan writes ``role: null``, empty lists
and ``disaggregation: null``.

Versions: 1 (current). A change that an older reader would misread takes a new version number.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Final, Literal, TypeGuard

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

from toposched.solver.pd import Disaggregation, KvStore
from toposched.solver.request import ExpertReport, HbmShare, Placement, PlacementRequest, Unplaced
from toposched.solver.sizing import Capacity, ModeChoice
from toposched.topology.domains import cluster_digest
from toposched.topology.model import Cluster

PLAN_SCHEMA_VERSION: Final = 1

RANK_KEYS = frozenset({"rank", "node", "gpu", "stage", "tp_rank"})
"""Keys of a stored rank (``tp_rank`` and ``stage`` may be left out)."""
HBM_KEYS = frozenset(HbmShare.model_fields) | {"total"}
"""Keys of a stored per-GPU memory share."""
EXPERT_KEYS = frozenset(ExpertReport.model_fields)
"""Keys of a stored expert report (``redundant_experts`` may be left out)."""
PLACEMENT_KEYS = frozenset(Placement.model_fields) | {"predicted"}
"""Keys of a stored placement."""


def placement_json(p: Placement) -> dict[str, Any]:
    """One placement as the document holds it: ranks without ``tp_rank``, the HBM share with its
    ``total``, the predictions together under ``predicted``."""
    data = p.model_dump(mode="json")
    data["ranks"] = [{"rank": r.rank, "node": r.node, "gpu": r.gpu, "stage": r.stage} for r in p.ranks]
    data["predicted"] = {
        "ttft_ms": p.ttft_ms,
        "tpot_ms": p.tpot_ms,
        "tpot_p95_ms": p.tpot_p95_ms,
        "batch": p.max_num_seqs,
        "batch_prefill_ms": p.batch_prefill_ms,
    }
    data["hbm_per_gpu"] = {**p.hbm_per_gpu.model_dump(), "total": p.hbm_per_gpu.total}
    return data


def _whole(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def placement_fields(data: Any) -> Any:
    """A stored placement as ``Placement``'s fields: derived ``tp_rank`` / ``stage``, no ``total`` or
    ``predicted``, ``redundant_experts`` for older documents. What cannot be derived (a ``tp`` that
    is not a positive whole number) is left for ``Placement``'s own validation to refuse."""
    if not isinstance(data, dict):
        return data  # a Placement being written, or something validation refuses
    fields = {k: v for k, v in data.items() if k != "predicted"}
    hbm = fields.get("hbm_per_gpu")
    if isinstance(hbm, dict):
        fields["hbm_per_gpu"] = {k: v for k, v in hbm.items() if k != "total"}
    tp, ep, ranks, experts = data.get("tp"), data.get("ep"), data.get("ranks"), data.get("experts")
    if _whole(tp) and tp >= 1 and isinstance(ranks, list):
        fields["ranks"] = [
            {"tp_rank": r["rank"] % tp, "stage": r["rank"] // tp, **r}
            if isinstance(r, dict) and _whole(r.get("rank"))
            else r
            for r in ranks
        ]
    if isinstance(experts, dict) and "redundant_experts" not in experts and _whole(ep) and ep >= 1:
        replicas = experts.get("replicas")
        if _whole(replicas):  # copies spread one slot at a time over the EP ranks
            fields["experts"] = {**experts, "redundant_experts": math.ceil(replicas / ep) * ep}
    return fields


StoredPlacement = Annotated[
    Placement, BeforeValidator(placement_fields), PlainSerializer(placement_json, return_type=dict[str, Any])
]
"""A ``Placement`` in the document's form: ``placement_fields`` reads it, ``placement_json`` writes it."""


class ClusterSummary(BaseModel):
    """The whole cluster a plan was made on, when the document holds only the nodes it uses."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    nodes: int
    gpus: int
    sha256: str
    """SHA-256 of the whole snapshot's canonical JSON: tells two clusters of one name apart."""

    @classmethod
    def of(cls, cluster: Cluster) -> ClusterSummary:
        digest = cluster_digest(cluster)
        return cls(name=cluster.name, nodes=len(cluster.nodes), gpus=cluster.gpu_count, sha256=digest)


class PlanDocument(BaseModel):
    """What ``toposched plan --json`` prints and ``toposched launch --plan`` reads (key order included)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = PLAN_SCHEMA_VERSION
    policy: str | None = None
    """The placement policy that made the plan (absent in hand-made documents)."""
    source: str | None = None
    """Where the topology came from (``preset:NAME``, a file, ``live``)."""
    placements: tuple[StoredPlacement, ...]
    unplaced: tuple[Unplaced, ...] = ()
    """Replicas that could not be placed, with the reasons (``launch`` ignores them)."""
    request: PlacementRequest
    cluster: Cluster
    """The part of the cluster the placements use (``used_cluster``)."""
    cluster_summary: ClusterSummary | None = None
    disaggregation: Disaggregation | None = None
    """Prefill/decode disaggregation: the counts asked for and the pairs (None: a plain plan)."""
    stores: tuple[KvStore, ...] = ()
    """KV-cache store processes (host memory and RDMA NICs, no GPUs) beside the decode instances."""
    capacity: Capacity | None = None
    """With ``plan --request-rate``: the rate, the replicas and GPUs that serve it, what they serve."""
    mode: ModeChoice | None = None
    """With ``plan --pd auto``: aggregated or disaggregated, the GPUs each needs for the rate, and why."""

    @classmethod
    def write(
        cls,
        placements: list[Placement] | tuple[Placement, ...],
        unplaced: list[Unplaced] | tuple[Unplaced, ...],
        request: PlacementRequest,
        cluster: Cluster,
        *,
        policy: str,
        source: str,
        disaggregation: Disaggregation | None = None,
        stores: list[KvStore] | tuple[KvStore, ...] = (),
        capacity: Capacity | None = None,
        mode: ModeChoice | None = None,
    ) -> PlanDocument:
        """The document for a plan made on ``cluster`` (the whole cluster: the document keeps the part used).

        Built without validation: every part is already a validated value of the solver or the topology."""
        return cls.model_construct(
            policy=policy,
            source=source,
            placements=tuple(placements),
            unplaced=tuple(unplaced),
            request=request,
            cluster=used_cluster(cluster, placements, extra_nodes=[s.node for s in stores]),
            cluster_summary=ClusterSummary.of(cluster),
            disaggregation=disaggregation,
            stores=tuple(stores),
            capacity=capacity,
            mode=mode,
        )


def used_cluster(
    cluster: Cluster, placements: list[Placement] | tuple[Placement, ...], *, extra_nodes: list[str] | None = None
) -> Cluster:
    """The part of ``cluster`` the placements use: their nodes and ``extra_nodes`` (KV-cache stores' nodes;
    in cluster order; the first node when nothing was placed, so the snapshot stays a valid cluster), the
    fabric, the cliques among them."""
    used = {r.node for p in placements for r in p.ranks} | set(extra_nodes or ())
    nodes = tuple(n for n in cluster.nodes if n.name in used) or cluster.nodes[:1]
    if len(nodes) == len(cluster.nodes):
        return cluster
    kept = {n.name for n in nodes}
    cliques = tuple(
        c.model_copy(update={"nodes": tuple(n for n in c.nodes if n in kept)})
        for c in cluster.cliques
        if any(n in kept for n in c.nodes)
    )
    return cluster.model_copy(update={"nodes": nodes, "cliques": cliques})
