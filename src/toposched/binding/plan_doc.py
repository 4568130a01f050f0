"""Plan documents in and out: ``plan_json`` writes what ``toposched plan --json`` prints, ``parse_plan``
and ``load_plan`` read what ``toposched launch --plan`` takes, both through the one schema
(``binding/plan_schema.py``: ``PlanDocument``); ``launch --model`` (plan and launch in one step) goes
through both, so every launch starts from a document that passed the same checks.

A plan is an input from outside: it may have been edited, forged or made by an older toposched, and
its ids and node names end up in scripts, file names and Kubernetes objects. Before the schema
validates it, ``parse_plan`` checks what a type cannot say in one line, and refuses with one line
naming the file and the key path:

* keys the schema does not have (a misspelt ``tp_size`` would otherwise be ignored);
* names that break the rules of ``toposched.names`` (the cluster through the topology model, the
  request id here), placement ids that are not the request's instance ids (``ID`` or ``ID-N``),
  a placement id given twice;
* degrees that do not match the ranks: ``tp``, ``pp`` >= 1, ``ep`` dividing ``tp``, ``tp * pp`` ranks
  numbered ``0..n-1`` with stage ``rank // tp`` and TP rank ``rank % tp``, ``pp`` stage entries;
* GPUs that are not in the cluster (an unknown node is named as such), a GPU holding two ranks of one
  placement or ranks of two placements;
* memory that cannot be: negative bytes, a ``total`` other than the sum of its parts, a per-GPU share
  over the GPU's memory (``hbm_gib``, or the GPU type's memory when the snapshot does not say);
* dtypes and expert layouts the launchers do not know (``kv_dtype``, the request's ``weight_dtype``,
  ``experts.ep`` other than ``ep``, redundant experts not spread evenly over the EP ranks);
* disaggregation (``solver/pd.py``) that does not add up: a role on a plain plan's placement or none on a
  disaggregated one, ids that are not the role's instance ids (``ID-prefill-N``, ``ID-decode-N``),
  ``kv_nics`` / ``host_numa`` not one per rank, KV NICs or store NICs that are not RDMA devices of
  their node, a store on a node or rack not in the cluster, pairs naming placements not in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from toposched.binding.plan_schema import (
    EXPERT_KEYS,
    HBM_KEYS,
    PLACEMENT_KEYS,
    PLAN_SCHEMA_VERSION,
    RANK_KEYS,
    PlanDocument,
)
from toposched.errors import InputError, first_problem
from toposched.inputs import load_json, read_text
from toposched.names import id_problem, node_name_problem, placement_id_problem
from toposched.solver.options import gpu_type_for
from toposched.solver.pd import Disaggregation, KvStore, role_ids, role_request_id
from toposched.solver.request import HbmShare, Placement, PlacementRequest, Unplaced, instance_ids
from toposched.solver.sizing import Capacity, ModeChoice
from toposched.topology.model import GPU, Cluster
from toposched.workload.catalog import resolve_model
from toposched.workload.dtypes import KV_DTYPES, parse_kv_dtype, parse_weight_dtype

_FIX = "pass the output of `toposched plan --json` unedited, or plan again"
_GIB = 2**30
_TOP_KEYS = frozenset(PlanDocument.model_fields)


@dataclass(frozen=True)
class PlanDoc:
    """A checked plan: the placements, the request they answer and the cluster they are on."""

    placements: tuple[Placement, ...]
    request: PlacementRequest
    cluster: Cluster
    disaggregation: Disaggregation | None = None
    """Prefill/decode disaggregation (None: a plain plan); placements then carry their ``role``."""
    stores: tuple[KvStore, ...] = ()
    """KV-cache stores of a disaggregated plan."""


def plan_json(
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
) -> dict[str, Any]:
    """The document ``toposched plan --json`` prints (``parse_plan`` reads it back)."""
    document = PlanDocument.write(
        placements, unplaced, request, cluster, policy=policy, source=source, disaggregation=disaggregation,
        stores=stores, capacity=capacity, mode=mode,
    )  # fmt: skip
    return document.model_dump(mode="json")


# --- reading --------------------------------------------------------------------------------------


def _bad(source: str, where: str, problem: str) -> InputError:
    return InputError(f"{source}: {where}: {problem}", fix=_FIX)


def _invalid(source: str, where: str, exc: ValidationError) -> InputError:
    """The first pydantic error as one line: ``FILE: key.path: problem``."""
    problem = first_problem(exc)
    path = ".".join(str(part) for part in (where, *problem.loc) if part != "")
    return _bad(source, path, problem.reason)


def _unknown_keys(data: dict[str, Any], allowed: frozenset[str], where: str, source: str) -> None:
    extra = sorted(str(k) for k in data if k not in allowed)
    if extra:
        raise _bad(source, f"{where}.{extra[0][:40]}" if where else extra[0][:40], "not a key of the plan schema")


def _whole(data: dict[str, Any], key: str, where: str, source: str, minimum: int) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(source, f"{where}.{key}", f"must be a whole number, got {type(value).__name__}")
    if value < minimum:
        raise _bad(source, f"{where}.{key}", f"{key}={value}; must be at least {minimum}")
    return value


def _degree(data: dict[str, Any], key: str, where: str, source: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(source, f"{where}.{key}", f"must be a whole number, got {type(value).__name__}")
    if value < 1:
        raise _bad(source, f"{where}.{key}", f"{key}={value}; parallel degrees are at least 1")
    return value


def _hbm(data: Any, where: str, source: str) -> None:
    """The HBM share: bytes >= 0, and a ``total`` that is the sum of the parts."""
    if not isinstance(data, dict):
        raise _bad(source, where, f"must be an object, got {type(data).__name__}")
    _unknown_keys(data, HBM_KEYS, where, source)
    parts = {k: _whole(data, k, where, source, 0) for k in HbmShare.model_fields}
    if "total" in data and data["total"] != sum(parts.values()):
        raise _bad(
            source, f"{where}.total", f"{data['total']!r:.30} is not the sum of the parts ({sum(parts.values())})"
        )


def _experts(data: Any, ep: int, where: str, source: str) -> None:
    """The expert report: the placement's ``ep``, redundant slots (when given) spread evenly."""
    if data is None:
        return
    if not isinstance(data, dict):
        raise _bad(source, where, f"must be an object, got {type(data).__name__}")
    _unknown_keys(data, EXPERT_KEYS, where, source)
    if data.get("ep") != ep:
        raise _bad(source, f"{where}.ep", f"{data.get('ep')!r:.20} is not the placement's ep={ep}")
    replicas = _whole(data, "replicas", where, source, 0)
    _whole(data, "extra_bytes_per_gpu", where, source, 0)
    if "redundant_experts" not in data:  # an older document: the schema derives it
        return
    redundant = _whole(data, "redundant_experts", where, source, 0)
    if redundant % ep or redundant < replicas:
        raise _bad(
            source,
            f"{where}.redundant_experts",
            f"{redundant} slots for {replicas} copies on {ep} EP ranks (needs a multiple of ep, at least the copies)",
        )


