"""Following the ledger and the stored DomainMap: how a replica learns what other replicas did.

The ledger is the arbiter between replicas: each booking takes whole GPUs (``GuardedLedger``), so when
another replica already holds a GPU the ledger refuses, this replica resyncs its index and placements from
the ledger and decides again. Replicas follow each other by reading the audit log (``follow``: entries they
did not cause trigger a resync) before each decision and on every background tick (``follow_interval_s``);
any replica can read, renew and release any placement because the ledger's reservation ``meta`` carries the
whole placement record. Expired leases reach the log too: reading it logs the leases that ran out.

Following costs only the new entries, so a tick with nothing changed does not grow with the cluster or the
live placements. A full resync (every live reservation read and checked) runs instead when following cannot
account for the state (``resync_due``): the last sync failed, a release of this replica waits to be retried,
an incomplete request turns stale, or ``resync_interval_s`` passed since the last full read (the safety net
for what the log does not show: a row damaged in place, a change missing from the log).

A resync also releases incomplete requests nobody will finish (``_sweep``): those whose clean-up failed on
this replica (``stranded``) and those whose bookings are all ``STALE_PARTIAL_S`` old (the replica that made
them died before it could clean up); it notes when the next one turns stale (``_stale_at``).
"""

from __future__ import annotations

import time

from toposched.errors import InputError
from toposched.ledger.base import AuditEntry, Reservation
from toposched.service.records import Instance, expected_slots, instance_of
from toposched.service.replica import ReplicaCore, log
from toposched.solver.defrag import INSTANCE
from toposched.topology.model import Cluster
from toposched.topology.sources import SourceRef, load_source
from toposched.topology.store import StoredTopology

STALE_PARTIAL_S = 600.0
"""An incomplete request (some instances booked, not all) older than this is released by any replica."""


class Following(ReplicaCore):
    """Keeps the replica's placements, free index and DomainMap in step with the shared state."""

    def follow(self) -> bool:
        """Read the audit log since the last look; resync when someone else changed the ledger.

        This replica's own changes do not count (``GuardedLedger.foreign``). The position in the log moves
        only once the resync worked: entries read while the ledger cannot be read whole are read again next
        time, so no change is skipped.
        """
        entries = self.ledger.audit(since=self._seq)
        if not entries:
            return False
        if self.ledger.foreign(entries):
            self._rebuild(entries)
            return True
        self._seq = max(self._seq, max(e.seq for e in entries))
        return False

    def resync_due(self) -> bool:
        """Whether the background tick must read every reservation (``resync``) rather than ``follow``."""
        return bool(
            self._failed_syncs  # a failed read (a damaged row) is read again until it works
            or self.stranded  # releases to retry: the sweep does them
            or self.clock() >= self._next_resync
            or (self._stale_at is not None and self.ledger_clock() > self._stale_at)
        )

    def resync(self) -> None:
        """Rebuild placements and the free index from the ledger's live reservations.

        The audit log is read first, up to where the reservations read next are sure to include its
        entries: those entries, this replica's own changes among them, are then seen, and the next
        ``follow`` starts after them. (Forgetting the record of own changes instead made the next
        ``follow`` take them for another replica's and resync once more.)
        """
        entries = self.ledger.audit(since=self._seq)
        self._rebuild(entries)
        self.ledger.foreign(entries)  # only to mark this replica's own entries as seen

    def _rebuild(self, entries: list[AuditEntry]) -> None:
        """``resync`` with the audit ``entries`` read just before; moves the log position past them.

        Incomplete requests are released first when this replica failed to release them (``stranded``)
        or when they are ``STALE_PARTIAL_S`` old (``_sweep``).
        """
        scheduler = self.scheduler
        live = self._sweep({r.id: r for r in self.ledger.reservations()})
        held = {ref for r in live.values() for ref in r.gpus}
        for pid in list(scheduler.placements):
            if pid not in live:
                scheduler.forget(pid)
                self.instances.pop(pid, None)
        for pid, reservation in live.items():
            known = self.instances.get(pid)
            if known is not None and _same_booking(known, reservation):
                known.expires_at = reservation.expires_at
                continue
            if known is not None:  # released and booked again by another replica since: another booking
                scheduler.forget(pid)
                self.instances.pop(pid, None)
            instance = instance_of(reservation)
            if instance is None:
                continue  # booked by something else than the service: its GPUs are busy, that is all
            if pid not in scheduler.placements:  # a booking of ours from an unfinished decision is known
                scheduler.adopt(instance.placement, str(instance.body.get("slo_class", "interactive")))
            self.instances[pid] = instance
        scheduler.sync_index(held)
        if entries:
            self._seq = max(self._seq, max(e.seq for e in entries))
        self.counters.resyncs += 1
        self._next_resync = self.clock() + self.config.resync_interval_s

    def _sweep(self, live: dict[str, Reservation]) -> dict[str, Reservation]:
        """Release the bookings of incomplete requests that nobody will finish; returns what stays live.

        A request is incomplete when some of its instance ids are booked and others not. Released: this
        replica's bookings of a request recorded in ``stranded`` (its release failed), and every booking
        of a request whose bookings are all older than ``STALE_PARTIAL_S``. A complete request is never
        touched, whatever its age or record. A release that fails leaves the request recorded and its
        error in ``_sweep_error`` (the background sync reports it); reading the ledger goes on. Sets
        ``_stale_at``: when the first incomplete request left alone turns stale (None when there is none).
        """
        self._sweep_error = None
        self._stale_at = None
        left: dict[str, str] = {}
        requests: dict[tuple[str, str], list[Reservation]] = {}
        for r in live.values():
            rid, key = r.meta.get("request_id"), r.meta.get("request")
            if rid and key and "placement" in r.meta:
                requests.setdefault((rid, key), []).append(r)
        stale_before = self.ledger_clock() - STALE_PARTIAL_S
        for (rid, key), booked in requests.items():
            slots = expected_slots(rid, key)  # replicas, or a disaggregated request's prefill and decode ids
            ids = {r.meta.get(INSTANCE, r.id) for r in booked}  # a moved instance's copy serves its slot
            if slots is None or len(ids) >= len(slots):
                continue  # complete (or not a request of ours to judge)
            expected = set(slots)
            if not ids < expected:
                continue
            recorded = self.stranded.get(rid) == key
            newest = max(r.created_at for r in booked)
            if recorded:
                doomed = [r for r in booked if r.meta.get("owner") == self.owner]
            elif newest < stale_before:
                doomed = booked
                log.warning(
                    "releasing request %s: only %d of its %d instances are booked, all over %.0f s ago (%s)",
                    rid, len(ids), len(expected), STALE_PARTIAL_S, ", ".join(sorted(ids)),
                )  # fmt: skip
            else:
                stale_at = newest + STALE_PARTIAL_S
                self._stale_at = stale_at if self._stale_at is None else min(self._stale_at, stale_at)
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

    def _save(self, cluster: Cluster, source: SourceRef) -> StoredTopology:
        if self._store is not None:
            return self._store.save(cluster, source)
        from toposched.topology.domains import build_domain_map

        return StoredTopology(0, time.time(), source, cluster, build_domain_map(cluster))


def _same_booking(known: Instance, reservation: Reservation) -> bool:
    """Whether the reservation is the booking this replica knows under its id: the same request and body on
    the same GPUs (an id released and booked again elsewhere in between is another booking)."""
    meta = reservation.meta
    return (
        known.key == meta.get("request")
        and known.request_id == meta.get("request_id", known.request_id)
        and set(known.placement.gpu_refs) == set(reservation.gpus)
    )
