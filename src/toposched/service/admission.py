"""The admission queue: requests that found no capacity wait in fair order, strictly (no overtaking).

The queue is ``solver.queue.FairQueue`` (weighted fair queueing by SLO class); this module adds what a
replica does with it: each waiter's answer is delivered through a callback (the HTTP layer's future), the
queue is served on every release and every background sync (``drain``), and a head that still finds no
room for its TP group gets a defragmentation plan (``service.defrag.plan_head``), shown, never run.
A disaggregated request (``pd``) waits as one request: its cost is the GPUs of all its instances, and
each decision books every instance or none (``Deciding._place``).

Headroom (``ServiceConfig.keep_whole_domains``, off by default): a waiting request is decided with that
``keep_whole_domains`` for its first ``keep_whole_wait_s`` (at most half its ``wait_s``), so an instance
smaller than an NVLink domain does not break one of the last wholly free domains that a whole-domain
instance may need; after the hold it may. A head held only by the headroom lets the waiters behind it
that place *within* the headroom (a TP group that fills a domain, or one that fits in partly used ones)
be served first: the only overtaking the queue allows, and it cannot starve the head, whose hold ends.
A disaggregated request is never held; behind a held head it is tried within the headroom like any waiter.
The simulator measured the rule on churn-128 (docs/simulator.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any

from toposched.errors import InputError
from toposched.service.deciding import Deciding, held_for_headroom
from toposched.service.defrag import plan_head
from toposched.service.records import Decision
from toposched.service.request import ServiceRequest
from toposched.solver.queueline import QueuedItem
from toposched.solver.request import SLO_CLASSES


@dataclass
class Waiting:
    """A queued request and where its answer goes."""

    body: ServiceRequest
    request_id: str
    deliver: Callable[[Decision], None]
    hold_until: float = 0.0
    """Clock time until which it is decided with the service's headroom (0: never)."""
    held: bool = False
    """It has waited because of the headroom (counted once, as ``held-for-headroom``)."""


OVERTAKE_SCAN = 16
"""Most waiters behind a head held by the headroom that one drain tries (each is one decision)."""


