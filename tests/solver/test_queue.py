"""Weighted fair queueing between SLO classes, with seed 000's occupancy charge."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import sys
from collections import deque
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from toposched.errors import InputError
from toposched.solver import queue as queue_module
from toposched.solver import queueline
from toposched.solver.queue import SLO_ORDER, FairQueue, FairQueueConfig
from toposched.solver.queueline import QueuedItem
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


# ---------------------------------------------------------------------------------------------
# The pre-issue-17 implementation, verbatim but for its name, and differential tests against it.


class ReferenceQueue:
    """``FairQueue`` as it was before issue 17 (commit 3a1ec87), kept as the oracle of the differential tests.

    ``remove`` re-tags every later item of the class one by one (O(n) a removal, O(n) per item for
    ``expire``); benchmarks/queue_bench.py times it against ``FairQueue``.
    """

    def __init__(self, config: FairQueueConfig | None = None) -> None:
        self.config = config or FairQueueConfig()
        self.virtual_now = 0.0
        self._lines: dict[SloClass, deque[QueuedItem]] = {c: deque() for c in SLO_ORDER}
        self._last_finish: dict[SloClass, float] = dict.fromkeys(SLO_ORDER, 0.0)
        self._class_of: dict[str, SloClass] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._class_of)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._class_of

    def __iter__(self) -> Iterator[QueuedItem]:
        """Waiting items in the order ``pop`` would serve them if nothing else were pushed."""
        return iter(sorted((i for line in self._lines.values() for i in line), key=lambda i: (i.finish, i.seq)))

    def charged_cost(self, cost_gpus: float, occupancy: float) -> float:
        """Cost counted for fairness: the GPUs times (1 + charge x occupancy)."""
        return cost_gpus * (1.0 + self.config.occupancy_charge * occupancy)

    def increment(self, slo_class: SloClass, cost_gpus: float, occupancy: float) -> float:
        """How far one such item advances its class's virtual finish time."""
        return self.charged_cost(cost_gpus, occupancy) / self.config.weight(slo_class)

    def push(
        self,
        item_id: str,
        slo_class: SloClass,
        cost_gpus: float,
        occupancy: float = 0.0,
        *,
        enqueued_at: float = 0.0,
    ) -> QueuedItem:
        """Queue a request; ``occupancy`` is the share of an NVLink domain it would hold (0-1)."""
        if item_id in self._class_of:
            raise InputError(f"item_id {item_id!r} is already queued")
        if slo_class not in self._lines:
            raise InputError(f"slo_class {slo_class!r} is not one of {', '.join(SLO_ORDER)}")
        if not cost_gpus > 0:
            raise InputError(f"cost_gpus must be > 0 (got {cost_gpus!r})")
        if not 0.0 <= occupancy <= 1.0:
            raise InputError(f"occupancy must be within [0, 1] (got {occupancy!r})")
        start = max(self.virtual_now, self._last_finish[slo_class])
        item = QueuedItem(
            item_id=item_id,
            slo_class=slo_class,
            cost_gpus=cost_gpus,
            occupancy=occupancy,
            enqueued_at=enqueued_at,
            seq=self._seq,
            pushed_at_vtime=self.virtual_now,
            start=start,
            finish=start + self.increment(slo_class, cost_gpus, occupancy),
        )
        self._seq += 1
        self._lines[slo_class].append(item)
        self._last_finish[slo_class] = item.finish
        self._class_of[item_id] = slo_class
        return item

    def peek(self) -> QueuedItem | None:
        """The item ``pop`` would return, left in the queue."""
        heads = [line[0] for line in self._lines.values() if line]
        return min(heads, key=lambda i: (i.finish, i.seq)) if heads else None

    def pop(self) -> QueuedItem | None:
        """Serve the smallest finish tag (first pushed on ties); ``None`` when empty."""
        item = self.peek()
        if item is None:
            return None
        self._lines[item.slo_class].popleft()
        del self._class_of[item.item_id]
        self.virtual_now = max(self.virtual_now, item.finish)
        return item

    def remove(self, item_id: str) -> QueuedItem | None:
        """Take an item out (timeout, cancel); later items of its class move up. ``None`` if absent."""
        slo_class = self._class_of.pop(item_id, None)
        if slo_class is None:
            return None
        line = self._lines[slo_class]
        at = next(n for n, i in enumerate(line) if i.item_id == item_id)
        removed = line[at]
        del line[at]
        # removed.start = max(its push vtime, finish of the item before it); later items were pushed
        # no earlier, so max(their push vtime, removed.start) is what their start would have been.
        previous = removed.start
        for n in range(at, len(line)):
            item = line[n]
            start = max(item.pushed_at_vtime, previous)
            line[n] = dataclasses.replace(item, start=start, finish=start + (item.finish - item.start))
            previous = line[n].finish
        self._last_finish[slo_class] = previous
        return removed

    def expire(self, now: float, timeout: float) -> list[QueuedItem]:
        """Remove and return every item that has waited longer than ``timeout`` seconds at ``now``."""
        stale = [i for line in self._lines.values() for i in line if now - i.enqueued_at > timeout]
        for item in sorted(stale, key=lambda i: i.seq, reverse=True):
            self.remove(item.item_id)
        return sorted(stale, key=lambda i: i.seq)


