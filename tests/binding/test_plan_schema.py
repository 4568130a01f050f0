"""One schema for plan documents: what the writer writes is what the reader takes, key for key and version."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from toposched.binding.plan_doc import parse_plan, plan_json
from toposched.binding.plan_schema import PLAN_SCHEMA_VERSION, PlanDocument, placement_fields
from toposched.errors import InputError
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.presets import load_preset


def _document(model: str = "llama-3.1-8b", preset: str = "hgx-h100", **kw: Any) -> dict[str, Any]:
    cluster = load_preset(preset)
    request = PlacementRequest(id="plan", model=model, **kw)
    out = Scheduler(cluster).place(request)
    return plan_json(out.placements, out.unplaced, request, cluster, policy="slo", source=f"preset:{preset}")


def test_the_writer_writes_the_schema_keys_in_the_schema_order() -> None:
    doc = _document(allowed_tp=(4,), replicas=3)  # two fit, one does not: unplaced is written too
    assert list(doc) == list(PlanDocument.model_fields)
    assert doc["schema_version"] == PLAN_SCHEMA_VERSION == 1
    assert len(doc["placements"]) == 2 and doc["unplaced"][0]["status"] in ("queued", "rejected")
    assert all("tp_rank" not in r for p in doc["placements"] for r in p["ranks"])
    # the schema reads its own output back to the same document
    assert PlanDocument.model_validate(json.loads(json.dumps(doc))).model_dump(mode="json") == doc


def test_an_older_document_reads_as_the_current_one() -> None:
    """Ranks without ``stage``, with ``tp_rank``; experts without ``redundant_experts`` (added later)."""
    skewed = (0.4, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05)
    doc = _document("mixtral-8x7b", "hgx-h200", allowed_tp=(2,), ep=2, expert_replicas=2, expert_hit_rates=skewed)
    placement = doc["placements"][0]
    assert placement["experts"]["replicas"] > 0  # so the derived slots are not 0 by default
    older = copy.deepcopy(doc)
    for r in older["placements"][0]["ranks"]:
        del r["stage"]
        r["tp_rank"] = r["rank"] % placement["tp"]
    del older["placements"][0]["experts"]["redundant_experts"]
    current, old = parse_plan(doc, "new.json"), parse_plan(older, "old.json")
    assert old.placements == current.placements
    experts = old.placements[0].experts
    assert experts is not None and experts.redundant_experts % experts.ep == 0
    assert experts.redundant_experts >= experts.replicas


def test_parts_the_reader_used_to_skip_are_checked_against_the_schema() -> None:
    doc = _document(allowed_tp=(4,), replicas=3)
    doc["unplaced"][0]["status"] = "maybe"
    with pytest.raises(InputError, match=r"^p.json: unplaced.0.status: Input should be 'queued' or 'rejected'"):
        parse_plan(doc, "p.json")
    doc = _document()
    doc["cluster_summary"]["gpus"] = "many"
    with pytest.raises(InputError, match=r"^p.json: cluster_summary.gpus: "):
        parse_plan(doc, "p.json")


def test_another_schema_version_is_refused_by_number() -> None:
    doc = _document()
    doc["schema_version"] = 2
    with pytest.raises(InputError, match="plan schema 2 is not 1"):
        parse_plan(doc, "p.json")


def test_placement_fields_leaves_what_it_cannot_derive_to_validation() -> None:
    """``tp: 0`` derives nothing (no division by zero); the placement model then refuses it."""
    stored = _document()["placements"][0]
    assert placement_fields({**stored, "tp": 0})["ranks"] == stored["ranks"]
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        PlanDocument.model_validate({**_document(), "placements": [{**stored, "tp": 0}]})