class Admission(Deciding):
    """Queue, serve in fair order, cancel on timeout; the queue's view with the head's defrag plan."""

    def headroom_hold_s(self, body: ServiceRequest, wait_s: float) -> float:
        """How long a request that may wait ``wait_s`` is decided with the service's headroom (0: not at all).

        Only a request that waits and is not disaggregated, for at most half its wait, so it still gets
        an answer from the time left once the hold is over."""
        if not self.config.keep_whole_domains or wait_s <= 0 or body.pd is not None:
            return 0.0
        return min(self.config.keep_whole_wait_s, wait_s / 2)

    def enqueue(self, body: ServiceRequest, deliver: Callable[[Decision], None], hold_s: float = 0.0) -> str | None:
        """Queue a request that found no capacity; returns its id, or None when the queue is full.

        ``hold_s``: seconds from now during which it is decided with the service's headroom. A
        disaggregated request queues as one, all or none, with the GPUs of all its instances as its cost."""
        self.check_size(body)
        rid = body.id or self.new_id()
        with self.lock:
            if len(self.queue) >= self.config.max_queue:
                self.counters.decisions["queue-full"] += 1
                return None
            if rid in self.queue:
                raise InputError(f"id: {rid} is already waiting in the queue")
            gpus = self.queue_gpus(body, rid)
            largest = max(self.scheduler.index.levels["nvlink"].largest_group(), 1)
            occupancy = min(1.0, gpus / largest)
            now = self.clock()
            self.queue.push(rid, body.slo_class, float(gpus), occupancy, enqueued_at=now)
            self.waiting[rid] = Waiting(body, rid, deliver, now + hold_s if hold_s > 0 else 0.0)
        self.drain_after("a request was queued")  # it waits either way: its answer comes through ``deliver``
        return rid

    def queue_gpus(self, body: ServiceRequest, rid: str) -> int:
        """The GPUs a request costs in the fair queue: every instance's, at the degree the ``slo`` policy
        tries first (per role for a disaggregated request: ``ServiceRequest.roles``)."""
        gpus = 0
        for request, count in body.roles(rid):
            cands, _dropped = self.scheduler.candidates(request)
            gpus += (cands[0].option.gpus if cands else 1) * count
        return gpus

    def cancel(self, rid: str) -> bool:
        """A waiter gave up (its timeout): take it out of the queue; False when it was answered already.

        Decided by ``waiting``, which whoever answers a waiter (``drain``, ``_overtake``, ``expire_waiters``)
        clears under ``lock`` in the same step as delivering it: False means an answer is on its way."""
        with self.lock:
            self.queue.remove(rid)
            if self.waiting.pop(rid, None) is None:
                return False
            self.counters.decisions["queue-timeout"] += 1
            return True

    def expire_waiters(self, now: float) -> list[tuple[Waiting, Decision]]:
        """Take out of the queue what waited past the longest wait allowed (its client is gone or about to
        time out) and the answers to deliver them (no capacity). Under ``lock``; deliver after it."""
        out: list[tuple[Waiting, Decision]] = []
        for item in self.queue.expire(now, self.config.max_wait_s + 1.0):
            waiting = self.waiting.pop(item.item_id, None)
            if waiting is not None:
                self.counters.decisions["queue-timeout"] += 1
                reason = f"waited more than {self.config.max_wait_s:g} s in the admission queue"
                out.append((waiting, Decision("no-capacity", waiting.request_id, (), (reason,))))
        return out

    def drain(self) -> None:
        """Serve the queue in fair order while its head can be placed (no overtaking but the headroom's).

        ``Scheduler.place_batch``'s order (priority, then fewest GPUs) is not used here on purpose: it would
        let a small request overtake a head that does not fit yet, which the fair queue forbids. Each
        request is decided alone through ``_place``, so all-or-none and the ledger retries hold per request.

        A head that has waited its SLO class's ``cross_domain_after_s`` is decided with the cross-domain
        fallback allowed (within the class's budget share and its SLO; counted as ``cross-domain-fallback``
        when used). A head that still finds no room for its TP group gets a defragmentation plan
        (``service.defrag.plan_head``), shown in the queue view; the service never runs it. A head held
        by the headroom gets no plan (it lacks no room): the waiters behind it are tried (``_overtake``).
        """
        while True:
            served: list[tuple[Waiting, Decision]] = []  # answered behind a held head: delivered whatever happens
            try:
                step = self._serve_head(served)
            finally:
                for behind, answer in served:
                    behind.deliver(answer)
            if step is None:
                return
            step[0].deliver(step[1])

    def _serve_head(self, served: list[tuple[Waiting, Decision]]) -> tuple[Waiting, Decision] | None:
        """One step of ``drain`` under ``lock``: the head's (waiter, answer) to deliver, or None when the head
        waits or the queue is empty. Waiters answered behind a held head are appended to ``served`` as each
        is booked, so a later failure cannot lose them."""
        with self.lock:
            while True:
                head: QueuedItem | None = self.queue.peek()
                if head is None:
                    self.head_plan = None
                    return None
                waiting = self.waiting.get(head.item_id)
                if waiting is not None:
                    break
                self.queue.remove(head.item_id)  # answered already (cancelled or expired)
            self.follow()
            after = SLO_CLASSES[head.slo_class].cross_domain_after_s
            fallback = after is not None and self.clock() - head.enqueued_at >= after
            decided = self._decide(waiting, cross_domain=fallback)
            if decided.status != "no-capacity":
                self._count(decided)
                self.head_plan = None
                self.queue.pop()
                self.waiting.pop(head.item_id, None)
                return waiting, decided
            if waiting.hold_until and held_for_headroom(decided):
                self._mark_held(waiting)
                self.head_plan = None
                self._overtake(head.item_id, served)
            else:
                plan_head(self, head, waiting)
            return None

    def _decide(self, waiting: Waiting, *, cross_domain: bool) -> Decision:
        """One queued request's decision now (with the headroom while its hold lasts)."""
        headroom = self.config.keep_whole_domains if self.clock() < waiting.hold_until else 0
        try:
            return self._place(waiting.body, waiting.request_id, cross_domain=cross_domain, headroom=headroom)
        except InputError as exc:  # the request itself (its "near" was released): answer, go on
            return Decision("rejected", waiting.request_id, (), (exc.message,))

    def _mark_held(self, waiting: Waiting) -> None:
        if not waiting.held:
            waiting.held = True
            self.counters.decisions["held-for-headroom"] += 1

    def _count(self, decision: Decision) -> None:
        if any("cross-domain" in i.placement.fallbacks for i in decision.instances):
            self.counters.decisions["cross-domain-fallback"] += 1
        self.counters.decisions[decision.status] += 1

    def _overtake(self, head_id: str, served: list[tuple[Waiting, Decision]]) -> None:
        """The head is held by the headroom: serve the first waiters behind it (at most ``OVERTAKE_SCAN``
        tried) that place now within the headroom; each placed one leaves the queue and is appended to
        ``served`` at once (the caller delivers them even if a later decision raises). Under ``lock``."""
        behind = [item for item in islice(self.queue, OVERTAKE_SCAN + 1) if item.item_id != head_id]
        for item in behind[:OVERTAKE_SCAN]:
            waiting = self.waiting.get(item.item_id)
            if waiting is None:
                continue
            try:
                decision = self._place(waiting.body, waiting.request_id, headroom=self.config.keep_whole_domains)
            except InputError as exc:
                decision = Decision("rejected", waiting.request_id, (), (exc.message,))
            if decision.status == "no-capacity":
                if waiting.hold_until and held_for_headroom(decision):
                    self._mark_held(waiting)
                continue
            self._count(decision)
            self.queue.remove(item.item_id)
            del self.waiting[item.item_id]
            served.append((waiting, decision))

    def queue_view(self) -> list[dict[str, Any]]:
        with self.lock:
            now = self.clock()
            items = []
            for item in self.queue:
                view: dict[str, Any] = {
                    "id": item.item_id,
                    "slo_class": item.slo_class,
                    "gpus": item.cost_gpus,
                    "occupancy": round(item.occupancy, 4),
                    "waited_s": round(now - item.enqueued_at, 3),
                    "finish_tag": round(item.finish, 6),
                }
                waiting = self.waiting.get(item.item_id)
                if waiting is not None and waiting.hold_until:
                    view["headroom_left_s"] = round(max(0.0, waiting.hold_until - now), 3)
                    view["held_for_headroom"] = waiting.held
                head = self.head_plan
                if head is not None and head.item_id == item.item_id:
                    view["defrag"] = head.to_json(now)
                items.append(view)
            return items
