"""Batch placement (issue 12): priority first, then fewest GPUs, the order the service and simulator use."""

from __future__ import annotations

import pytest

from tests.solver.builders import make_scheduler
from toposched.errors import UnknownNameError
from toposched.solver.request import PlacementRequest


def _batch(priority_big: int = 0) -> list[PlacementRequest]:
    """The gap benchmark's instance 281: one empty HGX H100; in arrival order the TP8 takes the node."""
    return [
        PlacementRequest(id="big", model="mixtral-8x22b", allowed_tp=(8,), priority=priority_big),
        PlacementRequest(id="two", model="llama-3.1-8b", allowed_tp=(2,)),
        PlacementRequest(id="one", model="llama-3.1-8b", allowed_tp=(1,)),
        PlacementRequest(id="four", model="llama-3.1-70b", allowed_tp=(4,)),
    ]


def test_arrival_order_loses_three_instances() -> None:
    """The baseline the batch order fixes (so the next test cannot pass by accident)."""
    s = make_scheduler("hgx-h100")
    unplaced = [u.request_id for r in _batch() for u in s.place(r).unplaced]
    assert unplaced == ["two", "one", "four"]


def test_place_batch_places_the_small_ones_first() -> None:
    s = make_scheduler("hgx-h100")
    out = s.place_batch(_batch())
    assert [p.request_id for p in out.placements] == ["one", "two", "four"]
    assert [u.request_id for u in out.unplaced] == ["big"]
    assert len(s.index.free) == 1


def test_priority_comes_before_size() -> None:
    s = make_scheduler("hgx-h100")
    out = s.place_batch(_batch(priority_big=5))
    assert [p.request_id for p in out.placements] == ["big"]
    assert sorted(u.request_id for u in out.unplaced) == ["four", "one", "two"]


def test_batch_order_is_stable_and_puts_unfittable_requests_last() -> None:
    s = make_scheduler("hgx-h100")
    reqs = [
        PlacementRequest(id="a", model="llama-3.1-8b", allowed_tp=(2,)),
        PlacementRequest(id="huge", model="llama-3.1-405b", max_pp=1),  # fits no degree on one node
        PlacementRequest(id="b", model="llama-3.1-8b", allowed_tp=(2,)),
    ]
    assert [r.id for r in s.batch_order(reqs)] == ["a", "b", "huge"]
    out = s.place_batch(reqs)
    assert [u.status for u in out.unplaced] == ["rejected"]


def test_unknown_policy_is_refused_before_anything_is_booked() -> None:
    s = make_scheduler("hgx-h100")
    with pytest.raises(UnknownNameError):
        s.place_batch(_batch(), "best")
    assert len(s.index.free) == 8
