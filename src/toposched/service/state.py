"""What one service replica holds: the scheduler, the ledger, the admission queue and their stats.

Every call that touches the ledger runs on one thread: the event loop's for a local ledger (SQLite,
memory: each call takes well under a millisecond, and a hop to another thread costs more than the call),
the state's worker thread for etcd (a call waits on the network; the loop keeps answering meanwhile).
SQLite connections belong to the thread that opened them, and the scheduler's index is single-threaded
anyway; readers on other threads take ``lock``.

The ledger is the arbiter between replicas: each booking takes whole GPUs (``GuardedLedger``), so when
another replica already holds a GPU the ledger refuses, this replica resyncs its index and placements from
the ledger and decides again (``ServiceConfig.commit_retries`` times).
Replicas follow each other by reading the audit log before each decision (entries they did not cause
trigger a resync) and by a full resync every ``follow_interval_s``; any replica can read, renew and
release any placement because the ledger's reservation ``meta`` carries the whole placement record.

Failures. A request is all or none whatever fails: when anything raises while it books (a store error,
a bug, a damaged answer), what it booked is released before the error goes on; when that release fails
too, the request is recorded in ``stranded`` and released by the next successful sync. A request whose
instances are not all booked is never shown (``group``): GET answers 404 and the list leaves it out.
Any replica releases an incomplete request once all of its bookings are ``STALE_PARTIAL_S`` old (the
replica that made it died before it could clean up). The background sync (``sync``) survives any
exception: it logs it with its traceback once per distinct error, counts it, keeps the reason in
``last_error`` (what /readyz answers) and backs off (``sync_delay``) until a sync works again.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, ParamSpec, Protocol, TypeVar

from toposched.errors import InputError, LedgerConflict, StateError, ToposchedError
from toposched.ledger.base import Ledger, Reservation, capacities_from_cluster, open_ledger
from toposched.ledger.etcd import split_url
from toposched.perf.profile import set_thread_profile, use_profile
from toposched.service.config import ServiceConfig
from toposched.service.defrag import HeadPlan, plan_head
from toposched.service.ledger_guard import GuardedLedger
from toposched.service.schemas import PlaceBody
from toposched.solver.defrag import INSTANCE, MOVED_FROM, DefragLimiter
from toposched.solver.queue import FairQueue, QueuedItem
from toposched.solver.request import SLO_CLASSES, Placement, PlacementRequest, instance_ids
from toposched.solver.scheduler import DEFAULT_BUDGET_GBPS, Scheduler
from toposched.topology.model import Cluster, Health
from toposched.topology.sources import SourceRef, load_source
from toposched.topology.store import StoredTopology, TopologyStore

OWNER_PREFIX = "toposched-service"
STALE_PARTIAL_S = 600.0
"""An incomplete request (some instances booked, not all) older than this is released by any replica."""
SYNC_BACKOFF_MAX_S = 30.0
"""Longest wait between background syncs while they fail (doubling from ``follow_interval_s``)."""
REASON_CHARS = 500
"""Longest failure reason kept for /readyz (a damaged row may be large)."""
log = logging.getLogger("toposched.service")
P = ParamSpec("P")
R = TypeVar("R")


class TopologyStoreLike(Protocol):
    def save(self, cluster: Cluster, source: SourceRef, *, now: float | None = None) -> StoredTopology: ...

    def latest(self) -> StoredTopology | None: ...

    def latest_version(self) -> int | None: ...


class ServiceScheduler(Scheduler):
    """The solver's scheduler plus what a replica needs: placement records on bookings, adopt/forget."""

    guard: GuardedLedger

    def sync_index(self, held: set[str]) -> None:
        """Make the index's free set: every healthy GPU that no booking holds and that has not failed."""
        index = self.index
        nodes = self.cluster.nodes
        unhealthy = {f"{n.name}/{g.index}" for n in nodes for g in n.gpus if g.health is Health.UNAVAILABLE}
        busy = held | self.failed | unhealthy
        index.take([ref for ref in index.free if ref in busy])
        index.give([ref for ref in index.info if ref not in index.free and ref not in busy])


