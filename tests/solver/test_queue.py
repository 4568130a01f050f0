"""Weighted fair queueing between SLO classes, with seed 000's occupancy charge."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from toposched.errors import InputError
from toposched.solver.queue import FairQueue, FairQueueConfig, QueuedItem
from toposched.solver.request import SloClass

STRICT: tuple[SloClass, ...] = ("realtime", "interactive", "standard")
CLASSES: tuple[SloClass, ...] = (*STRICT, "batch")


def backlogged_pops(
    queue: FairQueue, demands: dict[SloClass, tuple[float, float]], pops: int, backlog: int = 3
) -> dict[SloClass, int]:
    """Keep every class in ``demands`` ({class: (cost, occupancy)}) backlogged; count pops per class."""
    counter = 0
    for slo_class, (cost, occupancy) in demands.items():
        for _ in range(backlog):
            queue.push(f"{slo_class}-{counter}", slo_class, cost, occupancy)
            counter += 1
    served = dict.fromkeys(demands, 0)
    for _ in range(pops):
        item = queue.pop()
        assert item is not None
        served[item.slo_class] += 1
        cost, occupancy = demands[item.slo_class]
        queue.push(f"{item.slo_class}-{counter}", item.slo_class, cost, occupancy)
        counter += 1
    return served


def test_empty_queue() -> None:
    queue = FairQueue()
    assert queue.pop() is None
    assert queue.peek() is None
    assert len(queue) == 0
    assert queue.remove("nope") is None


def test_fifo_inside_a_class_and_on_equal_tags() -> None:
    queue = FairQueue()
    for n in range(3):
        queue.push(f"b{n}", "batch", 1.0)
    # realtime at weight 8 with cost 8 has the same tag (1.0) as the first batch item: first pushed wins
    queue.push("r0", "realtime", 8.0)
    assert [queue.pop().item_id for _ in range(4)] == ["b0", "r0", "b1", "b2"]  # type: ignore[union-attr]


def test_peek_does_not_remove_and_len_counts() -> None:
    queue = FairQueue()
    queue.push("a", "standard", 2.0)
    queue.push("b", "realtime", 1.0)
    assert len(queue) == 2
    peeked = queue.peek()
    assert peeked is not None and peeked.item_id == "b"
    assert len(queue) == 2 and "b" in queue
    assert [i.item_id for i in queue] == ["b", "a"]


def test_default_shares_follow_weights_without_charge() -> None:
    served = backlogged_pops(FairQueue(), {"realtime": (1.0, 0.0), "batch": (1.0, 0.0)}, 900)
    assert served["realtime"] == pytest.approx(800, abs=2)
    assert served["batch"] == pytest.approx(100, abs=2)


def test_occupancy_charge_strictly_reduces_the_strict_share() -> None:
    demands: dict[SloClass, tuple[float, float]] = {"realtime": (1.0, 1.0), "batch": (1.0, 0.0)}
    free = backlogged_pops(FairQueue(FairQueueConfig(occupancy_charge=0.0)), demands, 1000)
    charged = backlogged_pops(FairQueue(), demands, 1000)
    assert charged["realtime"] < free["realtime"]
    # 8 / (1 + 1.0 x 1.0) = 4 : 1  ->  800 of 1000 pops instead of 889
    assert charged["realtime"] == pytest.approx(800, abs=2)
    assert free["realtime"] == pytest.approx(1000 * 8 / 9, abs=2)


@settings(max_examples=60, deadline=None)
@given(
    strict=st.sampled_from(STRICT),
    weight=st.floats(1.0, 50.0),
    charge=st.floats(0.0, 4.0),
    occupancy=st.floats(0.0, 1.0),
    strict_cost=st.sampled_from([1.0, 2.0, 4.0, 8.0]),
    batch_cost=st.sampled_from([1.0, 2.0, 4.0, 8.0]),
)
def test_backlogged_shares_converge_to_charged_weight_ratio(
    strict: SloClass, weight: float, charge: float, occupancy: float, strict_cost: float, batch_cost: float
) -> None:
    config = FairQueueConfig(
        realtime_weight=max(weight, 1.0), interactive_weight=max(weight, 1.0), standard_weight=max(weight, 1.0),
        batch_weight=1.0, occupancy_charge=charge,
    )  # fmt: skip
    queue = FairQueue(config)
    served = backlogged_pops(queue, {strict: (strict_cost, occupancy), "batch": (batch_cost, 0.0)}, 1000)
    strict_rate = 1 / queue.increment(strict, strict_cost, occupancy)  # items per unit of virtual time
    batch_rate = 1 / queue.increment("batch", batch_cost, 0.0)
    expected = 1000 * strict_rate / (strict_rate + batch_rate)
    assert served[strict] == pytest.approx(expected, abs=2.5)


@settings(max_examples=80, deadline=None)
@given(
    strict=st.sampled_from(STRICT),
    weight=st.floats(1.0, 200.0),
    occupancy=st.floats(0.0, 1.0),
    strict_cost=st.floats(0.25, 8.0),
    batch_cost=st.floats(0.25, 8.0),
    backlog=st.integers(0, 50),
)
def test_batch_item_is_never_starved(
    strict: SloClass, weight: float, occupancy: float, strict_cost: float, batch_cost: float, backlog: int
) -> None:
    """However large the strict backlog, a batch item waits at most ceil(its increment / strict increment) pops."""
    config = FairQueueConfig(realtime_weight=weight, interactive_weight=weight, standard_weight=weight)
    queue = FairQueue(config)
    for n in range(backlog):
        queue.push(f"s{n}", strict, strict_cost, occupancy)
    queue.push("batch", "batch", batch_cost)
    bound = math.ceil(queue.increment("batch", batch_cost, 0.0) / queue.increment(strict, strict_cost, occupancy))
    strict_pops = 0
    for _ in range(bound + 1):  # a starving queue fails here instead of looping for ever
        item = queue.pop()
        assert item is not None
        if item.item_id == "batch":
            break
        strict_pops += 1
        queue.push(f"s{backlog + strict_pops}", strict, strict_cost, occupancy)  # strict work never stops
    assert item is not None and item.item_id == "batch"
    assert strict_pops <= bound


def test_remove_takes_an_item_out_and_moves_its_class_up() -> None:
    queue = FairQueue()
    first = queue.push("r1", "realtime", 1.0)
    queue.push("r2", "realtime", 1.0)
    queue.push("b1", "batch", 1.0)
    removed = queue.remove("r1")
    assert removed == first
    assert "r1" not in queue and len(queue) == 2
    head = queue.peek()
    assert head is not None and head.item_id == "r2"
    assert head.finish == pytest.approx(1 / 8)  # the tag r1 had: r2 is not charged for r1
    assert queue.remove("r1") is None


@settings(max_examples=60, deadline=None)
@given(
    pushes=st.lists(
        st.tuples(
            st.sampled_from(["realtime", "interactive", "standard", "batch"]), st.floats(0.5, 4), st.floats(0, 1)
        ),
        min_size=1,
        max_size=30,
    ),
    drop=st.sets(st.integers(0, 29)),
)
def test_removing_is_as_if_never_pushed(pushes: list[tuple[SloClass, float, float]], drop: set[int]) -> None:
    with_removal, never = FairQueue(), FairQueue()
    for n, (slo_class, cost, occupancy) in enumerate(pushes):
        with_removal.push(f"i{n}", slo_class, cost, occupancy)
        if n not in drop:
            never.push(f"i{n}", slo_class, cost, occupancy)
    for n in sorted(drop):
        if n < len(pushes):
            assert with_removal.remove(f"i{n}") is not None

    def drain(queue: FairQueue) -> list[tuple[str, float]]:
        out: list[QueuedItem] = []
        while (item := queue.pop()) is not None:
            out.append(item)
        return [(i.item_id, round(i.finish, 9)) for i in out]

    assert drain(with_removal) == drain(never)


def test_expire_removes_only_items_past_the_timeout() -> None:
    queue = FairQueue()
    queue.push("old", "batch", 1.0, enqueued_at=0.0)
    queue.push("new", "batch", 1.0, enqueued_at=50.0)
    queue.push("old-rt", "realtime", 1.0, enqueued_at=10.0)
    expired = queue.expire(now=100.0, timeout=60.0)
    assert [i.item_id for i in expired] == ["old", "old-rt"]
    assert [i.item_id for i in queue] == ["new"]
    head = queue.peek()
    assert head is not None and head.finish == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"cost_gpus": 0.0}, "cost_gpus must be > 0"),
        ({"occupancy": 1.5}, "occupancy must be within [0, 1]"),
        ({"occupancy": -0.1}, "occupancy must be within [0, 1]"),
        ({"slo_class": "gold"}, "slo_class 'gold' is not one of"),
        ({"item_id": "dup"}, "already queued"),
    ],
)
def test_bad_pushes_name_the_argument(kwargs: dict[str, object], fragment: str) -> None:
    queue = FairQueue()
    queue.push("dup", "batch", 1.0)
    args: dict[str, object] = {"item_id": "x", "slo_class": "batch", "cost_gpus": 1.0, "occupancy": 0.0} | kwargs
    with pytest.raises(InputError) as info:
        queue.push(**args)  # type: ignore[arg-type]
    assert fragment in info.value.message
    assert len(queue) == 1


def test_config_bounds_and_ordering() -> None:
    with pytest.raises(ValidationError, match=r"realtime=1, interactive=4"):
        FairQueueConfig(realtime_weight=1.0)
    with pytest.raises(ValidationError):
        FairQueueConfig(batch_weight=0.0)
    with pytest.raises(ValidationError):
        FairQueueConfig(occupancy_charge=-1.0)
    with pytest.raises(ValidationError):
        FairQueueConfig(bogus=1.0)  # type: ignore[call-arg]
    assert FairQueueConfig().weight("interactive") == 4.0
