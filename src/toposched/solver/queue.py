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

Nothing is re-tagged eagerly. Inside a class, item *k* finishes at
``max(pushed_at_vtime[k], finish[k-1]) + increment[k]``: the max-plus map
``x -> max(x + increment, pushed_at_vtime + increment)`` applied to the finish before it, and such
maps compose to the same form ``x -> max(x + a, b)``. Each class keeps its line in push order with
a segment tree of these maps (a removed item becomes the identity; ``solver/queueline.py``), so one
item's tags or the class's last finish cost O(log n) and a removal is one leaf update. Served items stay in the chain
(serving the head re-tags nothing); the tags of the head follow from the last served finish alone.
Tags are materialised when an item is read (``peek``, ``pop``, ``remove``, ``expire``, iteration);
``expire`` finds stale items through a heap on ``enqueued_at``; dead slots are compacted away when
they outnumber the live ones, so memory follows the live items. The tags equal those of re-tagging
item by item, up to floating-point rounding (the tree associates sums differently); when every
value is dyadic (the default weights, whole GPU counts, occupancies such as 1/8) they are identical.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator
from typing import get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from toposched.errors import InputError
from toposched.solver.queueline import COMPACT_AT, Line, QueuedItem
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


class FairQueue:
    """Self-clocked weighted fair queue over SLO classes, with the seed's occupancy charge."""

    def __init__(self, config: FairQueueConfig | None = None) -> None:
        self.config = config or FairQueueConfig()
        self.virtual_now = 0.0
        self._lines: dict[SloClass, Line] = {c: Line() for c in SLO_ORDER}
        self._class_of: dict[str, SloClass] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        """Min-heap of (enqueued_at, seq, item_id); entries of items gone are skipped (seq differs)."""
        self._seq = 0

    def __len__(self) -> int:
        return len(self._class_of)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._class_of

    def __iter__(self) -> Iterator[QueuedItem]:
        """Waiting items in the order ``pop`` would serve them if nothing else were pushed."""
        out: list[QueuedItem] = []
        for line in self._lines.values():
            before = line.base
            for slot in range(line.head, len(line.items)):
                if line.items[slot] is not None:
                    item = line.tags(slot, before)
                    out.append(item)
                    before = item.finish
        return iter(sorted(out, key=lambda i: (i.finish, i.seq)))

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
        if not 0 < cost_gpus < math.inf:
            raise InputError(f"cost_gpus must be > 0 and finite (got {cost_gpus!r})")
        if not 0.0 <= occupancy <= 1.0:
            raise InputError(f"occupancy must be within [0, 1] (got {occupancy!r})")
        inc = self.increment(slo_class, cost_gpus, occupancy)
        if not inc < math.inf:
            raise InputError(f"cost_gpus {cost_gpus!r} is too large to account for")
        line = self._lines[slo_class]
        last = line.chain_finish() if line.last_stale else line.last_finish
        start = last if last > self.virtual_now else self.virtual_now
        item = QueuedItem(
            item_id=item_id,
            slo_class=slo_class,
            cost_gpus=cost_gpus,
            occupancy=occupancy,
            enqueued_at=enqueued_at,
            seq=self._seq,
            pushed_at_vtime=self.virtual_now,
            start=start,
            finish=start + inc,
        )
        self._seq += 1
        line.append(item, inc)
        self._class_of[item_id] = slo_class
        if enqueued_at == enqueued_at:  # a NaN time never expires: keep it out of the heap's order
            heapq.heappush(self._deadlines, (enqueued_at, item.seq, item_id))
        return item

    def _head_line(self) -> Line | None:
        """The line whose head has the smallest (finish, seq): four heads, O(1) each."""
        best: Line | None = None
        best_finish, best_seq = 0.0, 0
        for line in self._lines.values():
            if line.live:
                head = line.items[line.head]
                assert head is not None
                base, pushed = line.base, head.pushed_at_vtime
                finish = (pushed if pushed > base else base) + line.incs[line.head]  # before the head: base
                if best is None or finish < best_finish or (finish == best_finish and head.seq < best_seq):
                    best, best_finish, best_seq = line, finish, head.seq
        return best

    def peek(self) -> QueuedItem | None:
        """The item ``pop`` would return, left in the queue."""
        line = self._head_line()
        return None if line is None else line.tags(line.head, line.base)

    def pop(self) -> QueuedItem | None:
        """Serve the smallest finish tag (first pushed on ties); ``None`` when empty."""
        line = self._head_line()
        if line is None:
            return None
        item = line.tags(line.head, line.base)
        line.serve_head(item.finish)
        del self._class_of[item.item_id]
        if item.finish > self.virtual_now:
            self.virtual_now = item.finish
        if len(self._deadlines) > COMPACT_AT + 2 * len(self._class_of):
            self._compact_deadlines()
        return item

    def remove(self, item_id: str) -> QueuedItem | None:
        """Take an item out (timeout, cancel); later items of its class move up. ``None`` if absent."""
        slo_class = self._class_of.pop(item_id, None)
        if slo_class is None:
            return None
        line = self._lines[slo_class]
        slot = line.slot_of[item_id]
        removed = line.tags(slot)
        line.kill(slot)
        line.compact_if_sparse()
        if len(self._deadlines) > COMPACT_AT + 2 * len(self._class_of):
            self._compact_deadlines()
        return removed

    def expire(self, now: float, timeout: float) -> list[QueuedItem]:
        """Remove and return every item that has waited longer than ``timeout`` seconds at ``now``."""
        # now - enqueued_at falls as enqueued_at rises, so the stale items are the heap's smallest
        deadlines = self._deadlines
        stale: dict[SloClass, list[int]] = {}
        while deadlines and now - deadlines[0][0] > timeout:
            _, seq, item_id = heapq.heappop(deadlines)
            slo_class = self._class_of.get(item_id)
            if slo_class is None:
                continue
            line = self._lines[slo_class]
            slot = line.slot_of[item_id]
            item = line.items[slot]
            assert item is not None
            if item.seq == seq:  # else the id was served or removed, then pushed again
                stale.setdefault(slo_class, []).append(slot)
        out: list[QueuedItem] = []
        for slo_class, slots in stale.items():
            out.extend(self._expire_line(self._lines[slo_class], sorted(slots)))
        for item in out:
            del self._class_of[item.item_id]
        if len(self._deadlines) > COMPACT_AT + 2 * len(self._class_of):
            self._compact_deadlines()
        out.sort(key=lambda i: i.seq)
        return out

    @staticmethod
    def _expire_line(line: Line, slots: list[int]) -> list[QueuedItem]:
        """Take these slots (ascending) out of one line; each with the tags it had before any left."""
        if len(slots) * line.live.bit_length() < line.live:  # a few: O(log n) each through the tree
            items = [line.tags(slot) for slot in slots]
            for slot in slots:
                line.kill(slot)
            line.compact_if_sparse()
            return items
        stale = set(slots)  # many: one pass over the line, then one rebuild
        items = []
        before = line.base
        for slot in range(line.head, len(line.items)):
            if line.items[slot] is not None:
                item = line.tags(slot, before)
                before = item.finish
                if slot in stale:
                    items.append(item)
        line.drop(slots)
        return items

    def _compact_deadlines(self) -> None:
        """Rebuild the expiry heap (run once most of its entries belong to items already gone)."""
        self._deadlines = [
            (item.enqueued_at, item.seq, item.item_id)
            for line in self._lines.values()
            for item in line.items
            if item is not None and item.enqueued_at == item.enqueued_at
        ]
        heapq.heapify(self._deadlines)
