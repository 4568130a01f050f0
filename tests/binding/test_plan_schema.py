"""One schema for plan documents: what the writer writes is what the reader takes, key for key and version."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from toposched.binding.plan_doc import parse_plan, plan_json
from toposched.binding.plan_schema import PLAN_SCHEMA_VERSION, PlanDocument, placement_fields
from toposched.errors import InputError
from toposched.solver.pd import Disaggregation, place_pd
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


# --- prefill/decode disaggregation ------------------------------------------------------------------


def _pd_document() -> dict[str, Any]:
    cluster = load_preset("cluster-32x-hgx-h100")
    request = PlacementRequest(id="plan", model="llama-3.1-70b", slo_ttft_ms=600, slo_tpot_ms=40)
    made = place_pd(Scheduler(cluster), request, Disaggregation(prefill=2, decode=3, kv_store="mooncake"))
    out = made.outcome
    return plan_json(
        out.placements, out.unplaced, request, cluster, policy="slo", source="preset:cluster-32x-hgx-h100",
        disaggregation=made.layout, stores=made.stores,
    )  # fmt: skip


def test_a_disaggregated_plan_carries_roles_kv_nics_and_stores_and_reads_back() -> None:
    doc = _pd_document()
    roles = [p["role"] for p in doc["placements"]]
    assert roles == ["prefill"] * 2 + ["decode"] * 3
    assert [p["id"] for p in doc["placements"]] == [
        "plan-prefill-0", "plan-prefill-1", "plan-decode-0", "plan-decode-1", "plan-decode-2",
    ]  # fmt: skip
    for p in doc["placements"]:
        assert len(p["kv_nics"]) == len(p["ranks"]) and all(n.startswith("mlx5_") for n in p["kv_nics"])
    assert doc["stores"] and all(set(s) == {"node", "rack", "nics"} for s in doc["stores"])
    store_nodes = {s["node"] for s in doc["stores"]}
    assert store_nodes <= {n["name"] for n in doc["cluster"]["nodes"]}  # the store's node is in the snapshot
    parsed = parse_plan(json.loads(json.dumps(doc)), "pd.json")
    assert parsed.disaggregation is not None and parsed.disaggregation.decode == 3
    assert [s.node for s in parsed.stores] == [s["node"] for s in doc["stores"]]
    again = plan_json(
        parsed.placements, [], parsed.request, parsed.cluster, policy="slo", source=doc["source"],
        disaggregation=parsed.disaggregation, stores=parsed.stores,
    )  # fmt: skip
    assert again == {**doc, "unplaced": [], "cluster_summary": again["cluster_summary"]}


def test_a_plan_written_before_disaggregation_reads_as_it_did() -> None:
    doc = _document(allowed_tp=(4,), replicas=2)
    older = copy.deepcopy(doc)
    for key in ("disaggregation", "stores"):
        del older[key]
    for p in older["placements"]:
        for key in ("role", "kv_nics", "host_numa"):
            del p[key]
    old, current = parse_plan(older, "old.json"), parse_plan(doc, "new.json")
    assert old == current and old.disaggregation is None and old.stores == ()
    assert all(p.role is None and p.kv_nics == () for p in old.placements)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(last) if last.isdigit() else last] = value

    return edit


PD_TAMPERED = [
    ("a role lost", _set("placements.0.role", None), "placements.0.role: a disaggregated plan's placements"),
    ("a KV NIC per rank lost", lambda d: d["placements"][0]["kv_nics"].pop(), "placements.0.kv_nics: must list one"),
    ("a KV NIC the node lacks", _set("placements.2.kv_nics.0", "mlx5_9"), "mlx5_9 is not an RDMA device of node"),
    ("a role's id", _set("placements.0.id", "plan-decode-7"), "placements.0.id: placement id 'plan-decode-7' is not"),
    ("a store's rack", _set("stores.0.rack", "rack7"), "stores.0.rack: node h100-"),
    ("a store's NIC", _set("stores.0.nics", ["ib0"]), "stores.0.nics: ib0 is not an RDMA device"),
    (
        "a pair turned round",
        _set("disaggregation.pairs", {"plan-prefill-0": "plan-decode-0"}),
        "is not decode -> prefill",
    ),
    ("disaggregation dropped", _set("disaggregation", None), "placements.0.role: role prefill in a plan without"),
]


@pytest.mark.parametrize(("case", "edit", "message"), PD_TAMPERED, ids=[c for c, _, _ in PD_TAMPERED])
def test_a_tampered_disaggregated_plan_is_refused_by_key_path(
    case: str, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    doc = _pd_document()
    parse_plan(copy.deepcopy(doc), "pd.json")  # untampered, it reads
    edit(doc)
    with pytest.raises(InputError) as info:
        parse_plan(doc, "pd.json")
    assert info.value.message.startswith("pd.json: ") and message in info.value.message, (case, info.value.message)


def test_stores_in_a_plain_plan_are_refused() -> None:
    doc = _document()
    store = {"node": doc["cluster"]["nodes"][0]["name"], "rack": None, "nics": ["mlx5_0"]}
    with pytest.raises(InputError, match="stores: KV-cache stores in a plan without disaggregation"):
        parse_plan({**doc, "stores": [store]}, "p.json")
