"""One SLO class's line in the fair queue (``solver/queue.py``): its items (``QueuedItem``) in push order
and a segment tree of their max-plus tag maps, so one item's tags cost O(log n) and a removal one leaf
update."""

from __future__ import annotations

import dataclasses
import math

from toposched.solver.request import SloClass


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


_NO_FINISH = -math.inf
"""``b`` of the identity map ``x -> max(x + 0, -inf)``: a removed item."""
_MIN_TREE = 16
"""Smallest segment-tree capacity (leaves) of a line."""
COMPACT_AT = 64
"""A line (and the expiry heap) is compacted once it holds this many dead slots and more dead than live."""


def _retagged(item: QueuedItem, start: float, finish: float) -> QueuedItem:
    """``item`` with these tags: the object itself when they are the ones it carries."""
    if item.start == start and item.finish == finish:
        return item
    return dataclasses.replace(item, start=start, finish=finish)


class Line:
    """One class's items in push order and a segment tree of their max-plus maps.

    Slot ``s`` holds the item with the tags it was pushed or last read with (only its other fields
    are used; tags are recomputed on each read), or ``None`` once it was served or removed;
    every slot before ``head`` is ``None``. ``base`` is the finish of the chain before ``head``: the
    finish of the last item served (0 before any). Leaf ``cap + s`` of the tree holds the map of slot
    ``s`` as ``(a, b)`` in two float lists; node ``i`` composes its children ``2i`` then ``2i + 1``.
    Leaves from ``built`` on were set without updating their ancestors (pushes are O(1); the tree
    catches up before its next query). Slots before ``head`` are never queried, so serving an item
    or removing the head touches no node.
    """

    __slots__ = (
        "base",
        "built",
        "cap",
        "head",
        "incs",
        "items",
        "last_finish",
        "last_stale",
        "live",
        "slot_of",
        "ta",
        "tb",
    )

    def __init__(self) -> None:
        self.items: list[QueuedItem | None] = []
        self.incs: list[float] = []
        self.slot_of: dict[str, int] = {}
        self.head = 0
        self.live = 0
        self.base = 0.0
        self.last_finish = 0.0
        """Finish of the whole chain (the next push starts no earlier), valid unless ``last_stale``."""
        self.last_stale = False
        self.cap = 0
        self.ta: list[float] = []
        self.tb: list[float] = []
        self.built = 0

    # ---------------------------------------------------------------- the chain
    def append(self, item: QueuedItem, inc: float) -> None:
        slot = len(self.items)
        self.items.append(item)
        self.incs.append(inc)
        self.slot_of[item.item_id] = slot
        self.live += 1
        self.last_finish = item.finish
        self.last_stale = False
        if slot >= self.cap:
            self._rebuild(max(_MIN_TREE, 2 * self.cap))
        else:
            self.ta[self.cap + slot] = inc
            self.tb[self.cap + slot] = item.pushed_at_vtime + inc

    def chain_finish(self) -> float:
        """Finish of the last item of the chain: where the next push of this class may start."""
        if self.last_stale:
            self.last_finish = self.finish_before(len(self.items))
            self.last_stale = False
        return self.last_finish

    def tags(self, slot: int, before: float | None = None) -> QueuedItem:
        """The live item at ``slot`` with its current tags (``before``: the chain's finish before it)."""
        item = self.items[slot]
        assert item is not None
        if before is None:
            before = self.finish_before(slot)
        pushed = item.pushed_at_vtime
        start = pushed if pushed > before else before
        item = self.items[slot] = _retagged(item, start, start + self.incs[slot])
        return item

    def finish_before(self, slot: int) -> float:
        """Finish of the chain before ``slot`` (>= head): ``base`` through the maps of [head, slot)."""
        x = self.base
        if slot <= self.head:
            return x
        self._catch_up()
        ta, tb = self.ta, self.tb
        lo, hi = self.head + self.cap, slot + self.cap
        right: list[int] = []
        while lo < hi:
            if lo & 1:
                x += ta[lo]
                if tb[lo] > x:
                    x = tb[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                right.append(hi)
            lo >>= 1
            hi >>= 1
        for node in reversed(right):
            x += ta[node]
            if tb[node] > x:
                x = tb[node]
        return x

    def _catch_up(self) -> None:
        """Update the ancestors of the leaves set since the last query (amortised O(1) a push)."""
        if self.built >= len(self.items):
            return
        ta, tb = self.ta, self.tb
        lo, hi = (self.cap + self.built) >> 1, (self.cap + len(self.items) - 1) >> 1
        while True:
            for node in range(lo, hi + 1):
                left = 2 * node
                a = ta[left + 1]
                b = tb[left] + a
                ta[node] = ta[left] + a
                tb[node] = b if b > tb[left + 1] else tb[left + 1]
            if lo == 1:
                break
            lo >>= 1
            hi >>= 1
        self.built = len(self.items)

    def _rebuild(self, cap: int) -> None:
        """A fresh tree of ``cap`` leaves for the current slots; nodes are filled on the next query."""
        self.cap = cap
        self.ta = [0.0] * (2 * cap)
        self.tb = [_NO_FINISH] * (2 * cap)
        for slot in range(self.head, len(self.items)):
            item = self.items[slot]
            if item is not None:
                self.ta[cap + slot] = self.incs[slot]
                self.tb[cap + slot] = item.pushed_at_vtime + self.incs[slot]
        self.built = self.head

    # ---------------------------------------------------------------- taking items out
    def kill(self, slot: int) -> None:
        """Take the live item at ``slot`` out of the chain, as if it had never been pushed.

        Slots keep their numbers until ``compact_if_sparse``, which the caller runs when done."""
        item = self.items[slot]
        assert item is not None
        del self.slot_of[item.item_id]
        self.items[slot] = None
        self.live -= 1
        self.last_stale = True
        if slot == self.head:
            self._advance()
            return
        self._catch_up()
        ta, tb = self.ta, self.tb
        node = self.cap + slot
        ta[node], tb[node] = 0.0, _NO_FINISH
        node >>= 1
        while node:
            left = 2 * node
            a = ta[left + 1]
            b = tb[left] + a
            ta[node] = ta[left] + a
            tb[node] = b if b > tb[left + 1] else tb[left + 1]
            node >>= 1

    def serve_head(self, finish: float) -> None:
        """The head was served with this finish tag: it stays in the chain, before the new head.
        Unlike ``kill``, this may compact (renumber) the slots."""
        items, head = self.items, self.head
        item = items[head]
        assert item is not None
        del self.slot_of[item.item_id]
        items[head] = None
        self.live -= 1
        self.base = finish
        head += 1
        while head < len(items) and items[head] is None:
            head += 1
        self.head = head
        if len(items) - self.live >= COMPACT_AT:
            self.compact_if_sparse()

    def drop(self, slots: list[int]) -> None:
        """``kill`` for many slots at once, in O(line): the tree is rebuilt instead of updated."""
        for slot in slots:
            item = self.items[slot]
            assert item is not None
            del self.slot_of[item.item_id]
            self.items[slot] = None
        self.live -= len(slots)
        self.last_stale = True
        self._advance()
        self.compact_if_sparse(force=True)

    def _advance(self) -> None:
        items = self.items
        while self.head < len(items) and items[self.head] is None:
            self.head += 1

    def compact_if_sparse(self, force: bool = False) -> None:
        """Drop dead slots once they outnumber the live ones: memory stays O(live items)."""
        dead = len(self.items) - self.live
        if not force and (dead < COMPACT_AT or dead <= self.live):
            return
        keep = [s for s in range(self.head, len(self.items)) if self.items[s] is not None]
        self.items = [self.items[s] for s in keep]
        self.incs = [self.incs[s] for s in keep]
        self.slot_of = {}
        for slot, item in enumerate(self.items):
            assert item is not None
            self.slot_of[item.item_id] = slot
        self.head = 0
        cap = _MIN_TREE
        while cap < len(self.items):
            cap *= 2
        self._rebuild(cap)


__all__ = ["COMPACT_AT", "Line", "QueuedItem"]
