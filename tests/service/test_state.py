"""ServiceState in-process: whole-GPU bookings, refusal -> resync -> retry, following another replica."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from toposched.errors import InputError
from toposched.ledger import open_ledger
from toposched.ledger.base import ReserveResult
from toposched.ledger.memory import MemoryLedger
from toposched.service import state as state_module
from toposched.service.config import ServiceConfig
from toposched.service.records import Decision
from toposched.service.schemas import PlaceBody
from toposched.service.state import ServiceState
from toposched.topology.sources import SourceRef

HGX = SourceRef(kind="preset", ref="hgx-h100")


def make_state(state: str, **extra: object) -> ServiceState:
    config = ServiceConfig.model_validate({"state": state, "source": HGX, "auth": False, **extra})
    s = ServiceState(config)
    s.open()
    return s


def body(rid: str, **fields: object) -> PlaceBody:
    return PlaceBody.model_validate({"model": "llama-3.1-8b", "id": rid, **fields})


def test_a_booking_takes_the_whole_gpu_and_keeps_the_plan_in_meta(tmp_path: Path) -> None:
    url = f"sqlite:{tmp_path / 's.db'}"
    state = make_state(url)
    try:
        decision = state.place(body("a"))
        assert decision.status == "placed"
        (instance,) = decision.instances
        ledger = open_ledger(url)
        held = ledger.get("a")
        assert held is not None
        (ref,) = held.gpus
        account = ledger.accounts()[ref]
        assert account.reserved_bytes == account.capacity_bytes  # whole GPU: no second booking fits
        assert int(held.meta["hbm_bytes"]) == instance.placement.hbm_per_gpu.total
        assert held.meta["request_id"] == "a" and "placement" in held.meta
        ledger.close()
    finally:
        state.close()


def test_a_replica_with_a_stale_index_is_refused_resyncs_and_picks_other_gpus(tmp_path: Path) -> None:
    url = f"sqlite:{tmp_path / 's.db'}"
    one, two = make_state(url, replica="one"), make_state(url, replica="two")
    try:
        first = one.place(body("x", allowed_tp=[4]))
        assert first.status == "placed"
        # "two" decides without looking at the audit log first: its index still says all 8 GPUs are free
        second = two._place(body("y", allowed_tp=[4]), "y")
        assert second.status == "placed"
        assert two.counters.ledger_refusals >= 1
        gpus_x = set(first.instances[0].placement.gpu_refs)
        gpus_y = set(second.instances[0].placement.gpu_refs)
        assert gpus_x.isdisjoint(gpus_y)
        third = two.place(body("z", allowed_tp=[2]))
        assert third.status == "no-capacity"
        # "two" knows "x" (adopted from the ledger) and may release it
        assert two.release("x") == ["x"]
        one.follow()
        assert "x" not in one.instances and len(one.scheduler.index.free) == 4
    finally:
        one.close()
        two.close()


def test_same_id_on_another_replica_is_the_same_placement(tmp_path: Path) -> None:
    url = f"sqlite:{tmp_path / 's.db'}"
    one, two = make_state(url, replica="one"), make_state(url, replica="two")
    try:
        first = one.place(body("same", allowed_tp=[2]))
        again = two.place(body("same", allowed_tp=[2]))
        assert again.status == "existing"
        assert again.instances[0].placement.gpu_refs == first.instances[0].placement.gpu_refs
        other = two.place(body("same", allowed_tp=[4]))
        assert other.status == "conflict"
    finally:
        one.close()
        two.close()


def test_expired_lease_frees_the_gpus_on_the_next_sync() -> None:
    now = [1000.0]
    state = ServiceState(ServiceConfig(state="memory", source=HGX, auth=False), ledger_clock=lambda: now[0])
    state.open()
    decision = state.place(body("short", ttl_s=5))
    assert decision.status == "placed" and decision.instances[0].expires_at is not None
    assert len(state.scheduler.index.free) == 7
    now[0] += 6
    state.resync()
    assert "short" not in state.instances and len(state.scheduler.index.free) == 8
    state.close()


def test_too_many_replicas_is_an_input_error() -> None:
    state = ServiceState(ServiceConfig(state="memory", source=HGX, auth=False, max_replicas=2))
    state.open()
    with pytest.raises(InputError, match="at most 2"):
        state.place(body("many", replicas=3))
    state.close()


def test_no_topology_anywhere_is_an_input_error(tmp_path: Path) -> None:
    state = ServiceState(ServiceConfig(state=f"sqlite:{tmp_path / 'empty.db'}", auth=False))
    with pytest.raises(InputError, match="no topology"):
        state.open()


def test_a_cold_replica_takes_the_stored_domain_map(tmp_path: Path) -> None:
    url = f"sqlite:{tmp_path / 's.db'}"
    first = make_state(url)
    first.close()
    cold = ServiceState(ServiceConfig(state=url, auth=False))
    cold.open()
    assert cold.topology is not None and cold.topology.source == HGX
    assert len(cold.scheduler.index.info) == 8
    cold.close()


class RefusingLedger(MemoryLedger):
    """A memory ledger that refuses every booking of one placement id (another holder, every time)."""

    def __init__(self, refuse: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.refuse = refuse

    def reserve(self, rid: str, gpus: Mapping[str, int], **kw: Any) -> ReserveResult:
        if rid == self.refuse:
            return ReserveResult(status="conflict", reasons={"request": f"{rid} is held elsewhere (test)"})
        return super().reserve(rid, gpus, **kw)


def test_no_capacity_after_the_retries_leaves_nothing_booked(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = RefusingLedger("r-1")
    monkeypatch.setattr(state_module, "open_ledger", lambda url, clock: ledger)
    state = make_state("memory", commit_retries=3)
    try:
        decision = state.place(body("r", replicas=3, allowed_tp=[2]))
        assert decision.status == "no-capacity" and decision.instances == ()
        assert state.counters.ledger_refusals == 3
        assert [r.id for r in ledger.reservations()] == []  # replica 0 was booked on each try, then released
        assert state.group("r") == [] and state.scheduler.placements == {}
        assert len(state.scheduler.index.free) == 8
        other = state.place(body("s", replicas=2, allowed_tp=[4]))  # the GPUs really are free again
        assert other.status == "placed"
    finally:
        state.close()


def test_a_release_after_refusals_keeps_another_requests_bookings(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = RefusingLedger("r-1")
    monkeypatch.setattr(state_module, "open_ledger", lambda url, clock: ledger)
    state = make_state("memory", commit_retries=2)
    try:
        kept = state.place(body("keep", allowed_tp=[2]))
        assert kept.status == "placed"
        assert state.place(body("r", replicas=2, allowed_tp=[2])).status == "no-capacity"
        assert [r.id for r in ledger.reservations()] == ["keep"]
    finally:
        state.close()


def test_same_fields_different_ids_each_answer_carries_its_own_id() -> None:
    state = make_state("memory")
    try:
        first, second = state.place(body("one", allowed_tp=[2])), state.place(body("two", allowed_tp=[2]))
        for decision, rid in ((first, "one"), (second, "two")):
            assert decision.status == "placed" and decision.request_id == rid
            (instance,) = decision.instances
            assert instance.request_id == rid and instance.placement.request_id == rid
            assert state.ledger.get(rid) is not None and state.ledger.get(rid).meta["request_id"] == rid  # type: ignore[union-attr]
    finally:
        state.close()


def test_exact_through_the_service_on_a_small_preset() -> None:
    state = make_state("memory", policy="exact")
    try:
        decision = state.place(body("e", replicas=2, allowed_tp=[4]))
        assert decision.status == "placed"
        placements = [i.placement for i in decision.instances]
        assert [p.policy for p in placements] == ["exact", "exact"]
        assert all(c.held for p in placements for c in p.constraints if c.name != "slo")
        assert set(placements[0].gpu_refs).isdisjoint(placements[1].gpu_refs)
        assert state.place(body("f", allowed_tp=[2])).status == "no-capacity"
        assert state.release("e") == ["e-0", "e-1"]
        assert len(state.scheduler.index.free) == 8
    finally:
        state.close()


def test_exact_is_refused_on_a_cluster_above_its_limit() -> None:
    big = SourceRef(kind="preset", ref="cluster-32x-hgx-h100")
    config = ServiceConfig.model_validate({"state": "memory", "source": big, "auth": False, "policy": "exact"})
    with pytest.raises(InputError, match="256 GPUs; exact handles at most 128") as info:
        ServiceState(config).open()
    assert info.value.fix is not None and "slo" in info.value.fix
    state = make_state("memory", source=big)
    try:  # a request that names exact is refused the same way on a large cluster
        with pytest.raises(InputError, match="at most 128"):
            state.place(body("x", policy="exact"))
        assert state.scheduler.placements == {}
    finally:
        state.close()


def test_a_queued_request_that_became_invalid_is_rejected_and_the_queue_goes_on() -> None:
    state = make_state("memory")
    try:
        assert state.place(body("a", allowed_tp=[8])).status == "placed"
        answers: list[Decision] = []
        near_a = body("b", allowed_tp=[2], near="a", near_required=True)
        assert state.enqueue(near_a, answers.append) == "b"
        assert state.enqueue(body("c", allowed_tp=[2]), answers.append) == "c"
        assert answers == []  # both wait: the cluster is full
        assert state.release("a") == ["a"]  # "b" can no longer be near "a"
        assert [(d.request_id, d.status) for d in answers] == [("b", "rejected"), ("c", "placed")]
        assert "near" in answers[0].reasons[0] and len(state.queue) == 0
        assert state.sync() and state.last_error is None
    finally:
        state.close()


def test_background_sync_parses_the_stored_topology_only_when_a_newer_version_exists(tmp_path: Path) -> None:
    """Issue 17: the tick compares version numbers; parsing the stored DomainMap happens only on change."""
    url = f"sqlite:{tmp_path / 's.db'}"
    state = make_state(url)
    other = make_state(url)  # another replica on the same state
    try:
        store = state._store
        assert store is not None and state.topology is not None
        parsed: list[int] = []
        real_latest = store.latest

        def counting_latest() -> Any:
            parsed.append(1)
            return real_latest()

        store.latest = counting_latest  # type: ignore[method-assign]
        for _ in range(3):
            assert state.sync()
        assert parsed == []  # nothing changed: no DomainMap parsed
        before = state.topology.version
        assert other.topology is not None
        other._save(other.topology.cluster, other.topology.source)  # a newer stored version
        assert state.sync()
        assert parsed == [1] and state.topology.version > before
        assert state.sync() and parsed == [1]
    finally:
        state.close()
        other.close()


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_own_changes_do_not_trigger_a_resync_and_another_replicas_do(store: str, tmp_path: Path) -> None:
    """Issue 17: after the background sync's full resync, the next ``follow`` must not take this replica's
    own bookings, renewals and releases for another replica's (it used to resync a second time)."""
    url = "memory" if store == "memory" else f"sqlite:{tmp_path / 's.db'}"
    one = make_state(url, replica="one")
    two = make_state(url, replica="two") if store == "sqlite" else None
    try:
        assert one.place(body("a", ttl_s=60)).status == "placed"
        assert one.renew("a", 120) is not None
        assert one.place(body("b")).status == "placed"
        assert one.release("b") == ["b"]
        assert one.sync()  # the background tick: one full resync
        resyncs = one.counters.resyncs
        assert one.follow() is False  # its own reserve, renew and releases: nothing to learn
        assert one.place(body("c")).status == "placed"  # a decision follows the log first
        assert one.follow() is False
        assert one.counters.resyncs == resyncs
        if two is not None:  # a change by another replica still triggers one
            assert two.place(body("d")).status == "placed"
            assert one.follow() is True
            assert one.counters.resyncs == resyncs + 1 and "d" in one.instances
            assert one.follow() is False
    finally:
        one.close()
        if two is not None:
            two.close()