def _placement(data: Any, where: str, source: str) -> None:
    """One stored placement's keys, degrees, ranks, dtypes and memory (before the schema derives
    ``tp_rank`` from ``tp``: ``tp: 0`` would divide by 0)."""
    if not isinstance(data, dict):
        raise _bad(source, where, f"must be an object, got {type(data).__name__}")
    _unknown_keys(data, PLACEMENT_KEYS, where, source)
    tp, pp = _degree(data, "tp", where, source), _degree(data, "pp", where, source)
    ep = _degree(data, "ep", where, source)
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        raise _bad(source, f"{where}.ranks", "must be a list of objects")
    if len(ranks) != tp * pp:
        raise _bad(source, f"{where}.ranks", f"{len(ranks)} ranks for tp={tp} x pp={pp} (needs {tp * pp})")
    if ep > len(ranks):
        raise _bad(source, f"{where}.ep", f"ep={ep} is more than the {len(ranks)} GPUs of the placement")
    if tp % ep:
        raise _bad(source, f"{where}.ep", f"ep={ep} does not divide tp={tp} (each expert is split over tp/ep GPUs)")
    for k, r in enumerate(ranks):
        _unknown_keys(r, RANK_KEYS, f"{where}.ranks.{k}", source)
    numbers = [r.get("rank") for r in ranks]
    if sorted(n for n in numbers if isinstance(n, int) and not isinstance(n, bool)) != list(range(len(ranks))):
        raise _bad(source, f"{where}.ranks", f"ranks must be numbered 0..{len(ranks) - 1}, once each")
    for key in ("stage_layers", "stage_domains"):
        value = data.get(key)
        if not isinstance(value, list) or len(value) != pp:
            got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
            raise _bad(source, f"{where}.{key}", f"must list the {pp} pipeline stage(s), got {got}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in data["stage_layers"]):
        raise _bad(source, f"{where}.stage_layers", "every stage holds at least one layer")
    for key in ("kv_nics", "host_numa"):
        value = data.get(key, [])
        if not isinstance(value, list) or len(value) not in (0, len(ranks)):
            got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
            raise _bad(source, f"{where}.{key}", f"must list one entry per rank ({len(ranks)}), got {got}")
    if data.get("kv_dtype") not in KV_DTYPES:
        raise _bad(source, f"{where}.kv_dtype", f"{data.get('kv_dtype')!r:.30} is not one of {', '.join(KV_DTYPES)}")
    _hbm(data.get("hbm_per_gpu"), f"{where}.hbm_per_gpu", source)
    _experts(data.get("experts"), ep, f"{where}.experts", source)


def _capacity(gpu: GPU) -> int | None:
    """A GPU's memory in bytes: what the snapshot says, else its type's, else unknown."""
    if gpu.hbm_gib is not None:
        return int(gpu.hbm_gib * _GIB)
    try:
        return gpu_type_for(gpu.model).memory_bytes if gpu.model else None
    except InputError:
        return None


def _expected_ids(p: Placement, where: str, doc: PlanDocument, source: str) -> tuple[str, list[str]]:
    """The request id and instance ids ``p`` may carry: the plan request's, or its role's when disaggregated."""
    request, pd = doc.request, doc.disaggregation
    if pd is None:
        if p.role is not None:
            raise _bad(source, f"{where}.role", f"role {p.role} in a plan without disaggregation")
        return request.id, instance_ids(request.id, request.replicas)
    if p.role is None:
        raise _bad(source, f"{where}.role", "a disaggregated plan's placements are prefill or decode")
    if len(p.kv_nics) != len(p.ranks):
        raise _bad(source, f"{where}.kv_nics", f"a {p.role} instance lists its KV NIC for each of its ranks")
    count = pd.prefill if p.role == "prefill" else pd.decode
    return role_request_id(request.id, p.role), role_ids(request.id, p.role, count)


def _rdma_devices(cluster: Cluster) -> dict[str, set[str]]:
    return {n.name: {nic.device for nic in n.nics if nic.device} for n in cluster.nodes}


def _check_pd(doc: PlanDocument, source: str) -> None:
    """Pairs between placements of the plan, KV NICs and stores on RDMA devices of their nodes."""
    devices = _rdma_devices(doc.cluster)
    for i, p in enumerate(doc.placements):
        for k, (r, nic) in enumerate(zip(p.ranks, p.kv_nics, strict=False)):
            if nic not in devices[r.node]:
                raise _bad(source, f"placements.{i}.kv_nics.{k}", f"{nic} is not an RDMA device of node {r.node}")
    nodes = {n.name: n for n in doc.cluster.nodes}
    for i, store in enumerate(doc.stores):
        node = nodes.get(store.node)
        if node is None:
            raise _bad(source, f"stores.{i}.node", f"node {store.node} is not in the plan's cluster")
        if store.rack != node.rack:
            raise _bad(source, f"stores.{i}.rack", f"node {store.node} is in rack {node.rack}, not {store.rack}")
        stray = sorted(set(store.nics) - devices[store.node])
        if stray:
            raise _bad(source, f"stores.{i}.nics", f"{stray[0]} is not an RDMA device of node {store.node}")
    pd = doc.disaggregation
    if pd is None:
        if doc.stores:
            raise _bad(source, "stores", "KV-cache stores in a plan without disaggregation")
        return
    roles = {p.id: p.role for p in doc.placements}
    for decode, prefill in pd.pairs.items():
        if roles.get(decode) != "decode" or roles.get(prefill) != "prefill":
            raise _bad(source, f"disaggregation.pairs.{decode}", f"{decode} -> {prefill} is not decode -> prefill")


def _check_placement(
    p: Placement,
    where: str,
    doc: PlanDocument,
    taken: dict[tuple[str, int], str],
    source: str,
) -> None:
    """Ids that are the request's (or its role's) instance ids, node names by the node rule, each rank
    on its own GPU of the cluster (not one another placement holds), a memory share that fits that GPU."""
    request_id, expected = _expected_ids(p, where, doc, source)
    wanted = doc.request.model
    if p.model != wanted and p.model != resolve_model(wanted).name:  # the catalog name the solver writes
        problem = f"{p.model!r:.60} is not the plan's model {wanted!r:.60} (its memory was planned for that one)"
        raise _bad(source, f"{where}.model", problem)
    if p.request_id != request_id:
        raise _bad(source, f"{where}.request_id", f"{p.request_id!r:.60} is not the plan's request id {request_id!r}")
    if p.id not in expected:
        problem = placement_id_problem(p.id) or (
            f"placement id {p.id!r} is not an instance of request {request_id!r} "
            f"({expected[0]}{'' if len(expected) == 1 else ' .. ' + expected[-1]})"
        )
        raise _bad(source, f"{where}.id", problem)
    cluster = doc.cluster
    nodes = {n.name: n for n in cluster.nodes}
    share = p.hbm_per_gpu.total
    for k, r in enumerate(p.ranks):
        bad_name = node_name_problem(r.node)
        if bad_name:
            raise _bad(source, f"{where}.ranks.{k}.node", bad_name)
        node = nodes.get(r.node)
        if node is None:
            raise InputError(f"{source}: placement {p.id} names node {r.node}, not in the plan's cluster", fix=_FIX)
        gpu = next((g for g in node.gpus if g.index == r.gpu), None)
        if gpu is None:
            raise InputError(
                f"{source}: placement {p.id} names GPU {r.node}/{r.gpu}, not in the plan's cluster", fix=_FIX
            )
        holder = taken.get((r.node, r.gpu))
        if holder is not None:
            what = "two ranks" if holder == p.id else f"ranks of placements {holder} and {p.id}"
            raise _bad(source, f"{where}.ranks.{k}", f"GPU {r.node}/{r.gpu} holds {what}")
        taken[(r.node, r.gpu)] = p.id
        if (r.stage, r.tp_rank) != divmod(r.rank, p.tp):
            raise _bad(
                source,
                f"{where}.ranks.{k}",
                f"rank {r.rank} with tp={p.tp} is not stage {r.stage}, tp rank {r.tp_rank}",
            )
        capacity = _capacity(gpu)
        if capacity is not None and share > capacity:
            raise _bad(
                source,
                f"{where}.hbm_per_gpu",
                f"{share / _GIB:.1f} GiB per GPU is more than the {capacity / _GIB:.1f} GiB of GPU {r.node}/{r.gpu}",
            )


def _check_request(request: PlacementRequest, source: str) -> None:
    problem = id_problem(request.id, "request id")
    if problem:
        raise _bad(source, "request.id", problem)
    for key, parse in (("weight_dtype", parse_weight_dtype), ("kv_dtype", parse_kv_dtype)):
        value = getattr(request, key)
        if value is not None:
            try:
                parse(value)
            except InputError as exc:
                raise _bad(source, f"request.{key}", exc.message) from None


def parse_plan(data: Any, source: str = "<plan>") -> PlanDoc:
    """Validate a plan document; errors name the file and the part that is wrong."""
    if not isinstance(data, dict) or "placements" not in data:
        raise InputError(f"{source}: not a plan (no 'placements')", fix="pass the output of `toposched plan --json`")
    if data.get("schema_version", PLAN_SCHEMA_VERSION) != PLAN_SCHEMA_VERSION:
        raise InputError(f"{source}: plan schema {data.get('schema_version')!r:.20} is not {PLAN_SCHEMA_VERSION}")
    for key in ("request", "cluster"):
        if key not in data:
            raise InputError(
                f"{source}: the plan has no '{key}'", fix="re-run `toposched plan --json` with this toposched version"
            )
    _unknown_keys(data, _TOP_KEYS, "", source)
    if not isinstance(data["placements"], list):
        raise _bad(source, "placements", "must be a list")
    try:
        cluster = Cluster.model_validate(data["cluster"])
    except ValidationError as exc:
        raise _invalid(source, "cluster", exc) from None
    try:
        request = PlacementRequest.model_validate(data["request"])
    except ValidationError as exc:
        raise _invalid(source, "request", exc) from None
    _check_request(request, source)
    for i, p in enumerate(data["placements"]):
        _placement(p, f"placements.{i}", source)
    try:  # the cluster and request as validated above, not a second time
        document = PlanDocument.model_validate({**data, "cluster": cluster, "request": request})
    except ValidationError as exc:
        raise _invalid(source, "", exc) from None
    placements = document.placements
    if not placements:
        raise InputError(f"{source}: the plan places nothing", fix="check `toposched plan` for the reasons")
    ids: set[str] = set()
    taken: dict[tuple[str, int], str] = {}
    for i, p in enumerate(placements):
        if p.id in ids:
            raise _bad(source, f"placements.{i}.id", f"placement {p.id} appears twice")
        _check_placement(p, f"placements.{i}", document, taken, source)
        ids.add(p.id)
    _check_pd(document, source)
    return PlanDoc(placements, request, cluster, document.disaggregation, document.stores)


def load_plan(path: str | Path) -> PlanDoc:
    """Read and check ``toposched plan --json`` output (a bounded regular file of strict JSON)."""
    text = read_text(path, what="plan")
    return parse_plan(load_json(text, source=str(path)), str(path))
