"""Reading the output of ``toposched plan --json`` back: placements, the request and the cluster.

The plan document is self-contained (it embeds the topology snapshot and the request), so a launch
plan can be made on another machine than the one that planned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from toposched.errors import InputError
from toposched.solver.request import Placement, PlacementRequest
from toposched.topology.model import Cluster

PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class PlanDoc:
    placements: tuple[Placement, ...]
    request: PlacementRequest
    cluster: Cluster


def _placement(data: dict[str, Any]) -> Placement:
    fields = dict(data)
    fields.pop("predicted", None)
    hbm = dict(fields.get("hbm_per_gpu", {}))
    hbm.pop("total", None)
    fields["hbm_per_gpu"] = hbm
    fields["ranks"] = [
        {**r, "tp_rank": r.get("tp_rank", r["rank"] % data["tp"]), "stage": r.get("stage", r["rank"] // data["tp"])}
        for r in data["ranks"]
    ]
    return Placement.model_validate(fields)


def parse_plan(data: Any, source: str = "<plan>") -> PlanDoc:
    """Validate a plan document; errors name the file and the part that is wrong."""
    if not isinstance(data, dict) or "placements" not in data:
        raise InputError(f"{source}: not a plan (no 'placements')", fix="pass the output of `toposched plan --json`")
    if data.get("schema_version", PLAN_SCHEMA_VERSION) != PLAN_SCHEMA_VERSION:
        raise InputError(f"{source}: plan schema {data.get('schema_version')} is not {PLAN_SCHEMA_VERSION}")
    for key in ("request", "cluster"):
        if key not in data:
            raise InputError(
                f"{source}: the plan has no '{key}'", fix="re-run `toposched plan --json` with this toposched version"
            )
    try:
        placements = tuple(_placement(p) for p in data["placements"])
        request = PlacementRequest.model_validate(data["request"])
        cluster = Cluster.model_validate(data["cluster"])
    except (ValidationError, KeyError, TypeError) as exc:
        raise InputError(f"{source}: the plan is malformed ({exc})".splitlines()[0]) from exc
    if not placements:
        raise InputError(f"{source}: the plan places nothing", fix="check `toposched plan` for the reasons")
    nodes = {n.name: {g.index for g in n.gpus} for n in cluster.nodes}
    for p in placements:
        for r in p.ranks:
            if r.gpu not in nodes.get(r.node, set()):
                raise InputError(f"{source}: placement {p.id} names GPU {r.node}/{r.gpu}, not in the plan's cluster")
    return PlanDoc(placements, request, cluster)


def load_plan(path: str | Path) -> PlanDoc:
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise InputError(f"cannot read plan {file}: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{file}: not JSON (line {exc.lineno}: {exc.msg})") from exc
    return parse_plan(data, str(file))
