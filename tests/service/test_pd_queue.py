"""A disaggregated request (``pd``) in the admission queue: all or none, in fair order, never held for headroom.

In-process, on the cluster of ``test_pd_api.py`` (two racks of one HGX H100 node each, 16 GPUs): the
request asks for one TP2 prefill and two TP2 decode instances (6 GPUs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.service.test_faults import FaultyLedger
from tests.service.test_pd_api import BODY, make_state
from toposched.errors import StateError
from toposched.ledger.memory import MemoryLedger
from toposched.service import state as state_module
from toposched.service.app import create_app
from toposched.service.records import Decision
from toposched.service.schemas import PlaceBody
from toposched.service.state import ServiceState

PD_IDS = {"pd-prefill", "pd-decode-0", "pd-decode-1"}


def fill(state: ServiceState, count: int, rack: str | None = None, start: int = 0) -> list[str]:
    """``count`` one-GPU requests ``f{start}`` ... (in ``rack`` when given); their ids."""
    ids = [f"f{n}" for n in range(start, start + count)]
    for rid in ids:
        where = {"racks": [rack]} if rack else {}
        body = PlaceBody.model_validate({"id": rid, "model": "llama-3.1-8b", "allowed_tp": [1], **where})
        assert state.place(body).status == "placed"
    return ids


def held(state: ServiceState) -> set[str]:
    return {r.id for r in state.ledger.reservations()}


def test_a_waiting_pd_request_is_booked_whole_when_room_frees_and_nothing_overtakes_it(tmp_path: Path) -> None:
    state = make_state(tmp_path)
    try:
        fillers = fill(state, 14)  # 2 GPUs free: the prefill instance would fit, the decode instances not
        got: list[Decision] = []
        assert state.enqueue(PlaceBody.model_validate({**BODY, "wait_s": 30}), got.append) == "pd"
        small: list[Decision] = []
        plain = {"id": "small", "model": "llama-3.1-8b", "allowed_tp": [1], "wait_s": 30}
        assert state.enqueue(PlaceBody.model_validate(plain), small.append) == "small"
        head, behind = state.queue_view()
        assert (head["id"], head["gpus"]) == ("pd", 6)  # the queue's cost: every instance's GPUs
        assert (behind["id"], behind["gpus"]) == ("small", 1)
        assert not got and not small  # the small one fits, but does not overtake the head
        assert held(state) == set(fillers)  # nothing of the waiting request is booked
        for rid in fillers[:3]:
            state.release(rid)
        assert not got  # 5 free: still not room for all three instances
        state.release(fillers[3])
        (decision,) = got
        assert decision.status == "placed"
        assert [i.placement.id for i in decision.instances] == ["pd-prefill", "pd-decode-0", "pd-decode-1"]
        assert [i.placement.role for i in decision.instances] == ["prefill", "decode", "decode"]
        assert all(i.placement.kv_nics for i in decision.instances)
        assert {i.pair for i in decision.instances[1:]} == {"pd-prefill"}
        assert held(state) >= PD_IDS and state.group("pd")
        assert not small  # the head took the 6 GPUs freed
        state.release(fillers[4])
        assert small and small[0].status == "placed"  # served next, in order
        assert state.queue_view() == []
    finally:
        state.close()


def test_a_pd_request_that_waits_out_its_wait_s_gets_409_and_books_nothing(tmp_path: Path) -> None:
    state = make_state(tmp_path)
    fillers = set(fill(state, 14))
    with TestClient(create_app(state.config, state)) as client:
        answer = client.post("/v1/placements", json={**BODY, "wait_s": 0.2})
        assert answer.status_code == 409, answer.text
        assert answer.json() == {
            "id": "pd",
            "status": "no-capacity",
            "reasons": ["waited 0.2 s in the admission queue"],
        }
        assert client.get("/v1/queue").json() == {"depth": 0, "items": []}
        assert held(state) == fillers
        assert state.counters.decisions["queue-timeout"] == 1


def test_a_pd_request_is_never_held_for_headroom(tmp_path: Path) -> None:
    """With the headroom on, a plain request that would break the last wholly free node is held; a pd
    request of the same GPUs is placed at once."""
    state = make_state(tmp_path, keep_whole_domains=1, keep_whole_wait_s=30)
    with TestClient(create_app(state.config, state)) as client:
        half = {"id": "half", "model": "llama-3.1-8b", "allowed_tp": [1], "replicas": 4, "racks": ["ra"]}
        assert client.post("/v1/placements", json=half).status_code == 201  # a0: 4 free; b0: wholly free
        plain = {"id": "plain", "model": "llama-3.1-8b", "allowed_tp": [2], "replicas": 3, "wait_s": 0.2}
        held_plain = client.post("/v1/placements", json=plain)  # held for headroom, then out of time
        assert held_plain.status_code == 409, held_plain.text
        assert state.counters.decisions["held-for-headroom"] == 1
        assert state.headroom_hold_s(PlaceBody.model_validate({**BODY, "wait_s": 30}), 30) == 0.0
        placed = client.post("/v1/placements", json={**BODY, "wait_s": 30})
        assert placed.status_code == 201, placed.text
        assert state.counters.decisions["held-for-headroom"] == 1  # not again
        b0 = {r["gpu"] for r in placed.json()["ranks"] if r["node"].startswith("b")}
        assert b0  # it broke the wholly free node the headroom keeps for plain requests


def test_a_store_failure_while_the_queue_books_it_leaves_nothing_booked_and_it_keeps_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faulty = FaultyLedger(MemoryLedger())
    monkeypatch.setattr(state_module, "open_ledger", lambda url, clock: faulty)
    state = make_state(tmp_path, "memory")
    try:
        fillers = [*fill(state, 8, "ra"), *fill(state, 3, "rb", start=8)]  # b0: 5 free, one short
        got: list[Decision] = []
        state.enqueue(PlaceBody.model_validate({**BODY, "wait_s": 30}), got.append)
        assert not got
        faulty.fail("reserve", StateError("store down (test)"), after=1)  # the prefill books, a decode fails
        # the release frees room on b0 and succeeds; the queue's booking of the request then fails (logged)
        assert state.release("f8")
        assert held(state) == set(fillers) - {"f8"}  # what it booked was released: all or none
        assert not got and [i["id"] for i in state.queue_view()] == ["pd"]
        faulty.heal()
        state.drain()
        (decision,) = got
        assert decision.status == "placed" and held(state) == {*fillers, *PD_IDS} - {"f8"}
    finally:
        state.close()


def test_a_pd_head_without_room_for_its_tp_group_gets_a_defrag_plan(tmp_path: Path) -> None:
    state = make_state(tmp_path)
    try:
        fill(state, 6, "ra")
        fill(state, 5, "rb", start=6)  # 2 free on a0, 3 on b0: no node holds a TP4 group
        body = {**BODY, "allowed_tp": [4], "pd": {"prefill": 1, "decode": 1}, "wait_s": 30}
        state.enqueue(PlaceBody.model_validate(body), lambda _d: None)
        (item,) = state.queue_view()
        assert item["gpus"] == 8
        plan = item["defrag"]
        assert plan["need_gpus"] == 4 and len(plan["moves"]) == 1 and len(plan["frees"]) == 4
        assert state.counters.decisions["defrag-plan"] == 1
    finally:
        state.close()
