"""The etcd ledger's leases (``EtcdLeases``): the shared etcd leases that reservations hang on, and the
``expire`` entries logged for the reservations whose lease ran out.

Leases are shared: reservations booked within about a second with the same TTL (in whole seconds)
hang their ``res/ID`` on one etcd lease, granted ``LEASE_SPARE_S`` longer than asked, so a reserve
rarely grants a lease and a release never revokes one (a lease left without keys simply runs out). A
renew moves ``res/ID`` to a current shared lease; it never keeps a lease alive, which would extend the
other reservations on it.

Leases and the audit log: only ``res/ID`` is attached to the etcd lease. Hold keys stay until the
transaction that logs the reservation's end (release, or ``expire`` once the lease is gone) deletes
them, so a reserve counts an expired reservation's bytes as held until its ``expire`` entry is
committed; when those bytes are in the way it logs the expiry first and reads again. Replaying the
audit log in ``seq`` order therefore never puts a GPU over capacity, and the log ends where the
ledger is. ``accounts()`` and ``reservations()`` count only live reservations (``res/ID`` exists).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from toposched.ledger.base import Clock
from toposched.ledger.etcd_client import Json, KeyValue, absent, count_of, delete_op, kvs_of, mod_equals, range_op
from toposched.ledger.etcd_memory import EtcdMemory

LEASE_SPARE_S = 1  # a shared lease is granted this much longer than asked, and shared while it has it to spare


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@dataclass(frozen=True)
class _SharedLease:
    """An etcd lease that reservations asking the same TTL share while it has ``LEASE_SPARE_S`` to spare."""

    id: int
    stamp: float  # the ledger's clock, read before the grant
    born: float  # time.monotonic(), read before the grant
    granted_s: int  # the TTL etcd granted

    def fits(self, ttl_s: float) -> bool:
        """Whether the lease still lasts ``ttl_s`` from now."""
        return time.monotonic() - self.born + ttl_s <= self.granted_s

    def expires_at(self, now: float, ttl_s: float) -> float:
        """What a reservation of ``ttl_s`` booked ``now`` reports: never after the lease's real end."""
        return min(now + ttl_s, self.stamp + self.granted_s)


class EtcdLeases(EtcdMemory):
    """Shared leases and the logging of their ends (``EtcdLedger.__init__`` sets the fields)."""

    _clock: Clock
    _leases: dict[int, _SharedLease]
    _lease_lock: threading.Lock

    def _lease(self, ttl_s: float) -> _SharedLease:
        """A shared lease that lasts ``ttl_s`` from now: the current one for this TTL, or a new grant."""
        want = max(1, math.ceil(ttl_s))
        with self._lease_lock:
            lease = self._leases.get(want)
            if lease is None or not lease.fits(ttl_s):
                stamp, born = self._clock(), time.monotonic()  # read before the grant: never late
                lease_id, granted = self.client.grant(want + LEASE_SPARE_S)
                lease = self._leases[want] = _SharedLease(lease_id, stamp, born, granted)
            return lease

    def _lease_gone(self, lease: _SharedLease) -> None:
        """etcd no longer knows ``lease`` (it ran out, say while etcd was down): grant a new one next."""
        with self._lease_lock:
            for want in [want for want, held in self._leases.items() if held == lease]:
                del self._leases[want]

    # ------------------------------------------------------------------------------ expiry

    def _log_expiry(self, index: KeyValue) -> bool:
        """Log ``expire`` for a reservation whose lease is gone, and free its bytes (one transaction)."""
        old = self._reservation(index)
        self._known.pop(old.id, None)
        compare = [absent(self._res(old.id)), mod_equals(index.key, index.mod_revision)]
        success = [delete_op(index.key), *(delete_op(key) for key in self._hold_keys(old.id, old.gpus))]
        success.append(self._audit_op("expire", old, at=old.expires_at or self._clock()))
        committed, data = self.client.txn(compare, success)
        if committed:
            self._after_commit(int(data["header"]["revision"]), success)
        return committed

    def _sweep_ids(self, ids: set[str]) -> int:
        """Log the expiry of those of ``ids`` whose lease is gone; how many were logged."""
        logged = 0
        for chunk in _chunks(sorted(ids), 50):
            reads: list[Json] = []
            for rid in chunk:
                reads += [range_op(self._res(rid), keys_only=True), range_op(self._index(rid))]
            _ok, data = self.client.txn([], reads)
            for i in range(len(chunk)):
                live, index = kvs_of(data["responses"][2 * i]), kvs_of(data["responses"][2 * i + 1])
                if not live and index:
                    logged += self._log_expiry(index[0])
        return logged

    def _sweep_reads(self) -> list[Json]:
        """Counts of ``index/`` and ``res/`` keys: equal when no lease ran out unlogged (both are written
        and deleted together; only a lease's end removes ``res/ID`` alone), so a sweep with nothing to do
        reads two numbers, not every reservation's keys. (A damaged ``res/ID`` without its ``index/ID``
        could hide one unlogged expiry; ``reserve`` still logs any expiry whose bytes it needs.)"""
        return [
            range_op(f"{self.prefix}index/", prefix=True, count_only=True),
            range_op(f"{self.prefix}res/", prefix=True, count_only=True),
        ]

    def _sweep_answer(self, data: Json) -> int:
        """Log ``expire`` for the reservations without a lease, when the answer to ``_sweep_reads``
        shows there are some."""
        if count_of(data["responses"][0]) == count_of(data["responses"][1]):
            return 0
        _ok, data = self.client.txn(
            [],
            [
                range_op(f"{self.prefix}index/", prefix=True, keys_only=True),
                range_op(f"{self.prefix}res/", prefix=True, keys_only=True),
            ],
        )
        index = self._names(kvs_of(data["responses"][0]), "index")
        live = self._names(kvs_of(data["responses"][1]), "res")
        return self._sweep_ids(index - live) if index - live else 0

    def sweep(self) -> int:
        """Log ``expire`` for every reservation whose lease ran out; how many were logged."""
        return self._sweep_answer(self.client.txn([], self._sweep_reads())[1])