def test_instance_table_keeps_its_request_index_in_step() -> None:
    """Issue 17: a request's instances come from an index, not a scan; every way of changing the table
    keeps the index right (compared with a scan after a random sequence of changes)."""
    import random

    from toposched.service.records import Instance, InstanceTable

    state = make_state("memory")
    decision = state.place(body("seed"))
    template = decision.instances[0]
    table = InstanceTable()
    rng = random.Random(7)
    for step in range(2000):
        pid = f"p{rng.randrange(40)}"
        roll = rng.random()
        if roll < 0.5:
            table[pid] = Instance(**{**template.__dict__, "request_id": f"r{rng.randrange(8)}"})
        elif roll < 0.75:
            table.pop(pid, None)
        elif roll < 0.9 and pid in table:
            del table[pid]
        elif roll < 0.91:
            table.clear()
        for rid in (f"r{k}" for k in range(8)):
            scan = sorted(p for p, i in table.items() if i.request_id == rid)
            assert sorted(id(i) for i in table.of_request(rid)) == sorted(id(table[p]) for p in scan), step
    with pytest.raises(KeyError):
        table.pop("absent")


def test_the_service_profile_reaches_inline_calls_and_the_worker_thread() -> None:
    """A ServiceState built with a profile predicts with it wherever its work runs (issue 16)."""
    from toposched.perf.coefficients import PerfConfig
    from toposched.perf.profile import Profile, ProfileEntry, active_config

    slow = Profile(entries=(ProfileEntry(config=PerfConfig(step_overhead_ms=50.0)),))
    config = ServiceConfig.model_validate({"state": "memory", "source": HGX, "auth": False, "profile": slow})
    state = ServiceState(config)
    try:
        assert state.call(active_config, "H100-SXM", "bf16").step_overhead_ms == 50.0  # inline (memory state)
        assert state.worker.submit(active_config, "H100-SXM", "bf16").result().step_overhead_ms == 50.0
        assert active_config("H100-SXM", "bf16").step_overhead_ms != 50.0  # nothing leaked to this thread
    finally:
        state.worker.shutdown()


