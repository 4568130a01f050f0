"""Deciding: place a request's instances all or none, retrying when the ledger refuses; find, renew, release.

The ledger is the arbiter between replicas: when another replica already holds a GPU this replica chose,
the ledger refuses the booking, and the replica resyncs and decides again (``ServiceConfig.commit_retries``
times). A request is all or none whatever fails: when anything raises while it books (a store error, a bug,
a damaged answer), what it booked is released before the error goes on; when that release fails too, the
request is recorded in ``stranded`` and released by the next successful sync. A request whose instances
are not all booked is never shown (``group``): GET answers 404 and the list leaves it out. A disaggregated
request (``pd``) is one request of that kind: its prefill and decode instances are booked all or none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Literal, TypeVar

from toposched.errors import InputError, LedgerConflict
from toposched.service.following import Following
from toposched.service.records import PD_PAIR, Decision, Instance, PdBooking, complete, serving
from toposched.service.replica import log
from toposched.service.request import ServiceRequest
from toposched.solver.outcome import Outcome
from toposched.solver.pd import place_pd
from toposched.solver.policies import HEADROOM_REASON
from toposched.solver.request import PlacementRequest
from toposched.solver.sizing import size_for_rate
from toposched.topology.model import Cluster

R = TypeVar("R", bound=ServiceRequest)


def held_for_headroom(decision: Decision) -> bool:
    """Whether an unplaced decision was refused by the headroom (``keep_whole_domains``) for at least
    one option the solver found room for: the request would place by breaking a wholly free domain."""
    return any(f"{HEADROOM_REASON} " in r for r in decision.reasons)


def check_policy(policy: str, cluster: Cluster) -> None:
    """``InputError`` when the policy cannot serve this cluster (exact: ``exact.size_problem``)."""
    if policy != "exact":
        return
    from toposched.solver.exact import size_problem

    problem = size_problem(f"cluster {cluster.name!r}", sum(len(n.gpus) for n in cluster.nodes))
    if problem:
        raise InputError(f"policy exact: {problem}", fix="serve with --policy slo (exact is for small clusters)")


class Deciding(Following):
    """Decisions on one request at a time, under ``lock``; each follows the ledger first."""

    def place(self, body: ServiceRequest, *, headroom: int = 0) -> Decision:
        """Place every replica of ``body`` now, all or none; never waits.

        ``headroom``: decide with at least this ``keep_whole_domains`` (the service's headroom for a
        request that may wait, ``ServiceConfig.keep_whole_domains``); the request's key is unchanged.
        """
        self.check_size(body)
        rid = body.id or self.new_id()
        with self.lock:
            self.follow()
            decision = self._place(body, rid, headroom=headroom)
            if decision.status == "no-capacity" and held_for_headroom(decision):
                return decision  # the caller queues it: counted when the queue answers
            self.counters.decisions[decision.status] += 1
            return decision

    def sized(self, body: R) -> R:
        """``body`` with ``request_rate`` turned into instances (``solver/sizing.py``): the replicas, the TP
        degree and the stages that serve the rate within the SLO with the fewest GPUs (``request_rate``
        then None: a retry of the same body sizes the same). InputError when no degree meets the SLO
        (with the changes that would)."""
        if body.request_rate is None:
            return body
        if body.pd is not None:
            raise InputError("request_rate sizes plain instances", fix="leave out pd, or request_rate")
        with self.lock:
            sizing = size_for_rate(self.scheduler, body.request(body.id or "sizing"), body.request_rate)
        cap = sizing.capacity
        # the rate is spent: what is booked (and keyed, and re-read) is the instances it asked for
        update = {"replicas": cap.replicas, "allowed_tp": (cap.tp,), "max_pp": cap.pp, "request_rate": None}
        return body.model_copy(update=update)

    def booked_answer(self, body: ServiceRequest) -> Decision | None:
        """The answer for a request whose id is booked already, without deciding: ``existing`` (the same body,
        every instance booked) or ``conflict`` (another body); None when the id is free or half booked. For
        a request about to wait in the admission queue: a retry of one that was placed is answered now."""
        if not body.id:
            return None
        with self.lock:
            self.follow()
            found = self.members(body.id)
            if not found:
                return None
            key = body.key()
            decision: Decision | None = None
            if any(i.key != key for i in found):
                decision = Decision("conflict", body.id, (), (f"id {body.id} is already used by another request",))
            elif complete(found):
                decision = Decision("existing", body.id, tuple(serving(found)))
            if decision is not None:
                self.counters.decisions[decision.status] += 1
            return decision

    def check_size(self, body: ServiceRequest) -> None:
        """``InputError`` when ``body`` asks for more instances than ``ServiceConfig.max_replicas``."""
        if body.pd is not None and body.pd.prefill + body.pd.decode > self.config.max_replicas:
            count = body.pd.prefill + body.pd.decode
            raise InputError(f"pd: at most {self.config.max_replicas} instances per request (got {count})")
        if body.replicas > self.config.max_replicas:
            raise InputError(f"replicas: at most {self.config.max_replicas} per request (got {body.replicas})")

    def _place(self, body: ServiceRequest, rid: str, *, cross_domain: bool = False, headroom: int = 0) -> Decision:
        """Decide with retries; all or none: when the answer is no instance, none of ours stays booked.

        The same holds when anything raises on the way (the store fails, a bug): what this request
        booked is released (``_abandon``) and the exception goes on.
        """
        key = body.key()
        check_policy(body.policy or self.config.policy, self.scheduler.cluster)
        if self.stranded.get(rid) == key:
            del self.stranded[rid]  # this decision takes over what the failed one left: reuse, or release
        try:
            for _attempt in range(self.config.commit_retries):
                decided = self._attempt(body, rid, key, cross_domain=cross_domain, headroom=headroom)
                if decided is not None:
                    return decided
                self.counters.ledger_refusals += 1
                self.resync()  # another replica holds a GPU we chose (or the same id): learn it, decide again
            self._release_partial(rid, key)
        except BaseException as exc:
            if not isinstance(exc, InputError) or self._holds(body.slot_ids(rid)):
                self._abandon(rid, key)  # (a bad request books nothing: no ledger read for it)
            raise
        return Decision("no-capacity", rid, (), ("other replicas kept taking the chosen GPUs; retry",))

    def _holds(self, pids: list[str]) -> bool:
        """Whether this replica knows of a booking of instances ``pids`` (placed, adopted or half-done)."""
        placements = self.scheduler.placements
        return any(pid in placements or pid in self.instances for pid in pids)

    def _abandon(self, rid: str, key: str) -> None:
        """Release what request ``rid`` booked after a failure; when that fails too, leave it to the next sync."""
        try:
            self._release_partial(rid, key)
        except Exception:
            self.stranded[rid] = key
            log.warning(
                "request %s failed and what it booked could not be released; the next successful sync releases it",
                rid,
                exc_info=True,
            )

    def _release_partial(self, rid: str, key: str) -> None:
        """Release what this replica booked for request ``rid`` (body ``key``) in attempts that did not finish.

        A refusal of replica k leaves replicas 0..k-1 booked (the retry reuses them); when the retries run
        out, they must go too. Only bookings whose record names this request, this body and this replica
        are released: another request that uses the same id, or another replica's decision, is not touched.
        """
        ours = [
            r.id
            for r in self.ledger.reservations()
            if r.meta.get("request_id") == rid and r.meta.get("request") == key and r.meta.get("owner") == self.owner
        ]
        self._release_all(ours)
        self.resync()

    def _attempt(
        self, body: ServiceRequest, rid: str, key: str, *, cross_domain: bool = False, headroom: int = 0
    ) -> Decision | None:
        """One decision; None when the ledger refused a booking (the caller resyncs and retries).

        ``cross_domain``: the solver may use the cross-domain fallback (the admission queue's retry once
        the head has waited its class's ``cross_domain_after_s``); ``headroom``: decide with at least
        this ``keep_whole_domains``. Neither changes the request's key.
        """
        scheduler, guard = self.scheduler, self.ledger
        existing = self.members(rid)
        if existing and complete(existing) and existing[0].key == key:
            return Decision("existing", rid, tuple(serving(existing)))
        if any(i.key != key for i in existing):
            return Decision("conflict", rid, (), (f"id {rid} is already used by another request",))
        pids = body.slot_ids(rid)
        clash = [p for p in pids if p in self.instances and self.instances[p].request_id != rid]
        if clash:
            return Decision("conflict", rid, (), (f"instance id {clash[0]} belongs to another request",))
        meta = {"request": key, "request_id": rid, "owner": self.owner}
        request = body.request(rid)
        if cross_domain:
            request = request.model_copy(update={"allow_cross_domain": True})
        if headroom > request.keep_whole_domains:
            request = request.model_copy(update={"keep_whole_domains": headroom})
        policy = body.policy or self.config.policy
        try:
            if body.pd is None:
                outcome = scheduler.place(request, policy, ttl_s=body.ttl_s, meta=meta)
            else:
                outcome = self._place_pd(body, request, rid, meta, policy)
        except LedgerConflict:
            return None
        if outcome.unplaced:
            self._release_all([p.id for p in outcome.placements])
            status: Literal["no-capacity", "rejected"] = (
                "rejected" if all(u.status == "rejected" for u in outcome.unplaced) else "no-capacity"
            )
            return Decision(status, rid, (), tuple(dict.fromkeys(r for u in outcome.unplaced for r in u.reasons)))
        body_json = {**json.loads(key), "id": rid}
        instances = []
        for p in outcome.placements:
            booked = guard.booked.pop(p.id, None)
            instance = Instance(p, rid, key, body_json, self.owner, booked.expires_at if booked else None)
            known = self.instances.get(p.id)  # booked by an earlier attempt, reused
            instance.pair = booked.meta.get(PD_PAIR) if booked else known.pair if known else None
            self.instances[p.id] = instance
            instances.append(instance)
        self.counters.placed_total += len(instances)
        return Decision("placed", rid, tuple(instances))

    def _place_pd(
        self, body: ServiceRequest, request: PlacementRequest, rid: str, meta: dict[str, str], policy: str
    ) -> Outcome:
        """Book a disaggregated request's prefill and decode instances (``solver.pd.place_pd``), as booked.

        The outcome's placements are those the scheduler booked (role, KV NICs, host NUMA nodes and a
        decode instance's ``near`` check in their ledger records: ``ServiceScheduler.booking_pd``), so this
        answer, any replica's rebuilt one and ``toposched plan --pd-*``'s placements carry the same checks.
        ``place_pd`` leaves booked what it placed when a later role finds no room (its
        ``unplaced``); the caller releases it, as for plain requests.
        """
        assert body.pd is not None
        scheduler = self.scheduler
        with scheduler.booking_pd(PdBooking(rid, body.pd, meta, body.ttl_s)):
            planned = place_pd(scheduler, request, body.pd.layout(), policy)
        placed = [scheduler.placements.get(p.id, p) for p in planned.outcome.placements]
        kept = {p.id for p in placed}
        for pid in body.slot_ids(rid):  # booked for a rack that did not hold its group, and released there
            if pid not in kept:
                self.ledger.booked.pop(pid, None)
        return Outcome(placements=placed, unplaced=planned.outcome.unplaced)

    def _release_all(self, pids: Iterable[str]) -> None:
        for pid in pids:
            if not self.scheduler.release(pid):
                self.ledger.release(pid)
            self.instances.pop(pid, None)
            self.ledger.booked.pop(pid, None)

    def members(self, rid: str) -> list[Instance]:
        """The booked instances of request ``rid``, in replica order, whether or not all are booked."""
        found = self.instances.of_request(rid)
        return sorted(found, key=lambda i: i.placement.id)

    def group(self, rid: str) -> list[Instance]:
        """The instances of one placement request, in replica order; empty unless every one is booked.

        An incomplete request (a decision still booking on another replica, or one that failed and whose
        release failed too) is not a placement: it is never shown as placed.
        """
        found = self.members(rid)
        return serving(found) if complete(found) else []

    def lookup(self, rid: str) -> list[Instance]:
        """``group``, after following the audit log, as a list does: another replica may have booked the id
        or released it since the last look. Only the entries since then are read (on SQLite, one pragma when
        nobody else committed), and another replica's change rebuilds the view as the background sync would.
        (A full read per unknown id, as before, let any reader make the replica read every reservation at
        will; an id it knew was answered from memory, up to a tick after another replica released it.)"""
        with self.lock:
            self.follow()
            return self.group(rid)

    def release(self, rid: str) -> list[str] | None:
        """Release every booked instance of a request, complete or not; None when nothing is booked."""
        with self.lock:
            self.follow()  # another replica may have released and booked the id again: release what is booked now
            found = self.members(rid)
            if not found:
                self.resync()
                found = self.members(rid)
            if not found:
                return None
            pids = [i.placement.id for i in found]
            self._release_all(pids)
        self.drain_after("a release")  # the GPUs freed may serve a waiting request
        return pids

    def renew(self, rid: str, ttl_s: float) -> list[Instance] | None:
        with self.lock:
            found = self.lookup(rid)
            if not found:
                return None
            for instance in self.members(rid):  # a replacement booked by a move in flight too
                renewed = self.ledger.renew(instance.placement.id, ttl_s)
                if renewed is None:
                    self.resync()
                    return None
                instance.expires_at = renewed.expires_at
            return found

    def all_groups(self) -> list[list[Instance]]:
        """Every placement (all of its instances booked), by request id, after following the ledger."""
        with self.lock:
            self.follow()
            return self.placed_groups()

    def placed_groups(self) -> list[list[Instance]]:
        """``all_groups`` as this replica knows it now (no I/O; the caller holds ``lock``)."""
        by_request: dict[str, list[Instance]] = {}
        for instance in self.instances.values():
            by_request.setdefault(instance.request_id, []).append(instance)
        groups = [sorted(v, key=lambda i: i.placement.id) for _k, v in sorted(by_request.items())]
        return [serving(g) for g in groups if complete(g)]
