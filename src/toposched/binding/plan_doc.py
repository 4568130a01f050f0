"""Reading the output of ``toposched plan --json`` back: placements, the request and the cluster.

The plan document is self-contained (it embeds the topology snapshot and the request), so a launch
plan can be made on another machine than the one that planned. That also makes it an input from
outside: a plan may have been edited or forged, and its ids and node names end up in scripts, file
names and Kubernetes objects. So every name is checked by the rules of ``toposched.names`` (the
cluster through the topology model, the request id here), placement ids must be the request's
instance ids (``ID`` or ``ID-N``), and the degrees must match the ranks (``tp``, ``pp`` >= 1,
``tp * pp`` ranks numbered ``0..n-1``, each on its own GPU). A bad plan is one line naming the file
and the key path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from toposched.errors import InputError
from toposched.inputs import load_json, read_text
from toposched.names import id_problem, node_name_problem, placement_id_problem
from toposched.solver.request import Placement, PlacementRequest, instance_ids
from toposched.topology.model import Cluster

PLAN_SCHEMA_VERSION = 1
_FIX = "pass the output of `toposched plan --json` unedited, or plan again"


@dataclass(frozen=True)
class PlanDoc:
    placements: tuple[Placement, ...]
    request: PlacementRequest
    cluster: Cluster


def _bad(source: str, where: str, problem: str) -> InputError:
    return InputError(f"{source}: {where}: {problem}", fix=_FIX)


def _invalid(source: str, where: str, exc: ValidationError) -> InputError:
    """The first pydantic error as one line: ``FILE: key.path: problem``."""
    err = exc.errors()[0]
    path = ".".join(str(part) for part in (where, *err["loc"]) if part != "")
    problem = " ".join(str(err["msg"]).removeprefix("Value error, ").split())
    return _bad(source, path, problem)


def _degree(data: dict[str, Any], key: str, where: str, source: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(source, f"{where}.{key}", f"must be a whole number, got {type(value).__name__}")
    if value < 1:
        raise _bad(source, f"{where}.{key}", f"{key}={value}; parallel degrees are at least 1")
    return value


def _placement(data: Any, where: str, source: str) -> Placement:
    """One placement, after checking the degrees its ranks are derived from (``tp: 0`` would divide by 0)."""
    if not isinstance(data, dict):
        raise _bad(source, where, f"must be an object, got {type(data).__name__}")
    tp, pp = _degree(data, "tp", where, source), _degree(data, "pp", where, source)
    ep = _degree(data, "ep", where, source)
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        raise _bad(source, f"{where}.ranks", "must be a list of objects")
    if len(ranks) != tp * pp:
        raise _bad(source, f"{where}.ranks", f"{len(ranks)} ranks for tp={tp} x pp={pp} (needs {tp * pp})")
    if ep > len(ranks):
        raise _bad(source, f"{where}.ep", f"ep={ep} is more than the {len(ranks)} GPUs of the placement")
    numbers = [r.get("rank") for r in ranks]
    if sorted(n for n in numbers if isinstance(n, int) and not isinstance(n, bool)) != list(range(len(ranks))):
        raise _bad(source, f"{where}.ranks", f"ranks must be numbered 0..{len(ranks) - 1}, once each")
    fields = dict(data)
    fields.pop("predicted", None)
    hbm = fields.get("hbm_per_gpu", {})
    fields["hbm_per_gpu"] = {k: v for k, v in hbm.items() if k != "total"} if isinstance(hbm, dict) else hbm
    fields["ranks"] = [
        {**r, "tp_rank": r.get("tp_rank", r["rank"] % tp), "stage": r.get("stage", r["rank"] // tp)} for r in ranks
    ]
    try:
        return Placement.model_validate(fields)
    except ValidationError as exc:
        raise _invalid(source, where, exc) from None


def _check_placement(
    p: Placement, where: str, request: PlacementRequest, nodes: dict[str, set[int]], source: str
) -> None:
    """Ids that are the request's instance ids, node names by the node rule, each rank on its own GPU."""
    if p.request_id != request.id:
        raise _bad(source, f"{where}.request_id", f"{p.request_id!r:.60} is not the plan's request id {request.id!r}")
    expected = instance_ids(request.id, request.replicas)
    if p.id not in expected:
        problem = placement_id_problem(p.id) or (
            f"placement id {p.id!r} is not an instance of request {request.id!r} "
            f"({expected[0]}{'' if len(expected) == 1 else ' .. ' + expected[-1]})"
        )
        raise _bad(source, f"{where}.id", problem)
    seen: set[tuple[str, int]] = set()
    for k, r in enumerate(p.ranks):
        bad_name = node_name_problem(r.node)
        if bad_name:
            raise _bad(source, f"{where}.ranks.{k}.node", bad_name)
        if r.gpu not in nodes.get(r.node, set()):
            raise InputError(f"{source}: placement {p.id} names GPU {r.node}/{r.gpu}, not in the plan's cluster")
        if (r.node, r.gpu) in seen:
            raise _bad(source, f"{where}.ranks.{k}", f"GPU {r.node}/{r.gpu} holds two ranks")
        seen.add((r.node, r.gpu))
        if (r.stage, r.tp_rank) != divmod(r.rank, p.tp):
            raise _bad(
                source,
                f"{where}.ranks.{k}",
                f"rank {r.rank} with tp={p.tp} is not stage {r.stage}, tp rank {r.tp_rank}",
            )


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
    problem = id_problem(request.id, "request id")
    if problem:
        raise _bad(source, "request.id", problem)
    placements = tuple(_placement(p, f"placements.{i}", source) for i, p in enumerate(data["placements"]))
    if not placements:
        raise InputError(f"{source}: the plan places nothing", fix="check `toposched plan` for the reasons")
    nodes = {n.name: {g.index for g in n.gpus} for n in cluster.nodes}
    ids: set[str] = set()
    for i, p in enumerate(placements):
        _check_placement(p, f"placements.{i}", request, nodes, source)
        if p.id in ids:
            raise _bad(source, f"placements.{i}.id", f"placement {p.id} appears twice")
        ids.add(p.id)
    return PlanDoc(placements, request, cluster)


def load_plan(path: str | Path) -> PlanDoc:
    """Read and check ``toposched plan --json`` output (a bounded regular file of strict JSON)."""
    text = read_text(path, what="plan")
    return parse_plan(load_json(text, source=str(path)), str(path))
