"""Defragmentation in the service: POST /v1/defrag, /v1/defrag/finish, and the admission queue's head.

In-process (``create_app`` under Starlette's ``TestClient``, a memory ledger, a fake clock): a 3 x HGX H100
cluster with 8 free GPUs but no node with 8; node h2 is freed by moving two TP2 instances.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from toposched.errors import StateError
from toposched.ledger.base import ReserveResult
from toposched.ledger.memory import MemoryLedger
from toposched.service import state as state_module
from toposched.service.app import create_app
from toposched.service.config import ServiceConfig
from toposched.service.records import Decision
from toposched.service.schemas import PlaceBody
from toposched.service.state import ServiceState
from toposched.topology.sources import SourceRef

SPEC = "name: three\nnodes:\n  - name: 'h{i}'\n    count: 3\n    preset: hgx-h100\n"
# h0: 2 free (0-1), h1: 2 free (6-7), h2: 4 free (2-3, 6-7) around TP2 instances n2i0 (0-1) and n2i2 (4-5)
FRAGMENTED = ("n0i0", "n1i3", "n1i4", "n2i1", "n2i3", "n2i4")
H2 = [f"h2/{i}" for i in range(8)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_state(tmp_path: Path, clock: Clock, released: tuple[str, ...] = FRAGMENTED, **extra: Any) -> ServiceState:
    spec = tmp_path / "cluster.yaml"
    spec.write_text(SPEC)
    source = SourceRef(kind="cluster", ref=str(spec))
    config = ServiceConfig.model_validate({"state": "memory", "source": source, "auth": False, **extra})
    state = ServiceState(config, clock=clock)
    state.open()
    for n in range(3):
        for k, tp in enumerate((2, 2, 2, 1, 1)):
            body = PlaceBody.model_validate({"model": "llama-3.1-8b", "id": f"n{n}i{k}", "allowed_tp": [tp]})
            assert state.place(body).status == "placed"
    for rid in released:
        assert state.release(rid)
    return state


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def client(tmp_path: Path, clock: Clock) -> Iterator[TestClient]:
    state = make_state(tmp_path, clock, defrag_moves_per_window=3)
    with TestClient(create_app(state.config, state)) as test_client:
        yield test_client


def held(client: TestClient) -> set[str]:
    state: ServiceState = client.app.state.toposched  # type: ignore[attr-defined]
    return {r.id for r in state.ledger.reservations()}


def test_a_dry_run_plans_and_books_nothing(client: TestClient) -> None:
    before = held(client)
    answer = client.post("/v1/defrag", json={"need_gpus": 8})
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    assert doc["dry_run"] is True and doc["booked"] == [] and doc["level"] == "nvlink"
    assert [m["placement_id"] for m in doc["moves"]] == ["n2i0", "n2i2"] and doc["gpus_moved"] == 4
    assert sorted(doc["frees"]) == H2
    assert held(client) == before
    by_model = client.post("/v1/defrag", json={"model": "llama-3.1-70b", "tp": 8}).json()
    assert by_model["need_gpus"] == 8 and by_model["moves"] == doc["moves"]


def test_booking_then_finishing_frees_the_node_and_counts_migrations(client: TestClient) -> None:
    answer = client.post("/v1/defrag", json={"need_gpus": 8, "dry_run": False})
    assert answer.status_code == 200, answer.text
    assert answer.json()["booked"] == ["n2i0.m1", "n2i2.m1"]
    assert {"n2i0", "n2i2", "n2i0.m1", "n2i2.m1"} <= held(client)
    # while both copies are held the placement shows the old one (it still serves)
    shown = client.get("/v1/placements/n2i0").json()
    assert [i["id"] for i in shown["instances"]] == ["n2i0"]
    assert client.post("/v1/defrag/finish", json={"placement_id": "n2i0", "replacement_id": "n2i0.m1"}).json()[
        "released"
    ] == ["n2i0"]
    assert (
        client.post("/v1/defrag/finish", json={"placement_id": "n2i2", "replacement_id": "n2i2.m1"}).status_code == 200
    )
    assert {"n2i0", "n2i2"}.isdisjoint(held(client))
    moved = client.get("/v1/placements/n2i0").json()
    assert [i["id"] for i in moved["instances"]] == ["n2i0.m1"] and moved["instances"][0]["gpus"] == ["h0/0", "h0/1"]
    topology = client.get("/v1/topology").json()
    free = {g["ref"] for n in topology["nodes"] for g in n["gpus"] if g["free"]}
    assert set(H2) <= free
    metrics = client.get("/metrics").text
    assert 'toposched_decisions_total{outcome="defrag-move"} 2.0' in metrics
    assert "toposched_migrations_proposed_total 2.0" in metrics
    # the same request again is the placement it was (its instance now lives under the new id)
    again = client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": "n2i0", "allowed_tp": [2]})
    assert again.status_code == 200 and again.json()["instances"][0]["id"] == "n2i0.m1"


def test_refusals_have_the_error_shape(client: TestClient) -> None:
    none = client.post("/v1/defrag", json={"need_gpus": 8, "max_moves": 1})
    assert none.status_code == 409 and none.json()["error"] == "no defrag plan"
    assert "at most 1 move(s)" in none.json()["detail"]
    too_big = client.post("/v1/defrag", json={"need_gpus": 16})
    assert too_big.status_code == 409 and "holds 16 GPUs" in too_big.json()["detail"]
    for body in ({}, {"need_gpus": 8, "model": "llama-3.1-8b"}, {"model": "llama-3.1-8b", "tp": 3}, {"model": "x"}):
        bad = client.post("/v1/defrag", json=body)
        assert bad.status_code == 422 and bad.json()["error"] == "invalid request", body
    not_a_move = client.post("/v1/defrag/finish", json={"placement_id": "n2i0", "replacement_id": "n2i2"})
    assert not_a_move.status_code == 409 and "not a booked replacement" in not_a_move.json()["detail"]
    assert "n2i0" in held(client)  # nothing released
    unknown = client.post("/v1/defrag/finish", json={"placement_id": "zz", "replacement_id": "zz.m1"})
    assert unknown.status_code == 404


def test_booking_is_rate_limited(client: TestClient, clock: Clock) -> None:
    state: ServiceState = client.app.state.toposched  # type: ignore[attr-defined]
    clock.now = 100.0
    state.defrag_limiter.record(clock.now, 2)  # 2 of the 3 moves this window allows are used
    before = held(client)
    limited = client.post("/v1/defrag", json={"need_gpus": 8, "dry_run": False})
    assert limited.status_code == 429 and limited.json()["error"] == "rate limited"
    assert int(limited.headers["Retry-After"]) == int(state.config.defrag_window_s)
    assert held(client) == before
    assert client.post("/v1/defrag", json={"need_gpus": 8}).status_code == 200  # a dry run is not limited
    clock.now += state.config.defrag_window_s
    assert client.post("/v1/defrag", json={"need_gpus": 8, "dry_run": False}).status_code == 200
    assert {"n2i0.m1", "n2i2.m1"} <= held(client)


def test_the_queue_head_gets_a_plan_rate_limited_and_never_run(tmp_path: Path, clock: Clock) -> None:
    state = make_state(tmp_path, clock, defrag_plan_interval_s=10)
    got: list[Decision] = []
    big = {"model": "llama-3.1-70b", "id": "big", "allowed_tp": [8], "slo_class": "realtime", "wait_s": 60}
    before = {r.id for r in state.ledger.reservations()}
    assert state.enqueue(PlaceBody.model_validate(big), got.append) == "big"
    (item,) = state.queue_view()
    assert item["defrag"]["group"] == "h2/nv0" and sorted(item["defrag"]["frees"]) == H2
    assert [m["placement_id"] for m in item["defrag"]["moves"]] == ["n2i0", "n2i2"]
    assert state.counters.decisions["defrag-plan"] == 1
    state.drain()
    clock.now += 5
    state.drain()
    assert state.counters.decisions["defrag-plan"] == 1  # not again within the interval
    clock.now += 6
    state.drain()
    assert state.counters.decisions["defrag-plan"] == 2
    assert {r.id for r in state.ledger.reservations()} == before and not got  # shown, never booked
    state.release("n2i0")
    state.release("n2i2")  # the operator drained them: the head fits and is served
    assert got and got[0].status == "placed" and state.queue_view() == []
    assert state.head_plan is None


def test_the_head_uses_the_cross_domain_fallback_after_its_class_wait(tmp_path: Path, clock: Clock) -> None:
    state = make_state(tmp_path, clock, (*FRAGMENTED, "n1i1"), budget_gbps=100_000)  # h1 and h2: 4 free each
    got: list[Decision] = []
    body = {"model": "llama-3.1-70b", "id": "big", "allowed_tp": [8], "slo_class": "interactive", "wait_s": 60}
    state.enqueue(PlaceBody.model_validate(body), got.append)
    assert not got and state.queue_view()[0]["defrag"] is not None
    clock.now += 4.9  # interactive waits 5 s for a whole NVLink domain (batch and standard: none)
    state.drain()
    assert not got
    clock.now += 0.2
    state.drain()
    (decision,) = got
    (instance,) = decision.instances
    assert decision.status == "placed" and "cross-domain" in instance.placement.fallbacks
    assert {r.split("/")[0] for r in instance.placement.gpu_refs} == {"h1", "h2"}
    assert state.counters.decisions["cross-domain-fallback"] == 1
    assert '"allow_cross_domain"' not in instance.key  # the request's key is the one the client sent


def test_openapi_documents_the_defrag_routes(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    plan = paths["/v1/defrag"]["post"]["responses"]
    assert {"200", "401", "409", "413", "422", "429", "503"} <= set(plan)
    assert "Retry-After" in plan["429"]["headers"]
    assert plan["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/DefragOut")
    assert {"200", "404", "409", "422"} <= set(paths["/v1/defrag/finish"]["post"]["responses"])


# ------------------------------------------------------------------ disaggregated instances and all or none

PD_SPEC = (
    "name: racks\nnodes:\n"
    "  - name: 'a{i}'\n    count: 2\n    preset: hgx-h100\n    rack: ra\n"
    "  - name: 'b{i}'\n    count: 1\n    preset: hgx-h100\n    rack: rb\n"
)


def on_gpu(state: ServiceState, ref: str) -> str:
    """The request holding GPU ``ref``."""
    return next(p.request_id for p in state.scheduler.placements.values() if ref in p.gpu_refs)


def pd_state(tmp_path: Path, clock: Clock, free_on_a1: int) -> ServiceState:
    """Rack ra (a0, a1) and rb (b0) full of one-GPU requests; then a TP2 prefill and decode instance on
    a0/0-3, a0/4-7 free, ``free_on_a1`` GPUs free on a1 (from a1/7 down) and b0/6-7 free. Freeing a0 for a
    TP8 group takes the two pd instances' moves (freeing a1 or b0 takes at least 4)."""
    spec = tmp_path / "cluster.yaml"
    spec.write_text(PD_SPEC)
    source = SourceRef(kind="cluster", ref=str(spec))
    config = ServiceConfig.model_validate({"state": "memory", "source": source, "auth": False})
    state = ServiceState(config, clock=clock)
    state.open()
    for n in range(24):
        body = {"model": "llama-3.1-8b", "id": f"f{n}", "allowed_tp": [1], "racks": ["ra" if n < 16 else "rb"]}
        assert state.place(PlaceBody.model_validate(body)).status == "placed"
    for g in range(4):
        assert state.release(on_gpu(state, f"a0/{g}"))
    pd = {"model": "llama-3.1-8b", "id": "pd", "allowed_tp": [2], "racks": ["ra"], "pd": {"prefill": 1, "decode": 1}}
    assert state.place(PlaceBody.model_validate(pd)).status == "placed"
    freed = [f"a0/{g}" for g in range(4, 8)] + [f"a1/{7 - g}" for g in range(free_on_a1)] + ["b0/6", "b0/7"]
    for ref in freed:
        assert state.release(on_gpu(state, ref))
    assert {r for p in state.scheduler.placements.values() if p.role for r in p.gpu_refs} == {
        f"a0/{g}" for g in range(4)
    }
    return state


