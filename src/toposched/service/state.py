"""One service replica: ``ServiceState`` opens the state, runs the background sync, and is the API's domain.

It is assembled from one class per job (``replica.py`` lists them: following the ledger and the stored
DomainMap, deciding, the admission queue, reports and views); this module adds opening and closing, and
the background sync that ties the jobs together every ``follow_interval_s``. The sync follows the audit log
(only new entries are read) and resyncs in full only when ``Following.resync_due`` says so, so its work
does not grow with the cluster or the live placements when nothing changed.

Failures. The background sync (``sync``) survives any exception: it logs it with its traceback once per
distinct error, counts it, keeps the reason in ``last_error`` (what /readyz answers) and backs off
(``sync_delay``) until a sync works again. A request is all or none whatever fails (``deciding.py``).
"""

from __future__ import annotations

from toposched.errors import InputError, StateError, ToposchedError
from toposched.ledger.base import Ledger, capacities_from_cluster, open_ledger
from toposched.ledger.etcd_keys import split_url
from toposched.service.admission import Admission, Waiting
from toposched.service.deciding import check_policy
from toposched.service.ledger_guard import GuardedLedger
from toposched.service.records import Decision, ServiceScheduler
from toposched.service.replica import log
from toposched.service.views import Reporting
from toposched.topology.model import Cluster
from toposched.topology.sources import load_source
from toposched.topology.store import DomainMapStore, TopologyStore

__all__ = ["ServiceState", "open_topology_store"]

SYNC_BACKOFF_MAX_S = 30.0
"""Longest wait between background syncs while they fail (doubling from ``follow_interval_s``)."""
REASON_CHARS = 500
"""Longest failure reason kept for /readyz (a damaged row may be large)."""


def open_topology_store(state: str) -> DomainMapStore | None:
    """Where DomainMap versions live for this ledger URL (None for the in-memory ledger)."""
    scheme, _, arg = state.partition(":")
    if scheme == "sqlite":
        return TopologyStore(arg)
    if scheme == "etcd":
        from toposched.ledger.etcd_topology import EtcdTopologyStore

        split_url(arg)  # validates
        return EtcdTopologyStore(arg)
    return None


class ServiceState(Admission, Reporting):
    """The scheduler, ledger and queue of one replica. ``open()`` does the I/O; the constructor none."""

    def open(self) -> None:
        """Load the topology, open the ledger, register capacities and adopt what the ledger holds."""
        self._state_checked_at = self.clock()  # opening the ledger runs the checks ``_check_state`` repeats
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

    def close(self) -> None:
        """Close the ledger and the topology store (call it on the worker: ``call(state.close)``)."""
        self.ready = False
        if self._guard is not None:
            self._guard.close()
        if self._store is not None:
            self._store.close()

    def shutdown(self) -> None:
        """Close on the worker thread, then stop the worker."""
        try:
            self.call(self.close)
        finally:
            self.worker.shutdown(wait=True)

    def sync(self) -> bool:
        """Background work: adopt other replicas' changes and new DomainMaps, then serve the queue.

        Other replicas' changes and expired leases come from following the audit log; every reservation
        is read only when a full resync is due (``resync_due``: after a failure, with releases to retry,
        when an incomplete request turns stale, every ``resync_interval_s``).

        Never raises (``Exception``): a failure of any kind is counted, logged with its traceback once
        per distinct error, and kept in ``last_error`` until a sync works again. False when it failed.
        """
        try:
            expired: list[tuple[Waiting, Decision]] = []
            try:
                with self.lock:
                    expired = self.expire_waiters(self.clock())  # answered below, whatever happens next
                    if self.resync_due():
                        self.resync()
                    else:
                        self.follow()
                    self._check_state()
                    self.refresh_topology(probe=False)
            finally:
                for waiting, answer in expired:
                    waiting.deliver(answer)
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

    def write_problem(self) -> str | None:
        """Why the last write to the ledger failed, until one works again (None: writes work)."""
        return self._guard.write_problem if self._guard is not None else None

    def _check_state(self) -> None:
        """Every ``resync_interval_s``, the checks a new process runs at open (``check`` of the SQLite ledger:
        ``integrity_check`` and every row's checksum), so a row damaged under a running service makes /readyz
        answer 503 as it makes every new process refuse the file (issue 37). Raises what the check finds."""
        now = self.clock()
        if now - self._state_checked_at < self.config.resync_interval_s:
            return
        self._state_checked_at = now
        check = getattr(self.ledger.inner, "check", None)  # SQLite's; etcd checks on the server
        if check is not None:
            check()

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
