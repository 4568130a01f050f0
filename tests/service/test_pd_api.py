"""``POST /v1/placements`` with ``pd``: every prefill and decode instance booked, or none.

In-process (``create_app`` under Starlette's ``TestClient``): two racks of one HGX H100 node each (8 GPUs,
8 RDMA NICs), a SQLite state file so a second replica can rebuild the request from the ledger alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from toposched.ledger.base import ReserveResult
from toposched.ledger.memory import MemoryLedger
from toposched.service import state as state_module
from toposched.service.app import create_app
from toposched.service.config import ServiceConfig
from toposched.service.request import PdSpec, ServiceRequest
from toposched.service.state import ServiceState
from toposched.solver.pd import place_pd
from toposched.solver.scheduler import Scheduler
from toposched.topology.sources import SourceRef

SPEC = (
    "name: two-racks\nnodes:\n"
    "  - name: 'a{i}'\n    count: 1\n    preset: hgx-h100\n    rack: ra\n"
    "  - name: 'b{i}'\n    count: 1\n    preset: hgx-h100\n    rack: rb\n"
)
PD: dict[str, Any] = {"prefill": 1, "decode": 2, "kv_store": "mooncake"}
BODY: dict[str, Any] = {"id": "pd", "model": "llama-3.1-8b", "allowed_tp": [2], "pd": PD}


def make_state(tmp_path: Path, state: str = "", **extra: Any) -> ServiceState:
    spec = tmp_path / "cluster.yaml"
    spec.write_text(SPEC)
    url = state or f"sqlite:{tmp_path / 'state.db'}"
    source = SourceRef(kind="cluster", ref=str(spec))
    config = ServiceConfig.model_validate({"state": url, "source": source, "auth": False, **extra})
    s = ServiceState(config)
    s.open()
    return s


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    state = make_state(tmp_path)
    with TestClient(create_app(state.config, state)) as test_client:
        yield test_client


def state_of(client: TestClient) -> ServiceState:
    return client.app.state.toposched  # type: ignore[attr-defined,no-any-return]


def held(client: TestClient) -> set[str]:
    return {r.id for r in state_of(client).ledger.reservations()}


def test_every_role_is_booked_with_its_kv_nics_pairs_and_stores(client: TestClient) -> None:
    made = client.post("/v1/placements", json=BODY)
    assert made.status_code == 201, made.text
    answer = made.json()
    by_id = {i["id"]: i for i in answer["instances"]}
    assert sorted(by_id) == ["pd-decode-0", "pd-decode-1", "pd-prefill"]
    assert [by_id[i]["role"] for i in sorted(by_id)] == ["decode", "decode", "prefill"]
    cluster = state_of(client).scheduler.cluster
    nodes = {n.name: n for n in cluster.nodes}
    for instance in answer["instances"]:
        ranks = instance["ranks"]
        assert len(instance["kv_nics"]) == len(ranks) == len(instance["host_numa"])
        for rank, nic, numa in zip(ranks, instance["kv_nics"], instance["host_numa"], strict=True):
            node = nodes[rank["node"]]
            assert nic in {n.device for n in node.nics}
            assert numa == node.gpu(rank["gpu"]).numa_node
    assert answer["pd"] == {
        **PD,
        "same_rack_required": False,
        "pairs": dict.fromkeys(["pd-decode-0", "pd-decode-1"], "pd-prefill"),
    }
    prefill_racks = {nodes[r["node"]].rack for r in by_id["pd-prefill"]["ranks"]}
    decode_racks = {nodes[r["node"]].rack for i in ("pd-decode-0", "pd-decode-1") for r in by_id[i]["ranks"]}
    assert decode_racks == prefill_racks  # one rack holds the whole group (8 GPUs, 6 used)
    (store,) = answer["stores"]
    assert store["rack"] in decode_racks and store["nics"]
    assert held(client) == set(by_id)
    assert client.get("/v1/placements/pd").json() == answer
    (listed,) = client.get("/v1/placements").json()["placements"]
    assert listed == answer


def test_decode_instances_carry_the_near_check_of_the_plan(client: TestClient) -> None:
    """The answer's decode instances have the constraint checks ``toposched plan --pd-*`` gives them,
    ``near`` included, and so does the ledger record another replica rebuilds them from."""
    answer = client.post("/v1/placements", json=BODY).json()
    cluster = state_of(client).scheduler.cluster
    planned = place_pd(Scheduler(cluster), ServiceRequest.model_validate(BODY).request("pd"), PdSpec(**PD).layout())
    plan = {p.id: [c.model_dump(mode="json") for c in p.constraints] for p in planned.outcome.placements}
    for instance in answer["instances"]:
        assert instance["constraints"] == plan[instance["id"]], instance["id"]
        near = [c for c in instance["constraints"] if c["name"] == "near"]
        if instance["role"] == "decode":
            (check,) = near
            assert check["held"] and check["detail"].endswith("the same rack as prefill pd-prefill")
        else:
            assert near == []
    record = state_of(client).ledger.get("pd-decode-0")
    assert record is not None and '"name":"near"' in record.meta["placement"]


def test_another_replica_rebuilds_the_request_from_the_ledger(client: TestClient, tmp_path: Path) -> None:
    answer = client.post("/v1/placements", json=BODY).json()
    other = make_state(tmp_path)
    try:
        with TestClient(create_app(other.config, other)) as second:
            seen = second.get("/v1/placements/pd")
            assert seen.status_code == 200, seen.text
            mine = {k: v for k, v in answer.items() if k != "owner"}
            assert {k: v for k, v in seen.json().items() if k != "owner"} == mine
            again = second.post("/v1/placements", json=BODY)  # the same id and body: the existing placement
            assert again.status_code == 200 and again.json()["instances"] == answer["instances"]
    finally:
        other.close()


def test_same_id_same_body_is_the_placement_another_body_is_a_conflict(client: TestClient) -> None:
    first = client.post("/v1/placements", json=BODY)
    assert first.status_code == 201
    again = client.post("/v1/placements", json=BODY)
    assert again.status_code == 200 and again.json() == first.json()
    other = client.post("/v1/placements", json={**BODY, "pd": {**PD, "decode": 1}})
    assert other.status_code == 409 and other.json()["status"] == "conflict"
    plain = client.post("/v1/placements", json={k: v for k, v in BODY.items() if k != "pd"})
    assert plain.status_code == 409
    assert held(client) == {"pd-prefill", "pd-decode-0", "pd-decode-1"}


def test_renew_and_delete_act_on_every_role(client: TestClient) -> None:
    assert client.post("/v1/placements", json={**BODY, "ttl_s": 60}).status_code == 201
    leases = {r.id: r.expires_at or 0.0 for r in state_of(client).ledger.reservations()}
    assert len(leases) == 3 and all(leases.values())
    renewed = client.post("/v1/placements/pd/renew", json={"ttl_s": 3600})
    assert renewed.status_code == 200 and renewed.json()["pd"]["pairs"]
    for r in state_of(client).ledger.reservations():
        assert r.expires_at is not None and r.expires_at > leases[r.id] + 3000
    gone = client.delete("/v1/placements/pd")
    assert gone.status_code == 200
    assert sorted(gone.json()["released"]) == ["pd-decode-0", "pd-decode-1", "pd-prefill"]
    assert held(client) == set()
    assert client.get("/v1/placements/pd").status_code == 404
    assert len(state_of(client).scheduler.index.free) == 16


def test_a_decode_instance_with_no_room_books_nothing_of_the_request(client: TestClient) -> None:
    filler = {"id": "fill", "model": "llama-3.1-8b", "allowed_tp": [1], "replicas": 14}
    assert client.post("/v1/placements", json=filler).status_code == 201
    # two GPUs left: the TP2 prefill instance fits, no decode instance does
    refused = client.post("/v1/placements", json=BODY)
    assert refused.status_code == 409, refused.text
    assert refused.json()["status"] == "no-capacity" and refused.json()["reasons"]
    assert held(client) == {f"fill-{n}" for n in range(14)}
    assert client.get("/v1/placements/pd").status_code == 404
    assert len(state_of(client).scheduler.index.free) == 2


class RefusingLedger(MemoryLedger):
    """Refuses every booking of one placement id (another replica holds it, every time)."""

    def __init__(self, refuse: str) -> None:
        super().__init__()
        self.refuse = refuse
        self.booked: set[str] = set()

    def reserve(self, rid: str, gpus: Mapping[str, int], **kw: Any) -> ReserveResult:
        if rid == self.refuse:
            return ReserveResult(status="conflict", reasons={"request": f"{rid} is held elsewhere (test)"})
        self.booked.add(rid)
        return super().reserve(rid, gpus, **kw)


def test_a_ledger_refusal_after_some_roles_are_booked_releases_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = RefusingLedger("pd-decode-1")
    monkeypatch.setattr(state_module, "open_ledger", lambda url, clock: ledger)
    state = make_state(tmp_path, "memory", commit_retries=2)
    try:
        decision = state.place(ServiceRequest.model_validate(BODY))
        assert decision.status == "no-capacity" and decision.instances == ()
        assert state.counters.ledger_refusals == 2
        assert ledger.booked == {"pd-prefill", "pd-decode-0"}
        assert ledger.reservations() == []  # booked, then released
        assert state.scheduler.placements == {} and len(state.scheduler.index.free) == 16
    finally:
        state.close()


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({**BODY, "replicas": 2}, "replicas goes without pd"),
        ({**BODY, "near": "x"}, "near goes without pd"),
        ({**BODY, "pd": {**PD, "prefill": 0}}, "greater than or equal to 1"),
        ({**BODY, "pd": {**PD, "kv_store": "redis"}}, "mooncake"),
        ({**BODY, "pd": {**PD, "pairs": {}}}, "Extra inputs"),
    ],
)
def test_a_bad_pd_body_is_a_422_naming_the_problem(client: TestClient, body: dict[str, Any], says: str) -> None:
    bad = client.post("/v1/placements", json=body)
    assert bad.status_code == 422
    answer = bad.json()
    assert answer["error"] == "invalid request"
    assert any(says in f["message"] for f in answer["fields"]), answer
    assert held(client) == set()


def test_the_key_of_a_plain_request_has_no_pd_field() -> None:
    plain = ServiceRequest(model="llama-3.1-8b")
    assert "pd" not in json.loads(plain.key())
    split = ServiceRequest.model_validate({k: v for k, v in BODY.items() if k != "id"})
    assert json.loads(split.key())["pd"] == {**PD, "same_rack_required": False}


def test_gpus_without_an_rdma_nic_on_their_numa_node_are_a_422_that_books_nothing(client: TestClient) -> None:
    scheduler = state_of(client).scheduler
    bare = [
        n.model_copy(update={"nics": tuple(c.model_copy(update={"device": None}) for c in n.nics)})
        for n in scheduler.cluster.nodes
    ]
    scheduler.cluster = scheduler.cluster.model_copy(update={"nodes": tuple(bare)})
    refused = client.post("/v1/placements", json=BODY)
    assert refused.status_code == 422, refused.text
    assert "no nearest NIC with an RDMA device" in refused.json()["detail"] and refused.json()["fix"]
    assert held(client) == set() and scheduler.placements == {}


def test_a_half_booked_request_of_a_replica_that_died_is_released_after_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stale sweep counts a disaggregated request's slots (prefill and decode ids), not ``replicas``."""
    from tests.service.test_faults import FaultyLedger
    from toposched.errors import StateError
    from toposched.service.following import STALE_PARTIAL_S

    now = [1000.0]
    inner = MemoryLedger(clock=lambda: now[0])
    faulty = FaultyLedger(inner)
    ledgers = iter([faulty, inner])
    monkeypatch.setattr(state_module, "open_ledger", lambda url, clock: next(ledgers))
    spec = tmp_path / "cluster.yaml"
    spec.write_text(SPEC)
    source = SourceRef(kind="cluster", ref=str(spec))
    config = ServiceConfig.model_validate({"state": "memory", "source": source, "auth": False})
    dead, alive = ServiceState(config, ledger_clock=lambda: now[0]), ServiceState(config, ledger_clock=lambda: now[0])
    dead.open()
    alive.open()
    try:
        faulty.fail("reserve", StateError("store down (test)"), after=2)  # prefill and decode-0 go through
        faulty.fail("release", StateError("store down (test)"))
        with pytest.raises(StateError):
            dead.place(ServiceRequest.model_validate(BODY))
        assert sorted(r.id for r in inner.reservations()) == ["pd-decode-0", "pd-prefill"]
        assert alive.sync() and alive.lookup("pd") == []  # hidden while it may still complete
        now[0] += STALE_PARTIAL_S - 1
        assert alive.sync() and len(inner.reservations()) == 2
        now[0] += 2
        assert alive.sync() and inner.reservations() == []  # two of three slots, stale: released
        assert len(alive.scheduler.index.free) == 16
    finally:
        alive.close()
