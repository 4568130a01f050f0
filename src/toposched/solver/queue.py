"""Weighted fair queueing between SLO classes for requests that cannot be placed now.

Seed 000 (section 6): weights rise with SLO strictness, but a strict request that would hold more
of an NVLink domain pays a *resource occupancy fee* in the fairness accounting, so strict work
cannot starve the rest. Here that fee is a multiplier on the request's cost:

    charged = cost_gpus x (1 + occupancy_charge x occupancy)      occupancy in [0, 1]
    start   = max(virtual_now, last_finish[class])
    finish  = start + charged / weight[class]

``pop`` serves the smallest finish tag (ties: first pushed), and ``virtual_now`` becomes the finish
tag just served: self-clocked fair queueing (Golestani 1994), which needs no wall clock. With every
class backlogged, class *c* is served cost in proportion to ``weight[c] / (1 + charge x occupancy)``;
a waiting item is overtaken by at most ``ceil(its_increment / other_increment)`` items of any other
class that keeps pushing (its increment is its ``charged / weight``), so nothing starves.

Tags inside a class increase with push order, so the smallest finish is always at the head of one
class's line: ``pop`` looks at four heads, no heap. ``remove`` (a timeout, a cancellation) re-tags
the later items of that class as if the removed one had never been pushed.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Iterator
from typing import get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from toposched.errors import InputError
from toposched.solver.request import SloClass

SLO_ORDER: tuple[SloClass, ...] = get_args(SloClass)
"""SLO classes, strictest first."""


class FairQueueConfig(BaseModel):
    """Class weights and the occupancy charge of the fair queue."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    realtime_weight: float = Field(default=8.0, gt=0, le=1000)
    """Service weight of the realtime class (strictest SLO)."""
    interactive_weight: float = Field(default=4.0, gt=0, le=1000)
    """Service weight of the interactive class."""
    standard_weight: float = Field(default=2.0, gt=0, le=1000)
    """Service weight of the standard class."""
    batch_weight: float = Field(default=1.0, gt=0, le=1000)
    """Service weight of the batch class (loosest SLO)."""
    occupancy_charge: float = Field(default=1.0, ge=0, le=100)
    """Extra cost per unit of NVLink-domain occupancy: 1.0 doubles the cost of a whole-domain request."""

    @model_validator(mode="after")
    def _weights_rise_with_strictness(self) -> FairQueueConfig:
        weights = [self.weight(c) for c in SLO_ORDER]
        if any(a < b for a, b in itertools.pairwise(weights)):
            shown = ", ".join(f"{c}={w:g}" for c, w in zip(SLO_ORDER, weights, strict=True))
            raise ValueError(f"weights must not rise as SLOs loosen (strictest first): {shown}")
        return self

    def weight(self, slo_class: SloClass) -> float:
        value: float = getattr(self, f"{slo_class}_weight")
        return value


@dataclasses.dataclass(frozen=True)
class QueuedItem:
    """One waiting request and its fair-queueing tags (virtual time, not seconds)."""

    item_id: str
    slo_class: SloClass
    cost_gpus: float
    occupancy: float
    enqueued_at: float
    """Caller's clock at push (seconds), used only by ``expire``."""
    seq: int
    """Push order; breaks ties between equal finish tags (first pushed first)."""
    pushed_at_vtime: float
    """``virtual_now`` when pushed; lets ``remove`` re-tag the class exactly."""
    start: float
    finish: float


class FairQueue:
    """Self-clocked weighted fair queue over SLO classes, with the seed's occupancy charge."""

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
