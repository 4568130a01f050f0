"""Defragmentation by migration (``solver/defrag.py``): fewest moves, purity, execution, limits."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toposched.errors import LedgerConflict, StateError
from toposched.sim.loading import load_cluster
from toposched.solver.defrag import (
    MOVED_FROM,
    DefragLimiter,
    Move,
    finish_move,
    plan_defrag,
    replacement_id,
    search_defrag,
    start_move,
)
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler

LAYOUT = (2, 2, 2, 1, 1)  # TP degrees placed on each node, in order: 0-1, 2-3, 4-5, 6, 7


def filled(released: tuple[str, ...] = ()) -> Scheduler:
    """4 x HGX H100, each node filled by TP2, TP2, TP2, TP1, TP1 instances ``n{node}i{k}``, then ``released`` go."""
    s = Scheduler(load_cluster("4xhgx-h100"))
    for n in range(4):
        for k, tp in enumerate(LAYOUT):
            outcome = s.place(PlacementRequest(id=f"n{n}i{k}", model="llama-3.1-8b", allowed_tp=(tp,)))
            assert outcome.placements and not outcome.unplaced
    for pid in released:
        assert s.release(pid)
    return s


# node 0: 2 free (4 moves), node 1: 2 free (3 moves of 6 GPUs), node 2: 2 free (4 moves),
# node 3: 3 free (3 moves of 5 GPUs): 9 free GPUs in all, no node with 8
FRAGMENTED = ("n0i0", "n1i3", "n1i4", "n2i1", "n3i3", "n3i0")


def snapshot(s: Scheduler) -> tuple[Any, ...]:
    levels = {
        name: (list(lv.free_count), [dict(b) for b in lv.buckets], [dict(b) for b in lv.whole])
        for name, lv in s.index.levels.items()
    }
    return (dict(s.placements), set(s.index.free), s.ledger.accounts(), dict(s.cross_used), levels)


def node_gpus(node: str) -> set[str]:
    return {f"{node}/{i}" for i in range(8)}


def test_the_plan_frees_one_node_with_the_fewest_moves_then_the_fewest_gpus_moved() -> None:
    s = filled(FRAGMENTED)
    plan = plan_defrag(s, 8)
    assert plan is not None
    # nodes 1 and 3 both need 3 moves; node 3's move 5 GPUs, node 1's 6
    assert [m.placement_id for m in plan.moves] == ["n3i1", "n3i2", "n3i4"]
    assert plan.gpus_moved == 5 and plan.group == s.index.dmap.gpu_domain["hgx-h100-3/0"]
    assert set(plan.frees) == node_gpus("hgx-h100-3")
    targets = [r for m in plan.moves for r in m.to_gpus]
    assert len(targets) == len(set(targets)) and not set(targets) & node_gpus("hgx-h100-3")
    assert set(targets) <= s.index.free
    for m in plan.moves:
        assert m.replacement_id == f"{m.placement_id}.m1"
        assert m.from_gpus == s.placements[m.placement_id].gpu_refs
        assert len({r.split("/")[0] for r in m.to_gpus}) == 1  # each TP group inside one NVLink domain


def test_planning_leaves_the_scheduler_exactly_as_it_was() -> None:
    s = filled(FRAGMENTED)
    before = snapshot(s)
    assert plan_defrag(s, 8) is not None
    assert plan_defrag(s, 8, max_moves=2) is None
    assert snapshot(s) == before


def test_start_then_finish_keeps_the_ledger_consistent_and_frees_the_node() -> None:
    s = filled(FRAGMENTED)
    plan = plan_defrag(s, 8)
    assert plan is not None
    held_before = len(s.ledger.reservations())
    for move in plan.moves:
        new = start_move(s, move)
        assert new.id == move.replacement_id and new.gpu_refs == move.to_gpus
        old = s.placements[move.placement_id]
        assert (new.tp, new.pp, new.hbm_per_gpu, new.link, new.level) == (
            old.tp,
            old.pp,
            old.hbm_per_gpu,
            "nvlink4",
            "nvlink",
        )
        record = s.ledger.get(move.replacement_id)
        assert record is not None and record.meta[MOVED_FROM] == move.placement_id
        assert s.ledger.get(move.placement_id) is not None  # the old copy is still held
    assert len(s.ledger.reservations()) == held_before + len(plan.moves)
    assert not set(plan.frees) <= s.index.free  # nothing freed before the old copies go
    for move in plan.moves:
        finish_move(s, move)
    assert len(s.ledger.reservations()) == held_before
    assert node_gpus("hgx-h100-3") <= s.index.free
    accounts = s.ledger.accounts()
    assert all(accounts[r].reserved_bytes == 0 for r in node_gpus("hgx-h100-3"))
    # the ledger and the scheduler agree on every GPU held
    booked = {ref for r in s.ledger.reservations() for ref in r.gpus}
    assert booked == {ref for p in s.placements.values() for ref in p.gpu_refs}
    assert booked.isdisjoint(s.index.free)
    # and the large instance now fits in one NVLink domain
    outcome = s.place(PlacementRequest(id="big", model="llama-3.1-70b", allowed_tp=(8,)))
    (big,) = outcome.placements
    assert set(big.gpu_refs) == node_gpus("hgx-h100-3") and big.level == "nvlink"


def test_max_moves_is_respected() -> None:
    s = filled(FRAGMENTED)
    plan, why = search_defrag(s, 8, max_moves=2)
    assert plan is None and "at most 2 move(s)" in why and "4 need more moves" in why
    plan = plan_defrag(s, 8, max_moves=3)
    assert plan is not None and len(plan.moves) == 3


def test_impossible_cases_return_none_with_the_reason() -> None:
    full = filled()
    assert plan_defrag(full, 8) is None  # nothing free anywhere: no room to move into
    s = filled(FRAGMENTED)
    plan, why = search_defrag(s, 16)
    assert plan is None and "no nvlink group holds 16 GPUs" in why
    assert plan_defrag(s, 8, movable=lambda _p: False) is None
    only_small = filled(("n0i3", "n1i3", "n2i3"))  # 3 free GPUs: 8 never fit in a node
    assert plan_defrag(only_small, 8) is None


def test_room_already_is_a_plan_without_moves() -> None:
    s = filled(("n2i0", "n2i1", "n2i2", "n2i3", "n2i4"))
    plan = plan_defrag(s, 8)
    assert plan is not None and plan.moves == () and set(plan.frees) == node_gpus("hgx-h100-2")
    four = plan_defrag(filled(FRAGMENTED), 2)
    assert four is not None and four.moves == ()


def test_a_smaller_need_moves_less_and_excluded_groups_are_not_freed() -> None:
    s = filled(FRAGMENTED)
    plan = plan_defrag(s, 4)  # node 3 has 3 free: one TP1 out of it is enough
    assert plan is not None and len(plan.moves) == 1 and plan.gpus_moved == 1
    assert len(plan.frees) >= 4
    node3 = s.index.dmap.gpu_domain["hgx-h100-3/0"]
    assert node3 is not None and plan.group == node3
    other = plan_defrag(s, 8, exclude=[node3])
    assert other is not None and other.group != node3 and other.gpus_moved == 6


def test_moves_in_flight_are_not_moved_again() -> None:
    s = filled(FRAGMENTED)
    plan = plan_defrag(s, 8)
    assert plan is not None
    start_move(s, plan.moves[0])
    again = plan_defrag(s, 8)
    moved = {plan.moves[0].placement_id, plan.moves[0].replacement_id}
    assert again is None or not moved & {m.placement_id for m in again.moves}


def test_a_move_the_ledger_refuses_leaves_nothing_behind() -> None:
    s = filled(FRAGMENTED)
    plan = plan_defrag(s, 8)
    assert plan is not None
    move = plan.moves[0]
    # another holder books one target GPU behind this scheduler's back
    s.ledger.reserve("other", {move.to_gpus[0]: 70 * 2**30})
    before = snapshot(s)
    with pytest.raises(LedgerConflict):
        start_move(s, move)
    assert snapshot(s) == before and s.ledger.get(move.replacement_id) is None


def test_stale_moves_are_refused() -> None:
    s = filled(FRAGMENTED)
    plan = plan_defrag(s, 8)
    assert plan is not None
    move = plan.moves[0]
    with pytest.raises(StateError, match="not booked"):
        finish_move(s, move)  # the old copy keeps serving until its replacement is booked
    s.release(move.placement_id)
    with pytest.raises(StateError, match="not held"):
        start_move(s, move)
    assert start_move(s, plan.moves[1]).id == plan.moves[1].replacement_id
    assert start_move(s, plan.moves[1]).id == plan.moves[1].replacement_id  # idempotent


def test_replacement_ids_are_valid_unique_placement_ids() -> None:
    assert replacement_id("x", ()) == "x.m1"
    assert replacement_id("x.m1", ()) == "x.m2"
    assert replacement_id("req-3", {"req-3.m1"}) == "req-3.m2"
    long = "a" * 120 + "-12"
    new = replacement_id(long, ())
    assert len(new) <= 120 and new.endswith(".m1")


def test_the_limiter_is_a_sliding_window() -> None:
    limiter = DefragLimiter(3, 60.0)
    assert limiter.allow(0.0, 3) and not limiter.allow(0.0, 4)
    limiter.record(0.0, 2)
    assert limiter.allow(10.0, 1) and not limiter.allow(10.0, 2)
    limiter.record(30.0, 1)
    assert not limiter.allow(59.0, 1)
    assert limiter.retry_after(59.0, 1) == pytest.approx(1.0)
    assert limiter.allow(60.0, 2) and not limiter.allow(60.0, 3)  # the 2 at t=0 left the window
    assert limiter.allow(90.0, 3)
    assert limiter.retry_after(0.0, 4) == float("inf")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sets(st.sampled_from([f"n{n}i{k}" for n in range(4) for k in range(5)]), min_size=5, max_size=12))
def test_any_plan_is_pure_and_its_moves_free_the_group(released: set[str]) -> None:
    s = filled(tuple(sorted(released)))
    before = snapshot(s)
    plan = plan_defrag(s, 8)
    assert snapshot(s) == before
    if plan is None:
        assert sum(1 for lv in [s.index.levels["node"]] for c in lv.free_count if c == 8) == 0
        return
    for move in plan.moves:
        start_move(s, move)
    for move in plan.moves:
        finish_move(s, move)
    assert set(plan.frees) <= s.index.free and len(plan.frees) >= 8
    booked = {ref for r in s.ledger.reservations() for ref in r.gpus}
    assert booked == {ref for p in s.placements.values() for ref in p.gpu_refs}


def test_moves_round_trip_through_json() -> None:
    move = Move("a", "a.m1", ("n/0",), ("m/1",))
    assert move.to_json() == {"placement_id": "a", "replacement_id": "a.m1", "from_gpus": ["n/0"], "to_gpus": ["m/1"]}