@dataclass
class Instance:
    """One placed instance as the service keeps it (rebuilt from the ledger on resync).

    ``slot`` is the instance id of the request it serves (``instance_ids``): the placement id itself,
    or, for a copy booked by a defragmentation move, the original's; ``moved_from`` names the copy a
    replacement replaces. While a move is in flight a slot has two copies and the old one serves.
    """

    placement: Placement
    request_id: str
    key: str
    body: dict[str, Any]
    owner: str
    expires_at: float | None
    degraded: bool = False
    slot: str = ""
    moved_from: str | None = None

    def __post_init__(self) -> None:
        if not self.slot:
            self.slot = self.placement.id


class InstanceTable(dict[str, Instance]):
    """Live instances by placement id, with a second index by request id kept in step on every change,
    so finding a request's instances (``ServiceState._members``) does not scan every instance."""

    def __init__(self) -> None:
        super().__init__()
        self._by_request: dict[str, dict[str, Instance]] = {}

    def __setitem__(self, pid: str, instance: Instance) -> None:
        old = self.get(pid)
        if old is not None:
            self._unindex(pid, old)
        super().__setitem__(pid, instance)
        self._by_request.setdefault(instance.request_id, {})[pid] = instance

    def __delitem__(self, pid: str) -> None:
        instance = self[pid]
        super().__delitem__(pid)
        self._unindex(pid, instance)

    def pop(self, pid: str, *default: Any) -> Any:
        if pid in self:
            instance = self[pid]
            del self[pid]
            return instance
        if default:
            return default[0]
        raise KeyError(pid)

    def clear(self) -> None:
        super().clear()
        self._by_request.clear()

    def _unindex(self, pid: str, instance: Instance) -> None:
        members = self._by_request.get(instance.request_id)
        if members is not None:
            members.pop(pid, None)
            if not members:
                del self._by_request[instance.request_id]

    def of_request(self, rid: str) -> list[Instance]:
        """The instances of request ``rid`` (any order)."""
        return list(self._by_request.get(rid, {}).values())


@dataclass(frozen=True)
class Decision:
    status: Literal["placed", "existing", "no-capacity", "rejected", "conflict"]
    request_id: str
    instances: tuple[Instance, ...] = ()
    reasons: tuple[str, ...] = ()


@dataclass
class Waiting:
    body: PlaceBody
    request_id: str
    deliver: Callable[[Decision], None]


@dataclass
class Stats:
    """A consistent snapshot for the metrics exporter and the web page (read under the lock)."""

    placements: list[Placement]
    degraded: int
    budget_gbps: float
    cross_used_gbps: float
    hbm_planned_bytes: int
    hbm_capacity_bytes: int
    queue_by_class: dict[str, int]
    decisions: dict[str, int]
    placed_total: int
    reports_total: int
    drift_reports: int
    migrations_proposed: int
    topology_version: int
    resyncs: int
    ledger_refusals: int
    sync_failures: int = 0


@dataclass
class Counters:
    decisions: Counter[str] = field(default_factory=Counter)
    placed_total: int = 0
    reports_total: int = 0
    drift_reports: int = 0
    migrations_proposed: int = 0
    resyncs: int = 0
    ledger_refusals: int = 0
    sync_failures: int = 0


def replica_name(config: ServiceConfig) -> str:
    return config.replica or f"{socket.gethostname()}-{os.getpid()}"


def check_policy(policy: str, cluster: Cluster) -> None:
    """``InputError`` when the policy cannot serve this cluster (exact: ``exact.size_problem``)."""
    if policy != "exact":
        return
    from toposched.solver.exact import size_problem

    problem = size_problem(f"cluster {cluster.name!r}", sum(len(n.gpus) for n in cluster.nodes))
    if problem:
        raise InputError(f"policy exact: {problem}", fix="serve with --policy slo (exact is for small clusters)")