TAGS = ("start", "finish", "pushed_at_vtime")  # virtual times: sums of increments


def assert_same(new: QueuedItem | None, old: QueuedItem | None, *, exact: bool) -> None:
    """Same item, same fields; tags exactly equal, or within rounding when ``exact`` is False."""
    if old is None:
        assert new is None
        return
    assert new is not None, f"expected {old.item_id}, got None"
    for field in dataclasses.fields(QueuedItem):
        a, b = getattr(new, field.name), getattr(old, field.name)
        if isinstance(b, float) and math.isnan(b):
            assert math.isnan(a), field.name
        elif field.name in TAGS and not exact:
            assert a == pytest.approx(b, rel=1e-9, abs=1e-12), (old.item_id, field.name)
        else:
            assert a == b, (old.item_id, field.name, a, b)


def assert_same_lists(new: list[QueuedItem], old: list[QueuedItem], *, exact: bool) -> None:
    assert [i.item_id for i in new] == [i.item_id for i in old]
    for a, b in zip(new, old, strict=True):
        assert_same(a, b, exact=exact)


DYADIC_COSTS = (0.5, 1.0, 2.0, 3.0, 4.0, 8.0)
DYADIC_OCCUPANCY = (0.0, 0.0, 0.125, 0.25, 0.5, 1.0)
FLOAT_CONFIG = FairQueueConfig(
    realtime_weight=7.3, interactive_weight=3.1, standard_weight=1.7, batch_weight=1.0, occupancy_charge=0.37
)