def test_the_tick_follows_the_log_and_reads_every_reservation_only_when_a_full_resync_is_due(
    tmp_path: Path,
) -> None:
    """Issue 17: a tick with nothing changed reads only the audit log; another replica's change and an
    expired lease still reach the next tick, and the safety net reads everything every resync_interval_s."""
    url = f"sqlite:{tmp_path / 's.db'}"
    now, ledger_now = [0.0], [1000.0]
    config = ServiceConfig(state=url, source=HGX, auth=False, replica="one", resync_interval_s=30)
    one = ServiceState(config, clock=lambda: now[0], ledger_clock=lambda: ledger_now[0])
    one.open()
    two = ServiceState(config.model_copy(update={"replica": "two"}), ledger_clock=lambda: ledger_now[0])
    two.open()
    reads: list[int] = []
    real = one.ledger.reservations

    def counting() -> list[Any]:
        reads.append(1)
        return real()

    one.ledger.reservations = counting  # type: ignore[method-assign]
    try:
        assert one.place(body("own", ttl_s=60)).status == "placed"
        for _ in range(3):
            now[0] += 1
            assert one.sync()
        assert reads == []  # its own booking and nothing else: no full read
        assert two.place(body("other", allowed_tp=[2])).status == "placed"
        now[0] += 1
        assert one.sync() and "other" in one.instances and len(one.scheduler.index.free) == 5
        assert len(reads) == 1  # the foreign entry made it read once
        ledger_now[0] += 61  # the lease of "own" runs out: reading the log logs its expiry
        now[0] += 1
        assert one.sync() and "own" not in one.instances and len(one.scheduler.index.free) == 6
        assert len(reads) == 2
        now[0] += 29
        assert one.sync() and len(reads) == 2
        now[0] += 1  # 30 s since the last full read: the safety net
        assert one.sync() and len(reads) == 3
        now[0] += 1
        assert one.sync() and len(reads) == 3
    finally:
        one.close()
        two.close()