def test_a_pd_instance_moves_within_its_rack_with_the_kv_nics_of_its_new_gpus(tmp_path: Path, clock: Clock) -> None:
    from toposched.solver.pd import kv_nics

    state = pd_state(tmp_path, clock, free_on_a1=4)
    scheduler = state.scheduler
    old = {p.id: p for p in scheduler.placements.values() if p.role}
    with TestClient(create_app(state.config, state)) as client:
        answer = client.post("/v1/defrag", json={"need_gpus": 8, "dry_run": False})
        assert answer.status_code == 200, answer.text
        doc = answer.json()
        assert doc["group"] == "a0/nv0" and sorted(doc["booked"]) == ["pd-decode.m1", "pd-prefill.m1"]
        assert {g for m in doc["moves"] for g in m["to_gpus"]} == {f"a1/{g}" for g in range(4, 8)}  # ra, not b0
        for move in doc["moves"]:
            done = client.post("/v1/defrag/finish", json={k: move[k] for k in ("placement_id", "replacement_id")})
            assert done.status_code == 200, done.text
        placed = client.get("/v1/placements/pd").json()
    nodes = {n.name: n for n in scheduler.cluster.nodes}
    by_id = {i["id"]: i for i in placed["instances"]}
    assert sorted(by_id) == ["pd-decode.m1", "pd-prefill.m1"]
    assert placed["pd"]["pairs"] == {"pd-decode.m1": "pd-prefill.m1"}  # the serving ids
    for pid, instance in by_id.items():
        new = scheduler.placements[pid]
        assert instance["kv_nics"] == list(kv_nics(new, nodes, scheduler.index.dmap))
        assert instance["host_numa"] == [nodes[r.node].gpu(r.gpu).numa_node for r in new.ranks] == [1, 1]
        was = old[pid.removesuffix(".m1")]
        assert instance["kv_nics"] != list(was.kv_nics) and list(was.host_numa) == [0, 0]
        assert new.role == was.role and new.request_id == was.request_id
    assert by_id["pd-decode.m1"]["constraints"][-1]["name"] == "near"
    assert by_id["pd-decode.m1"]["constraints"][-1]["held"]
    assert [s["rack"] for s in placed["stores"]] == []  # no store asked


