"""The service's headroom (``ServiceConfig.keep_whole_domains``): waiting requests keep a whole NVLink domain.

In-process (a memory ledger, a fake clock) on 3 x HGX H100: h0 and h1 are full, h2 is the last wholly free
domain. A TP1 request that may wait is held instead of breaking h2; a TP8 request behind it is served
first; the hold ends after ``keep_whole_wait_s`` (at most half the request's ``wait_s``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from toposched.service.app import create_app
from toposched.service.config import ServiceConfig
from toposched.service.records import Decision
from toposched.service.schemas import PlaceBody
from toposched.service.state import ServiceState
from toposched.topology.sources import SourceRef

SPEC = "name: three\nnodes:\n  - name: 'h{i}'\n    count: 3\n    preset: hgx-h100\n"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_state(tmp_path: Path, clock: Clock, *, full: int = 2, **extra: Any) -> ServiceState:
    """The cluster with its first ``full`` nodes taken by one TP8 instance each."""
    spec = tmp_path / "cluster.yaml"
    spec.write_text(SPEC)
    source = SourceRef(kind="cluster", ref=str(spec))
    config = ServiceConfig.model_validate({"state": "memory", "source": source, "auth": False, **extra})
    state = ServiceState(config, clock=clock)
    state.open()
    for n in range(full):
        body = PlaceBody.model_validate({"model": "llama-3.1-70b", "id": f"full{n}", "allowed_tp": [8]})
        assert state.place(body).status == "placed"
    return state


def small(rid: str, wait_s: float = 60.0) -> PlaceBody:
    return PlaceBody.model_validate({"model": "llama-3.1-8b", "id": rid, "allowed_tp": [1], "wait_s": wait_s})


def enqueue_like_the_api(state: ServiceState, body: PlaceBody, got: list[Decision]) -> Decision | None:
    """What ``POST /v1/placements`` does: decide now with the headroom, queue when that finds no capacity."""
    hold_s = state.headroom_hold_s(body, body.wait_s)
    decision = state.place(body, headroom=state.config.keep_whole_domains if hold_s else 0)
    if decision.status != "no-capacity":
        return decision
    state.enqueue(body, got.append, hold_s)
    return None


def nodes_of(decision: Decision) -> set[str]:
    return {ref.split("/")[0] for i in decision.instances for ref in i.placement.gpu_refs}


def test_a_small_request_is_held_off_the_last_whole_domain_and_a_whole_domain_request_overtakes(
    tmp_path: Path,
) -> None:
    clock = Clock()
    state = make_state(tmp_path, clock, keep_whole_domains=1)
    got: list[Decision] = []
    assert enqueue_like_the_api(state, small("tp1"), got) is None
    (item,) = state.queue_view()
    assert item["held_for_headroom"] is True and item["headroom_left_s"] == 30.0 and "defrag" not in item
    assert state.counters.decisions["held-for-headroom"] == 1
    big = PlaceBody.model_validate({"model": "llama-3.1-70b", "id": "big", "allowed_tp": [8], "wait_s": 60})
    state.enqueue(big, got.append, state.headroom_hold_s(big, big.wait_s))  # the queue is not empty: it queues
    (served,) = got
    assert served.request_id == "big" and served.status == "placed" and nodes_of(served) == {"h2"}
    assert [i["id"] for i in state.queue_view()] == ["tp1"]  # the held head still waits, now for any room
    state.release("full0")  # h0 is now the last wholly free domain: still held
    assert len(got) == 1
    four = PlaceBody.model_validate({"model": "llama-3.1-8b", "id": "four", "allowed_tp": [4]})
    assert state.place(four).status == "placed"  # h0 partly used now
    state.drain()
    (_, placed) = got
    assert placed.request_id == "tp1" and placed.status == "placed" and nodes_of(placed) == {"h0"}
    assert state.counters.decisions["held-for-headroom"] == 1  # counted once per request


def test_the_hold_ends_after_keep_whole_wait_s_or_half_the_wait(tmp_path: Path) -> None:
    clock = Clock()
    state = make_state(tmp_path, clock, keep_whole_domains=1, keep_whole_wait_s=30)
    got: list[Decision] = []
    assert enqueue_like_the_api(state, small("a", wait_s=20), got) is None  # held for min(30, 20 / 2) = 10 s
    assert state.queue_view()[0]["headroom_left_s"] == 10.0
    clock.now += 9.9
    state.drain()
    assert not got
    clock.now += 0.2
    state.drain()
    (decision,) = got
    assert decision.status == "placed" and nodes_of(decision) == {"h2"}


def test_no_headroom_for_a_request_that_does_not_wait_nor_by_default(tmp_path: Path) -> None:
    clock = Clock()
    state = make_state(tmp_path, clock, keep_whole_domains=1)
    got: list[Decision] = []
    now = enqueue_like_the_api(state, small("now", wait_s=0), got)
    assert now is not None and now.status == "placed" and nodes_of(now) == {"h2"}
    (tmp_path / "d").mkdir()
    default = make_state(tmp_path / "d", clock)
    assert default.config.keep_whole_domains == 0
    placed = enqueue_like_the_api(default, small("waits"), got)
    assert placed is not None and placed.status == "placed" and not got


def test_two_whole_domains_left_are_not_held(tmp_path: Path) -> None:
    clock = Clock()
    state = make_state(tmp_path, clock, full=1, keep_whole_domains=1)
    got: list[Decision] = []
    placed = enqueue_like_the_api(state, small("tp1"), got)
    assert placed is not None and placed.status == "placed" and state.counters.decisions["held-for-headroom"] == 0


def test_over_http_a_held_request_answers_no_capacity_when_its_wait_ends(tmp_path: Path) -> None:
    clock = Clock()  # frozen: the hold (0.25 s of the fake clock) never ends, the real wait_s does
    state = make_state(tmp_path, clock, keep_whole_domains=1)
    with TestClient(create_app(state.config, state)) as client:
        answer = client.post("/v1/placements", json={"model": "llama-3.1-8b", "allowed_tp": [1], "wait_s": 0.5})
        assert answer.status_code == 409, answer.text
        assert "waited 0.5 s in the admission queue" in answer.text
        assert 'toposched_decisions_total{outcome="held-for-headroom"} 1.0' in client.get("/metrics").text
        assert client.get("/v1/queue").json()["depth"] == 0
        now = client.post("/v1/placements", json={"model": "llama-3.1-8b", "allowed_tp": [1]})
        assert now.status_code == 201, now.text  # wait_s 0: no headroom


def test_serve_takes_the_headroom_flags() -> None:
    from typer.testing import CliRunner

    from toposched.cli.main import app

    out = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert "--keep-whole-domains" in out.output and "--keep-whole-wait" in out.output


def test_a_waiter_served_behind_a_held_head_is_answered_even_if_a_later_decision_fails(tmp_path: Path) -> None:
    """_overtake books "big" behind the held head, then deciding "boom" fails (the store is down): "big" is
    still answered (its booking is not lost), and the release that triggered the drain succeeds."""
    from toposched.errors import StateError

    state = make_state(tmp_path, Clock(), full=3, keep_whole_domains=1)
    got: list[Decision] = []
    for body in (
        small("tp1"),
        PlaceBody.model_validate({"model": "llama-3.1-70b", "id": "big", "allowed_tp": [8], "wait_s": 60}),
        small("boom"),
    ):
        assert enqueue_like_the_api(state, body, got) is None
    real = state._place

    def flaky(body: Any, rid: str, **kw: Any) -> Decision:
        if rid == "boom":
            raise StateError("etcd at http://x: connection refused", fix="start etcd")
        return real(body, rid, **kw)

    state._place = flaky  # type: ignore[method-assign]
    assert state.release("full2")  # frees h2: the held tp1 stays held, big overtakes, boom's decision fails
    assert [(d.request_id, d.status) for d in got] == [("big", "placed")]
    assert state.cancel("big") is False  # answered: the API returns that answer, it does not wait forever
    assert sorted(state.waiting) == ["boom", "tp1"] and [i["id"] for i in state.queue_view()] == ["tp1", "boom"]


def test_a_waiter_the_sync_expires_is_answered_and_a_late_cancel_says_so(tmp_path: Path) -> None:
    clock = Clock()
    state = make_state(tmp_path, clock, full=3)
    got: list[Decision] = []
    assert enqueue_like_the_api(state, small("w", wait_s=60), got) is None
    clock.now = 61.5  # its client's wait ended; its cancel is still behind other work
    assert state.sync()
    (answer,) = got
    assert answer.status == "no-capacity" and "waited more than 60 s" in answer.reasons[0]
    assert "w" not in state.waiting and state.cancel("w") is False


def test_a_store_failure_while_serving_the_queue_does_not_fail_the_enqueue(tmp_path: Path) -> None:
    """The request is queued before the queue is served; a failure then is logged and the next drain
    answers it (the client, told nothing went wrong, is still waiting for that answer)."""
    from toposched.errors import StateError

    state = make_state(tmp_path, Clock(), full=2)
    got: list[Decision] = []
    body = small("v")
    real, calls = state._place, {"n": 0}

    def once(body: Any, rid: str, **kw: Any) -> Decision:
        calls["n"] += 1
        if calls["n"] == 1:
            raise StateError("etcd: connection reset", fix="retry")
        return real(body, rid, **kw)

    state._place = once  # type: ignore[method-assign]
    assert state.enqueue(body, got.append) == "v"  # the drain inside failed: logged, not raised
    assert not got and "v" in state.waiting
    state.drain()
    assert [(d.request_id, d.status) for d in got] == [("v", "placed")]