def test_a_replica_learns_an_id_released_and_booked_again_by_another_replica(tmp_path: Path) -> None:
    """``one`` places x; ``two`` releases x, places y (on x's GPU) and places x again with another body (on
    another GPU). ``one`` must see the new booking of x, not keep its old one, and releasing it works."""
    url = f"sqlite:{tmp_path / 's.db'}"
    one, two = make_state(url, replica="one"), make_state(url, replica="two")
    try:
        first = one.place(body("x"))
        (old_gpu,) = first.instances[0].placement.gpu_refs
        two.follow()
        assert two.release("x") == ["x"]
        assert two.place(body("y")).status == "placed"
        again = two.place(body("x", slo_class="batch"))
        (new_gpu,) = again.instances[0].placement.gpu_refs
        assert new_gpu != old_gpu
        one.resync()
        (seen,) = one.lookup("x")
        assert seen.placement.gpu_refs == (new_gpu,) and seen.body["slo_class"] == "batch"
        assert two.release("y") == ["y"]
        assert one.release("x") == ["x"]  # was a 500: the stale copy's GPU was free already
        assert open_ledger(url).reservations() == []
    finally:
        one.close()
        two.close()


def test_the_same_id_with_another_body_booked_at_once_by_two_replicas_is_a_conflict(tmp_path: Path) -> None:
    """Both replicas decide x before either sees the other's booking and pick the same GPU: the ledger's
    ``already_held`` for the same id on the same GPUs is not the second body's, so it answers a conflict."""
    url = f"sqlite:{tmp_path / 's.db'}"
    one, two = make_state(url, replica="one"), make_state(url, replica="two")
    try:
        assert one.place(body("x")).status == "placed"
        second = two._place(body("x", slo_class="batch"), "x")  # decides without following the log first
        assert second.status == "conflict", second
        (held,) = open_ledger(url).reservations()
        assert '"slo_class":"batch"' not in held.meta["request"]
    finally:
        one.close()
        two.close()