def test_a_pd_instance_with_room_only_outside_its_rack_is_not_moved(tmp_path: Path, clock: Clock) -> None:
    state = pd_state(tmp_path, clock, free_on_a1=2)  # a1 and b0 hold one TP2 group each: ra has one
    with TestClient(create_app(state.config, state)) as client:
        before = held(client)
        refused = client.post("/v1/defrag", json={"need_gpus": 8, "dry_run": False})
        assert refused.status_code == 409, refused.text
        assert "of a disaggregated instance, which moves only within its rack" in refused.json()["detail"]
        assert held(client) == before


class CrashingLedger(MemoryLedger):
    """Fails the ``nth`` booking of a defrag replacement (``.m`` ids) with ``exc``; ``commit``: after booking it."""

    def __init__(self) -> None:
        super().__init__()
        self.nth, self.exc, self.commit, self.seen = 0, Exception(), False, 0

    def reserve(self, rid: str, gpus: Mapping[str, int], **kw: Any) -> ReserveResult:
        if ".m" in rid:
            self.seen += 1
            if self.seen == self.nth:
                if self.commit:
                    super().reserve(rid, gpus, **kw)
                raise self.exc
        return super().reserve(rid, gpus, **kw)


@pytest.mark.parametrize(
    ("exc", "commit", "status"),
    [(RuntimeError("bug (test)"), False, 500), (StateError("answer lost (test)"), True, 409)],
)
def test_a_failure_while_booking_moves_leaves_no_replacement_booked(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, exc: Exception, commit: bool, status: int
) -> None:
    ledger = CrashingLedger()
    monkeypatch.setattr(state_module, "open_ledger", lambda url, clock: ledger)
    state = make_state(tmp_path, clock)
    before = {r.id for r in ledger.reservations()}
    ledger.nth, ledger.exc, ledger.commit = 2, exc, commit  # the first move books, the second fails
    with TestClient(create_app(state.config, state), raise_server_exceptions=False) as client:
        answer = client.post("/v1/defrag", json={"need_gpus": 8, "dry_run": False})
        assert answer.status_code == status, answer.text
    assert ledger.seen == 2
    assert {r.id for r in ledger.reservations()} == before  # n2i0.m1 was booked, then released
    assert not {p for p in state.scheduler.placements if ".m" in p}
