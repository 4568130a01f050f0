"""The admission queue: requests that found no capacity wait in fair order, strictly (no overtaking).

The queue is ``solver.queue.FairQueue`` (weighted fair queueing by SLO class); this module adds what a
replica does with it: each waiter's answer is delivered through a callback (the HTTP layer's future), the
queue is served on every release and every background sync (``drain``), and a head that still finds no
room for its TP group gets a defragmentation plan (``service.defrag.plan_head``), shown, never run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from toposched.errors import InputError
from toposched.service.deciding import Deciding
from toposched.service.defrag import plan_head
from toposched.service.records import Decision
from toposched.service.request import ServiceRequest
from toposched.solver.queue import QueuedItem
from toposched.solver.request import SLO_CLASSES


@dataclass
class Waiting:
    """A queued request and where its answer goes."""

    body: ServiceRequest
    request_id: str
    deliver: Callable[[Decision], None]


class Admission(Deciding):
    """Queue, serve in fair order, cancel on timeout; the queue's view with the head's defrag plan."""

    def enqueue(self, body: ServiceRequest, deliver: Callable[[Decision], None]) -> str | None:
        """Queue a request that found no capacity; returns its id, or None when the queue is full."""
        rid = body.id or self.new_id()
        with self.lock:
            if len(self.queue) >= self.config.max_queue:
                self.counters.decisions["queue-full"] += 1
                return None
            if rid in self.queue:
                raise InputError(f"id: {rid} is already waiting in the queue")
            request = body.request(rid)
            cands, _dropped = self.scheduler.candidates(request)
            gpus = cands[0].option.gpus * body.replicas if cands else body.replicas
            largest = max(self.scheduler.index.levels["nvlink"].largest_group(), 1)
            occupancy = min(1.0, gpus / largest)
            self.queue.push(rid, request.slo_class, float(gpus), occupancy, enqueued_at=self.clock())
            self.waiting[rid] = Waiting(body, rid, deliver)
        self.drain()
        return rid

    def cancel(self, rid: str) -> bool:
        """A waiter gave up (its timeout): take it out of the queue; False when it was served already."""
        with self.lock:
            self.waiting.pop(rid, None)
            if self.queue.remove(rid) is None:
                return False
            self.counters.decisions["queue-timeout"] += 1
            return True

    def drain(self) -> None:
        """Serve the queue in fair order while its head can be placed (strict order: no overtaking).

        ``Scheduler.place_batch``'s order (priority, then fewest GPUs) is not used here on purpose: it would
        let a small request overtake a head that does not fit yet, which the fair queue forbids. Each
        request is decided alone through ``_place``, so all-or-none and the ledger retries hold per request.

        A head that has waited its SLO class's ``cross_domain_after_s`` is decided with the cross-domain
        fallback allowed (within the class's budget share and its SLO; counted as ``cross-domain-fallback``
        when used). A head that still finds no room for its TP group gets a defragmentation plan
        (``service.defrag.plan_head``), shown in the queue view; the service never runs it.
        """
        while True:
            with self.lock:
                head: QueuedItem | None = self.queue.peek()
                if head is None:
                    self.head_plan = None
                    return
                waiting = self.waiting.get(head.item_id)
                if waiting is None:
                    self.queue.remove(head.item_id)
                    continue
                self.follow()
                after = SLO_CLASSES[head.slo_class].cross_domain_after_s
                fallback = after is not None and self.clock() - head.enqueued_at >= after
                try:
                    decision = self._place(waiting.body, waiting.request_id, cross_domain=fallback)
                except InputError as exc:  # the request itself (its "near" was released): answer, go on
                    decision = Decision("rejected", waiting.request_id, (), (exc.message,))
                if decision.status == "no-capacity":
                    plan_head(self, head, waiting)
                    return
                if any("cross-domain" in i.placement.fallbacks for i in decision.instances):
                    self.counters.decisions["cross-domain-fallback"] += 1
                self.head_plan = None
                self.queue.pop()
                self.waiting.pop(head.item_id, None)
                self.counters.decisions[decision.status] += 1
            waiting.deliver(decision)

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
                head = self.head_plan
                if head is not None and head.item_id == item.item_id:
                    view["defrag"] = head.to_json(now)
                items.append(view)
            return items