def test_a_lookup_of_an_unknown_id_follows_the_log_instead_of_reading_everything(tmp_path: Path) -> None:
    """A ``GET`` of an id this replica does not know reads the audit log since its last look: an id nobody
    placed costs no full read (any reader could otherwise make the replica read every reservation at will),
    and one another replica placed is found."""
    url = f"sqlite:{tmp_path / 's.db'}"
    one, two = make_state(url, replica="one"), make_state(url, replica="two")
    try:
        assert one.place(body("mine")).status == "placed"
        before = two.counters.resyncs
        assert two.lookup("nobody") == [] and two.lookup("nobody-either") == []
        assert two.counters.resyncs == before + 1  # the first look saw one's booking: one rebuild, then none
        assert two.place(body("theirs")).status == "placed"
        (found,) = one.lookup("theirs")
        assert found.placement.id == "theirs"
        resyncs = one.counters.resyncs
        assert [one.lookup(f"random-{i}") for i in range(5)] == [[]] * 5
        assert one.counters.resyncs == resyncs
    finally:
        one.close()
        two.close()


def test_a_lookup_sees_another_replicas_release_at_once(tmp_path: Path) -> None:
    """GET by id reads the log first, as a list does: a placement released through another replica is gone
    from this one's answer without waiting for the background tick."""
    url = f"sqlite:{tmp_path / 's.db'}"
    one, two = make_state(url, replica="one"), make_state(url, replica="two")
    try:
        assert one.place(body("x")).status == "placed"
        assert [i.placement.id for i in two.lookup("x")] == ["x"]
        assert one.release("x") == ["x"]
        assert two.lookup("x") == []
        assert one.place(body("x", slo_class="batch")).status == "placed"  # booked again, another body
        (again,) = two.lookup("x")
        assert again.body["slo_class"] == "batch"
    finally:
        one.close()
        two.close()