def drive(seed: int, steps: int, *, exact: bool) -> dict[str, int]:
    """Apply one random sequence of operations to ``FairQueue`` and ``ReferenceQueue``; compare every answer.

    ``exact``: dyadic costs and the default weights, so both compute their tags without rounding and
    must agree bit for bit (ties included); otherwise arbitrary floats, tags within 1e-9. The mix
    changes every 300 steps between growing, shrinking and steady, so lines get deep, get compacted,
    and ``expire`` takes both one-at-a-time and whole-line paths. Returns what was exercised.
    """
    rng = random.Random(seed)
    config = None if exact else FLOAT_CONFIG
    new, old = FairQueue(config), ReferenceQueue(config)
    clock = 0.0
    counter = itertools.count()
    gone: list[str] = []
    seen = {"max_depth": 0, "removed": 0, "expired": 0, "largest_expiry": 0, "popped": 0}
    push_share, expire_share = 0.5, 0.04
    for step in range(steps):
        if step % 300 == 0:
            push_share = rng.choice((0.8, 0.5, 0.2))
            expire_share = rng.choice((0.04, 0.0))  # phases without expiry compact lines by pops and removals
        roll = rng.random()
        if roll < push_share:
            reuse = gone and rng.random() < 0.1
            item_id = gone.pop(rng.randrange(len(gone))) if reuse else f"i{next(counter)}"
            slo_class = rng.choice(SLO_ORDER)
            if exact:
                cost, occupancy = rng.choice(DYADIC_COSTS), rng.choice(DYADIC_OCCUPANCY)
            else:
                cost, occupancy = rng.uniform(0.1, 8.0), rng.choice((0.0, rng.random()))
            clock += rng.expovariate(1.0)
            at = rng.random()
            enqueued_at = clock if at < 0.85 else clock - rng.uniform(0, 30) if at < 0.99 else math.nan
            assert_same(
                new.push(item_id, slo_class, cost, occupancy, enqueued_at=enqueued_at),
                old.push(item_id, slo_class, cost, occupancy, enqueued_at=enqueued_at),
                exact=exact,
            )
        elif roll < push_share + 0.12:
            popped = old.pop()
            assert_same(new.pop(), popped, exact=exact)
            if popped is not None:
                gone.append(popped.item_id)
                seen["popped"] += 1
        elif roll < push_share + 0.30:
            waiting = list(old._class_of)
            item_id = rng.choice(waiting) if waiting and rng.random() < 0.9 else "absent"
            removed = old.remove(item_id)
            assert_same(new.remove(item_id), removed, exact=exact)
            if removed is not None:
                gone.append(item_id)
                seen["removed"] += 1
        elif roll < push_share + 0.30 + expire_share:
            timeout = rng.choice((rng.uniform(0, 10), rng.uniform(10, 100), rng.uniform(100, 400)))
            expired = old.expire(clock, timeout)
            assert_same_lists(new.expire(clock, timeout), expired, exact=exact)
            gone.extend(i.item_id for i in expired)
            seen["expired"] += len(expired)
            seen["largest_expiry"] = max(seen["largest_expiry"], len(expired))
        elif roll < push_share + 0.38 + expire_share:
            assert_same(new.peek(), old.peek(), exact=exact)
        else:
            assert_same_lists(list(new), list(old), exact=exact)
        assert len(new) == len(old)
        probe = rng.choice(gone) if gone and rng.random() < 0.5 else f"i{rng.randrange(step + 1)}"
        assert (probe in new) == (probe in old)
        assert new.virtual_now == (old.virtual_now if exact else pytest.approx(old.virtual_now, rel=1e-9))
        seen["max_depth"] = max(seen["max_depth"], len(old))
    assert_same_lists(list(new), list(old), exact=exact)
    while (item := old.pop()) is not None:  # and the rest drains in the same order with the same tags
        assert_same(new.pop(), item, exact=exact)
    assert new.pop() is None and len(new) == 0
    return seen


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), exact=st.booleans())
def test_same_answers_as_the_reference_queue(seed: int, exact: bool) -> None:
    drive(seed, 300, exact=exact)