def open_topology_store(state: str) -> TopologyStoreLike | None:
    """Where DomainMap versions live for this ledger URL (None for the in-memory ledger)."""
    scheme, _, arg = state.partition(":")
    if scheme == "sqlite":
        return TopologyStore(arg)
    if scheme == "etcd":
        from toposched.ledger.etcd_topology import EtcdTopologyStore

        split_url(arg)  # validates
        return EtcdTopologyStore(arg)
    return None


class ServiceState:
    """The scheduler, ledger and queue of one replica. ``open()`` does the I/O; the constructor none."""

    def __init__(
        self,
        config: ServiceConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        ledger_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.ledger_clock = ledger_clock
        self.owner = f"{OWNER_PREFIX}/{replica_name(config)}"
        self.lock = threading.RLock()
        # a worker thread starts with an empty context: its initializer gives it the service's profile
        self.worker = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="toposched-state",
            initializer=set_thread_profile,
            initargs=(config.profile,),
        )
        self.inline = config.state.partition(":")[0] in ("sqlite", "memory")
        """Run on the caller's thread (the event loop) instead of ``worker``."""
        self.queue = FairQueue()
        self.waiting: dict[str, Waiting] = {}
        self.instances = InstanceTable()
        self.counters = Counters()
        self.clock = clock
        self.ready = False
        self.last_error: str | None = None
        """Why the last background sync failed (None once one works): /readyz answers 503 with it."""
        self.stranded: dict[str, str] = {}
        """Request id -> body key of failed requests whose release failed too (released at the next sync)."""
        self._sweep_error: Exception | None = None
        self._failed_syncs = 0
        self._logged: tuple[str, str] | None = None
        self._scheduler: ServiceScheduler | None = None
        self._guard: GuardedLedger | None = None
        self._store: TopologyStoreLike | None = None
        self.topology: StoredTopology | None = None
        self.source: SourceRef | None = config.source
        self._seq = 0
        self.defrag_limiter = DefragLimiter(config.defrag_moves_per_window, config.defrag_window_s)
        self.head_plan: HeadPlan | None = None
        """The queue head's defragmentation plan, recomputed at most every ``defrag_plan_interval_s``."""

    # ------------------------------------------------------------------ lifecycle

    def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run ``fn`` where the state lives and wait for it (for callers outside the event loop)."""
        if self.inline:
            with use_profile(self.config.profile):
                return fn(*args, **kwargs)
        return self.worker.submit(fn, *args, **kwargs).result()

    @property
    def scheduler(self) -> ServiceScheduler:
        if self._scheduler is None:
            raise StateError("the service is not ready yet (state not loaded)")
        return self._scheduler

    @property
    def ledger(self) -> GuardedLedger:
        if self._guard is None:
            raise StateError("the service is not ready yet (state not loaded)")
        return self._guard

    def open(self) -> None:
        """Load the topology, open the ledger, register capacities and adopt what the ledger holds."""
        self._store = open_topology_store(self.config.state)
        stored = self._store.latest() if self._store is not None else None
        if self.source is not None:
            loaded = load_source(self.source)
            if stored is None or stored.cluster != loaded.cluster:
                stored = self._save(loaded.cluster, loaded.source)
        if stored is None:
            raise InputError(
                f"no topology: {self.config.state} holds no DomainMap and no source was given",
                fix="pass --preset NAME, --cluster FILE, --smi FILE or --live",
            )
        check_policy(self.config.policy, stored.cluster)
        self.topology = stored
        self.source = stored.source
        inner: Ledger = open_ledger(self.config.state, clock=self.ledger_clock)
        try:
            capacities = self._capacities(stored.cluster)
            inner.set_capacity(capacities)
            guard = GuardedLedger(inner, capacities)
            scheduler = ServiceScheduler(
                stored.cluster, ledger=guard, gpu=self.config.gpu, budget_gbps=self.config.budget_gbps
            )
        except BaseException:
            inner.close()
            raise
        scheduler.guard = guard
        self._guard, self._scheduler = guard, scheduler
        with self.lock:
            self._seq = max((e.seq for e in guard.audit(since=0)), default=0)
            self.resync()
        self.ready = True

    def _capacities(self, cluster: Cluster) -> dict[str, int]:
        default_gib = None
        if self.config.gpu is not None:
            from toposched.solver.options import gpu_type_for

            default_gib = gpu_type_for(None, self.config.gpu).memory_bytes / 1024**3
        try:
            return capacities_from_cluster(cluster, default_gib=default_gib)
        except ValueError as exc:
            raise InputError(str(exc), fix="pass --gpu TYPE (e.g. H100-SXM)") from exc

    def _save(self, cluster: Cluster, source: SourceRef) -> StoredTopology:
        if self._store is not None:
            return self._store.save(cluster, source)
        from toposched.topology.domains import build_domain_map

        return StoredTopology(0, time.time(), source, cluster, build_domain_map(cluster))

    def close(self) -> None:
        """Close the ledger and the topology store (call it on the worker: ``call(state.close)``)."""
        self.ready = False
        if self._guard is not None:
            self._guard.close()
        close = getattr(self._store, "close", None)
        if callable(close):
            close()

    def shutdown(self) -> None:
        """Close on the worker thread, then stop the worker."""
        try:
            self.call(self.close)
        finally:
            self.worker.shutdown(wait=True)

    # ------------------------------------------------------------------ following other replicas

    def follow(self) -> bool:
        """Read the audit log since the last look; resync when someone else changed the ledger.

        The position in the log moves only once the resync worked: entries read while the ledger cannot
        be read whole are read again next time, so no change is skipped.
        """
        entries = self.ledger.audit(since=self._seq)
        if not entries:
            return False
        seq = max(self._seq, max(e.seq for e in entries))
        if self.ledger.foreign(entries):
            self.resync()
            self._seq = seq
            return True
        self._seq = seq
        return False

    def resync(self) -> None:
        """Rebuild placements and the free index from the ledger's live reservations.

        Incomplete requests are released first when this replica failed to release them (``stranded``)
        or when they are ``STALE_PARTIAL_S`` old (``_sweep``).
        """
        scheduler, guard = self.scheduler, self.ledger
        live = self._sweep({r.id: r for r in guard.reservations()})
        held = {ref for r in live.values() for ref in r.gpus}
        for pid in list(scheduler.placements):
            if pid not in live:
                scheduler.forget(pid)
                self.instances.pop(pid, None)
        for pid, reservation in live.items():
            if pid in self.instances:
                self.instances[pid].expires_at = reservation.expires_at
                continue
            instance = _instance_of(reservation)
            if instance is None:
                continue  # booked by something else than the service: its GPUs are busy, that is all
            if pid not in scheduler.placements:  # a booking of ours from an unfinished decision is known
                scheduler.adopt(instance.placement, str(instance.body.get("slo_class", "interactive")))
            self.instances[pid] = instance
        scheduler.sync_index(held)
        guard.forget_own()
        self.counters.resyncs += 1

    def _sweep(self, live: dict[str, Reservation]) -> dict[str, Reservation]:
        """Release the bookings of incomplete requests that nobody will finish; returns what stays live.

        A request is incomplete when some of its instance ids are booked and others not. Released: this
        replica's bookings of a request recorded in ``stranded`` (its release failed), and every booking
        of a request whose bookings are all older than ``STALE_PARTIAL_S``. A complete request is never
        touched, whatever its age or record. A release that fails leaves the request recorded and its
        error in ``_sweep_error`` (the background sync reports it); reading the ledger goes on.
        """
        self._sweep_error = None
        left: dict[str, str] = {}
        requests: dict[tuple[str, str], list[Reservation]] = {}
        for r in live.values():
            rid, key = r.meta.get("request_id"), r.meta.get("request")
            if rid and key and "placement" in r.meta:
                requests.setdefault((rid, key), []).append(r)
        stale_before = self.ledger_clock() - STALE_PARTIAL_S
        for (rid, key), booked in requests.items():
            replicas = _replicas_in(key)
            ids = {r.meta.get(INSTANCE, r.id) for r in booked}  # a moved instance's copy serves its slot
            if replicas is None or len(ids) >= replicas:
                continue  # complete (or not a request of ours to judge)
            expected = set(instance_ids(rid, replicas))
            if not ids < expected:
                continue
            recorded = self.stranded.get(rid) == key
            if recorded:
                doomed = [r for r in booked if r.meta.get("owner") == self.owner]
            elif all(r.created_at < stale_before for r in booked):
                doomed = booked
                log.warning(
                    "releasing request %s: only %d of its %d instances are booked, all over %.0f s ago (%s)",
                    rid, len(ids), len(expected), STALE_PARTIAL_S, ", ".join(sorted(ids)),
                )  # fmt: skip
            else:
                continue
            try:
                for r in doomed:
                    self.ledger.release(r.id)
                    del live[r.id]
            except Exception as exc:
                self._sweep_error = exc
                if recorded:
                    left[rid] = key  # (a stale one is found again by age)
        self.stranded = left  # the others were released above, completed by a retry, or are gone
        return live

    def refresh_topology(self, *, probe: bool) -> StoredTopology:
        """Probe the source again (``probe``) or adopt a newer stored version; same GPUs only."""
        with self.lock:
            if probe:
                if self.source is None:
                    raise InputError("this replica has no topology source to probe", fix="start it with one")
                loaded = load_source(self.source)
                if self.topology is not None and loaded.cluster == self.topology.cluster:
                    return self.topology
                self.scheduler.update_topology(loaded.cluster)
                self.topology = self._save(loaded.cluster, loaded.source)
                return self.topology
            # compare version numbers first: parsing a stored DomainMap costs ~0.1 ms per GPU, and
            # nothing changed on almost every background tick
            store = self._store
            newest = store.latest_version() if store is not None else None
            stored = None
            if store is not None and newest is not None and (self.topology is None or newest > self.topology.version):
                stored = store.latest()
            if stored is not None and self.topology is not None and stored.version > self.topology.version:
                self.scheduler.update_topology(stored.cluster)
                self.topology = stored
            assert self.topology is not None
            return self.topology

    def sync(self) -> bool:
        """Background work: adopt other replicas' changes and new DomainMaps, then serve the queue.

        Never raises (``Exception``): a failure of any kind is counted, logged with its traceback once
        per distinct error, and kept in ``last_error`` until a sync works again. False when it failed.
        """
        try:
            with self.lock:
                self.resync()
                self.refresh_topology(probe=False)
                self.queue.expire(self.clock(), self.config.max_wait_s + 1.0)
            self.drain()
            if self._sweep_error is not None:
                raise self._sweep_error
        except Exception as exc:
            self._sync_failed(exc)
            return False
        if self._failed_syncs:
            log.info("background sync works again after %d failed tries", self._failed_syncs)
        self._failed_syncs, self._logged, self.last_error = 0, None, None
        return True

    def tick(self) -> None:
        """``sync`` for a loop that expects an exception: a ``StateError`` with the reason when it failed."""
        if not self.sync():
            raise StateError(self.last_error or "background sync failed")

    def sync_delay(self) -> float:
        """Seconds until the next background sync: the follow interval, doubling while syncs fail."""
        interval = self.config.follow_interval_s
        if not self._failed_syncs:
            return interval
        return min(interval * 2.0 ** min(self._failed_syncs, 30), max(interval, SYNC_BACKOFF_MAX_S))

    def _sync_failed(self, exc: Exception) -> None:
        self.counters.sync_failures += 1
        self._failed_syncs += 1
        reason = exc.message if isinstance(exc, ToposchedError) else f"{type(exc).__name__}: {exc}"
        if len(reason) > REASON_CHARS:
            reason = reason[: REASON_CHARS - 3] + "..."
        self.last_error = f"background sync failed: {reason}"
        fingerprint = (type(exc).__qualname__, str(exc))
        if fingerprint != self._logged:  # the same error every second would drown the log
            self._logged = fingerprint
            log.error("%s (retrying; logged again only when the error changes)", self.last_error, exc_info=exc)

    # ------------------------------------------------------------------ decisions

    def new_id(self) -> str:
        return uuid.uuid4().hex[:16]

    def place(self, body: PlaceBody) -> Decision:
        """Place every replica of ``body`` now, all or none; never waits."""
        rid = body.id or self.new_id()
        if body.replicas > self.config.max_replicas:
            raise InputError(f"replicas: at most {self.config.max_replicas} per request (got {body.replicas})")
        with self.lock:
            self.follow()
            decision = self._place(body, rid)
            self.counters.decisions[decision.status] += 1
            return decision

    def _place(self, body: PlaceBody, rid: str, *, cross_domain: bool = False) -> Decision:
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
                decided = self._attempt(body, rid, key, cross_domain=cross_domain)
                if decided is not None:
                    return decided
                self.counters.ledger_refusals += 1
                self.resync()  # another replica holds a GPU we chose (or the same id): learn it, decide again
            self._release_partial(rid, key)
        except BaseException as exc:
            if not isinstance(exc, InputError) or self._holds(rid, body.replicas):
                self._abandon(rid, key)  # (a bad request books nothing: no ledger read for it)
            raise
        return Decision("no-capacity", rid, (), ("other replicas kept taking the chosen GPUs; retry",))

    def _holds(self, rid: str, replicas: int) -> bool:
        """Whether this replica knows of a booking of request ``rid`` (placed, adopted or half-done)."""
        placements = self.scheduler.placements
        return any(pid in placements or pid in self.instances for pid in instance_ids(rid, replicas))

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

    def _attempt(self, body: PlaceBody, rid: str, key: str, *, cross_domain: bool = False) -> Decision | None:
        """One decision; None when the ledger refused a booking (the caller resyncs and retries).

        ``cross_domain``: the solver may use the cross-domain fallback (the admission queue's retry once
        the head has waited its class's ``cross_domain_after_s``); the request's key is unchanged.
        """
        scheduler, guard = self.scheduler, self.ledger
        existing = self._members(rid)
        if existing and _complete(existing) and existing[0].key == key:
            return Decision("existing", rid, tuple(_serving(existing)))
        if any(i.key != key for i in existing):
            return Decision("conflict", rid, (), (f"id {rid} is already used by another request",))
        pids = instance_ids(rid, body.replicas)
        clash = [p for p in pids if p in self.instances and self.instances[p].request_id != rid]
        if clash:
            return Decision("conflict", rid, (), (f"instance id {clash[0]} belongs to another request",))
        meta = {"request": key, "request_id": rid, "owner": self.owner}
        request = body.request(rid)
        if cross_domain:
            request = request.model_copy(update={"allow_cross_domain": True})
        try:
            outcome = scheduler.place(request, body.policy or self.config.policy, ttl_s=body.ttl_s, meta=meta)
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
            self.instances[p.id] = instance
            instances.append(instance)
        self.counters.placed_total += len(instances)
        return Decision("placed", rid, tuple(instances))

    def _release_all(self, pids: Iterable[str]) -> None:
        for pid in pids:
            if not self.scheduler.release(pid):
                self.ledger.release(pid)
            self.instances.pop(pid, None)
            self.ledger.booked.pop(pid, None)

    def _members(self, rid: str) -> list[Instance]:
        """The booked instances of request ``rid``, in replica order, whether or not all are booked."""
        found = self.instances.of_request(rid)
        return sorted(found, key=lambda i: i.placement.id)

    def group(self, rid: str) -> list[Instance]:
        """The instances of one placement request, in replica order; empty unless every one is booked.

        An incomplete request (a decision still booking on another replica, or one that failed and whose
        release failed too) is not a placement: it is never shown as placed.
        """
        found = self._members(rid)
        return _serving(found) if _complete(found) else []

    def lookup(self, rid: str) -> list[Instance]:
        """``group`` after a resync when this replica does not know the id (another replica placed it)."""
        with self.lock:
            found = self.group(rid)
            if not found:
                self.resync()
                found = self.group(rid)
            return found

    def release(self, rid: str) -> list[str] | None:
        """Release every booked instance of a request, complete or not; None when nothing is booked."""
        with self.lock:
            found = self._members(rid)
            if not found:
                self.resync()
                found = self._members(rid)
            if not found:
                return None
            pids = [i.placement.id for i in found]
            self._release_all(pids)
        self.drain()
        return pids

    def renew(self, rid: str, ttl_s: float) -> list[Instance] | None:
        with self.lock:
            found = self.lookup(rid)
            if not found:
                return None
            for instance in self._members(rid):  # a replacement booked by a move in flight too
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
        return [_serving(g) for g in groups if _complete(g)]

    # ------------------------------------------------------------------ the admission queue

    def enqueue(self, body: PlaceBody, deliver: Callable[[Decision], None]) -> str | None:
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

    # ------------------------------------------------------------------ sidecar reports

    def report(self, placement_id: str, alerts: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Mark an instance degraded from a sidecar report and propose a re-placement (not committed)."""
        from toposched.sidecar.checks import Alert
        from toposched.sidecar.loop import Report
        from toposched.sidecar.react import react

        with self.lock:
            instance = self.instances.get(placement_id)
            if instance is None:
                self.resync()
                instance = self.instances.get(placement_id)
            if instance is None:
                return None
            active = tuple(Alert(**a) for a in alerts)
            report = Report(placement_id, "", 0, (), active, 0.0)
            body = PlaceBody.model_validate(instance.body)
            request: PlacementRequest = body.request(instance.placement.request_id)
            reaction = react(report, self.scheduler, instance.placement, request, policy=body.policy or "slo")
            self.counters.reports_total += 1
            if any(a.kind == "TOPOLOGY_DRIFT" for a in active):
                self.counters.drift_reports += 1
            if reaction.proposal is not None:
                self.counters.migrations_proposed += 1
            instance.degraded = reaction.status == "degraded"
            return reaction.to_json()

    # ------------------------------------------------------------------ views

    def stats(self) -> Stats:
        with self.lock:
            scheduler = self.scheduler
            placements = list(scheduler.placements.values())
            by_class: Counter[str] = Counter(item.slo_class for item in self.queue)
            capacity = sum(self.ledger.capacities.values())
            planned = sum(p.hbm_per_gpu.total * len(p.ranks) for p in placements)
            return Stats(
                placements=placements,
                degraded=sum(1 for i in self.instances.values() if i.degraded),
                budget_gbps=scheduler.budget_gbps,
                cross_used_gbps=sum(scheduler.cross_used.values()),
                hbm_planned_bytes=planned,
                hbm_capacity_bytes=capacity,
                queue_by_class=dict(by_class),
                decisions=dict(self.counters.decisions),
                placed_total=self.counters.placed_total,
                reports_total=self.counters.reports_total,
                drift_reports=self.counters.drift_reports,
                migrations_proposed=self.counters.migrations_proposed,
                topology_version=self.topology.version if self.topology else 0,
                resyncs=self.counters.resyncs,
                ledger_refusals=self.counters.ledger_refusals,
                sync_failures=self.counters.sync_failures,
            )

    def topology_view(self) -> dict[str, Any]:
        """Nodes, NVLink domains and who holds each GPU (the web page's heat map)."""
        with self.lock:
            self.follow()
            scheduler, stored = self.scheduler, self.topology
            assert stored is not None
            holder = {ref: p.id for p in scheduler.placements.values() for ref in p.gpu_refs}
            free = scheduler.index.free
            dmap = scheduler.index.dmap
            nodes = [
                {
                    "name": n.name,
                    "rack": n.rack,
                    "zone": n.zone,
                    "gpus": [
                        {
                            "ref": f"{n.name}/{g.index}",
                            "index": g.index,
                            "model": g.model,
                            "domain": dmap.gpu_domain.get(f"{n.name}/{g.index}"),
                            "free": f"{n.name}/{g.index}" in free,
                            "placement": holder.get(f"{n.name}/{g.index}"),
                        }
                        for g in n.gpus
                    ],
                }
                for n in scheduler.cluster.nodes
            ]
            domains = [
                {
                    "id": d.id,
                    "kind": d.kind,
                    "gpus": list(d.gpus),
                    "used": sum(1 for ref in d.gpus if ref not in free),
                    "occupancy": round(sum(1 for ref in d.gpus if ref not in free) / max(d.size, 1), 4),
                }
                for d in dmap.domains
            ]
            return {
                "cluster": scheduler.cluster.name,
                "version": stored.version,
                "created_at": stored.created_at,
                "source": stored.source.describe(),
                "gpus": len(scheduler.index.info),
                "free": len(free),
                "nodes": nodes,
                "domains": domains,
            }


@functools.lru_cache(maxsize=4096)
def _replicas_in(key: str) -> int | None:
    """``replicas`` of a request body key (cached: every resync and list asks again for each request)."""
    try:
        replicas = json.loads(key).get("replicas", 1)
    except (ValueError, AttributeError):
        return None
    return replicas if isinstance(replicas, int) and 1 <= replicas <= 10_000 else None


def _serving(members: list[Instance]) -> list[Instance]:
    """One copy per instance slot, in slot order: the old copy while a move is in flight, else the only one."""
    by_slot: dict[str, list[Instance]] = {}
    for instance in members:
        by_slot.setdefault(instance.slot, []).append(instance)
    out = []
    for _slot, copies in sorted(by_slot.items()):
        ids = {c.placement.id for c in copies}
        serving = [c for c in copies if c.moved_from not in ids] or copies
        out.append(min(serving, key=lambda c: c.placement.id))
    return out


def _complete(members: list[Instance]) -> bool:
    """Whether ``members`` (one request's booked instances) hold every instance slot of the request."""
    if not members:
        return False
    first = members[0]
    replicas = _replicas_in(first.key)
    if replicas is None or any(i.key != first.key for i in members):
        return False
    return sorted({i.slot for i in members}) == sorted(instance_ids(first.request_id, replicas))


def _instance_of(reservation: Reservation) -> Instance | None:
    meta = reservation.meta
    if "placement" not in meta or "request" not in meta:
        return None
    try:
        placement = Placement.model_validate_json(meta["placement"])
        body = json.loads(meta["request"])
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    body["id"] = meta.get("request_id", placement.request_id)
    return Instance(
        placement=placement,
        request_id=meta.get("request_id", placement.request_id),
        key=meta["request"],
        body=body,
        owner=reservation.owner or meta.get("owner", ""),
        expires_at=reservation.expires_at,
        slot=meta.get(INSTANCE, placement.id),
        moved_from=meta.get(MOVED_FROM),
    )


def scheduler_from_ledger(
    cluster: Cluster, ledger: Ledger, *, gpu: str | None = None, budget_gbps: float = DEFAULT_BUDGET_GBPS
) -> tuple[ServiceScheduler, dict[str, Instance]]:
    """A scheduler holding what ``ledger`` holds, and the service's instances in it; writes nothing.

    For tools that act on a service's state without being a replica (``toposched defrag``): bookings
    go through ``GuardedLedger`` (whole GPUs, as the service books) with the capacities the ledger has.
    ``InputError`` when the ledger and the cluster disagree on the GPUs (another topology was given).
    """
    accounts = ledger.accounts()
    refs = {f"{n.name}/{g.index}" for n in cluster.nodes for g in n.gpus}
    if not accounts:
        raise InputError("the state holds no GPUs: no `toposched serve` has used it", fix="give the service's --state")
    stray = sorted(set(accounts) - refs)
    if stray:
        raise InputError(
            f"the state's GPUs are not the cluster's ({len(stray)} unknown, e.g. {stray[0]})",
            fix="give the topology the service was started with (or none: the one stored in the state)",
        )
    guard = GuardedLedger(ledger, {ref: a.capacity_bytes for ref, a in accounts.items()})
    scheduler = ServiceScheduler(cluster, ledger=guard, gpu=gpu, budget_gbps=budget_gbps)
    scheduler.guard = guard
    instances: dict[str, Instance] = {}
    for reservation in guard.reservations():
        instance = _instance_of(reservation)
        if instance is not None and set(instance.placement.gpu_refs) <= refs:
            scheduler.adopt(instance.placement, str(instance.body.get("slo_class", "interactive")))
            instances[reservation.id] = instance
    return scheduler, instances