@pytest.mark.parametrize(("seed", "exact", "compact_at"), [(17, True, None), (1015, False, None), (29, True, 2)])
def test_same_answers_as_the_reference_over_a_long_run(
    seed: int, exact: bool, compact_at: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if compact_at is not None:  # compact after every few deaths: slots renumbered all the time
        monkeypatch.setattr(queue_module, "COMPACT_AT", compact_at)
        monkeypatch.setattr(queueline, "COMPACT_AT", compact_at)
    seen = drive(seed, 5000, exact=exact)
    # the run reached the paths it is meant to check: deep lines (compaction), whole-line expiry
    assert seen["max_depth"] >= 200
    assert seen["largest_expiry"] >= 50
    assert min(seen["removed"], seen["popped"], seen["expired"]) >= 200


@pytest.mark.parametrize("queue_class", [FairQueue, ReferenceQueue])
def test_remove_after_pops_and_removals_re_tags_as_if_never_pushed(
    queue_class: type[FairQueue] | type[ReferenceQueue],
) -> None:
    """Served items stay in their class's chain; removed ones leave it (worked by hand; old and new agree)."""
    queue = queue_class()
    for n in range(6):
        queue.push(f"b{n}", "batch", 1.0)  # finishes 1, 2, 3, 4, 5, 6
    assert queue.pop() is not None  # b0 served: virtual_now 1, b1 still finishes at 2
    queue.push("r", "realtime", 8.0)  # starts at virtual_now 1, finishes 2: ties with b1, pushed later
    assert queue.remove("b2") is not None
    assert queue.remove("b4") is not None
    assert [(i.item_id, i.start, i.finish) for i in queue] == [
        ("b1", 1.0, 2.0),
        ("r", 1.0, 2.0),
        ("b3", 2.0, 3.0),
        ("b5", 3.0, 4.0),
    ]
    queue.push("b6", "batch", 2.0)
    assert queue.remove("b1") is not None  # the head: the rest starts from b0's finish
    # b3 now starts at b0's finish (1) and ties with r (finish 2): b3 was pushed first
    assert [(i.item_id, i.finish) for i in queue] == [("b3", 2.0), ("r", 2.0), ("b5", 3.0), ("b6", 5.0)]


def test_expire_skips_items_gone_or_pushed_again_under_the_same_id() -> None:
    queue = FairQueue()
    queue.push("a", "batch", 1.0, enqueued_at=0.0)
    queue.push("b", "batch", 1.0, enqueued_at=0.0)
    queue.push("never", "batch", 1.0, enqueued_at=math.nan)  # a NaN time never compares as stale
    assert queue.remove("a") is not None
    queue.push("a", "batch", 1.0, enqueued_at=90.0)  # the same id again, not stale
    assert [i.item_id for i in queue.expire(now=100.0, timeout=60.0)] == ["b"]
    assert [i.item_id for i in queue] == ["never", "a"]


def test_infinite_cost_is_refused() -> None:
    queue = FairQueue()
    with pytest.raises(InputError) as info:
        queue.push("x", "batch", math.inf)
    assert "cost_gpus must be > 0 and finite" in info.value.message
    with pytest.raises(InputError) as info:
        queue.push("y", "batch", 1e308, occupancy=1.0)  # finite, but its charged cost overflows
    assert "too large" in info.value.message
    assert len(queue) == 0


def test_storage_follows_the_live_items() -> None:
    """Dead slots and stale heap entries are dropped: memory is O(live items), not O(items ever pushed)."""
    queue, reference = FairQueue(), ReferenceQueue()
    for n in range(20_000):
        slo_class = SLO_ORDER[n % 4]
        assert_same(queue.push(f"i{n}", slo_class, 1.0), reference.push(f"i{n}", slo_class, 1.0), exact=True)
        if n >= 10:
            gone = f"i{n - 10}"
            if n % 2 or gone not in reference:
                assert_same(queue.pop(), reference.pop(), exact=True)
            else:
                assert_same(queue.remove(gone), reference.remove(gone), exact=True)
    assert len(queue) == 10
    assert_same_lists(list(queue), list(reference), exact=True)
    lines = queue._lines.values()
    assert sum(len(line.items) for line in lines) <= 4 * 64 + 2 * len(queue)
    assert max(line.cap for line in lines) <= 256
    assert len(queue._deadlines) <= 64 + 2 * len(queue)


# ---------------------------------------------------------------------------------------------
# Cost by counting: Python lines executed (sys.settrace), never wall-clock time.


def lines_run(call: Callable[[], object]) -> int:
    """Python lines executed by ``call()``, in every function it calls."""
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def start(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        return local

    previous = sys.gettrace()
    sys.settrace(start)
    try:
        call()
    finally:
        sys.settrace(previous)
    return count


def deep(queue_class: type[FairQueue] | type[ReferenceQueue], depth: int) -> FairQueue | ReferenceQueue:
    """``depth`` batch items (costs 1-3), each enqueued at its index, and one query that lets the
    lazily kept tree catch up with the pushes (amortised over them, so not counted below)."""
    queue = queue_class()
    for n in range(depth):
        queue.push(f"i{n}", "batch", 1.0 + n % 3, enqueued_at=float(n))
    queue.push("rt", "realtime", 1.0, enqueued_at=float(depth))
    queue.remove("i3")
    return queue


def test_removal_and_expiry_cost_grows_logarithmically_with_depth() -> None:
    def costs(queue_class: type[FairQueue] | type[ReferenceQueue], depth: int) -> tuple[int, int]:
        queue = deep(queue_class, depth)
        removal = lines_run(lambda: queue.remove("i1"))  # the item after the head: later items move up
        queue.push("stale", "batch", 1.0, enqueued_at=-1000.0)
        queue.remove(f"i{depth // 2}")
        expiry = lines_run(lambda: queue.expire(now=0.0, timeout=10.0))  # one stale item of depth + 1
        assert "stale" not in queue and len(queue) == depth - 2
        return removal, expiry

    small, large = costs(FairQueue, 512), costs(FairQueue, 8192)
    for few, many in zip(small, large, strict=True):
        assert many <= few + 100  # 16x the depth: four more tree levels, not 16x the work
        assert many <= 600
    # the counter does see linear work: the old queue re-tags every later item
    old_small, old_large = costs(ReferenceQueue, 512), costs(ReferenceQueue, 8192)
    for few, many in zip(old_small, old_large, strict=True):
        assert many >= 8 * few


def test_peek_and_pop_do_not_grow_with_depth() -> None:
    queue = deep(FairQueue, 8192)
    small = deep(FairQueue, 64)
    assert lines_run(queue.peek) <= lines_run(small.peek) + 5
    assert lines_run(queue.pop) <= lines_run(small.pop) + 40
