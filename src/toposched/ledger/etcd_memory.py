"""What one etcd ledger object remembers between calls (``EtcdMemory``): each reservation's ``res/ID`` and
``index/ID`` and each guarded key range as last seen, so that a change can commit without reading first.

Round trips: a reserve on GPUs whose key ranges this ledger object remembers (from its earlier reads
and commits: each range with the revision it was known at) commits at once when the booking fits in
what it remembers, with each range's compare against that range's own revision; when another replica
wrote there since, the commit fails and its failure branch reads everything afresh, which is the read it
would otherwise have made first, so this never costs more round trips. Otherwise a reserve reads once
and commits once. A refusal is only ever decided on a fresh read (remembered keys may hold bytes freed
since). Every read also counts ``index/`` and ``res/`` keys, so a refusal knows without another round
trip whether a lease ran out unlogged. A release or renew of a reservation this ledger object booked
(or read) commits in one round trip: it compares the ``mod_revision`` of ``res/ID`` and ``index/ID`` it
remembers, which proves that what it remembers is current; when the compare fails, the failure branch
brings the keys as they are now.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from toposched.ledger.etcd_client import Json, KeyValue, kvs_of, raw_bytes
from toposched.ledger.etcd_keys import EtcdKeys

KNOWN_MAX = 4096  # reservations remembered per ledger object, for one-round-trip releases and renewals
RANGES_MAX = 16384  # guarded key ranges remembered per ledger object, for reserves that commit without a read
STALE_READ_FIRST = 0.5  # reserves read before committing while remembered ranges were stale this often lately
STALE_WEIGHT = 0.25  # weight of the latest reserve in that moving average


@dataclass(frozen=True)
class _Seen:
    """The keys under one guarded range as this ledger object last knew them, at ``revision``: every key
    in the range now is among ``kvs`` as long as none was written after ``revision`` (deletes only drop
    keys), which is what a commit's compare on the range checks."""

    revision: int
    kvs: tuple[KeyValue, ...]


class EtcdMemory(EtcdKeys):
    """Reservations' keys and guarded ranges as this ledger object last saw them (``EtcdLedger.__init__``
    sets the fields)."""

    _known: dict[str, tuple[KeyValue, KeyValue]]
    _ranges: dict[str, _Seen]
    _ranges_lock: threading.RLock
    _stale: float

    def _found(self, rid: str, data: Json) -> tuple[KeyValue | None, KeyValue | None]:
        """(``res/ID``, ``index/ID``) from the answer to ``_find_ops``; remembers them when both exist."""
        res, index = (kvs_of(r) for r in data["responses"][:2])
        if res and index:
            self._remember(rid, res[0], index[0])
        else:
            self._known.pop(rid, None)
        return (res[0] if res else None), (index[0] if index else None)

    def _remember(self, rid: str, res: KeyValue, index: KeyValue) -> None:
        self._known.pop(rid, None)
        self._known[rid] = (res, index)
        while len(self._known) > KNOWN_MAX:  # forget the oldest: they are read again when needed
            self._known.pop(next(iter(self._known)), None)

    def _remember_commit(self, rid: str, success: Sequence[Json], at: int, created: tuple[int, int]) -> None:
        """Remember ``rid``'s keys as a transaction committed at revision ``at`` left them (``created``:
        their create revisions, 0 when it created them); forget them when it did not write both."""
        puts = {op["requestPut"]["key"]: op["requestPut"] for op in success if "requestPut" in op}
        pair: list[KeyValue] = []
        for key, create in zip((self._res(rid), self._index(rid)), created, strict=True):
            put = puts.get(key)
            if put is None:
                self._known.pop(rid, None)
                return
            pair.append(KeyValue(key, raw_bytes(put["value"]), create or at, at, int(put.get("lease", 0))))
        self._remember(rid, pair[0], pair[1])

    def _see(self, key: str, seen: _Seen) -> None:
        with self._ranges_lock:
            self._ranges.pop(key, None)
            self._ranges[key] = seen
            while len(self._ranges) > RANGES_MAX:  # forget the oldest: they are read again when needed
                self._ranges.pop(next(iter(self._ranges)), None)

    def _remembered(self, watched: Sequence[tuple[str, bool]]) -> list[_Seen] | None:
        """What this object knows of every range in ``watched``, or None when it lacks one."""
        seen = [self._ranges.get(key) for key, _prefix in watched]
        return None if any(s is None for s in seen) else [s for s in seen if s is not None]

    def _after_commit(self, at: int, success: Sequence[Json], guarded: Mapping[str, int] | None = None) -> None:
        """Keep the remembered ranges true after a transaction committed at revision ``at``. ``guarded``:
        the ranges its compares checked, with the revision each was checked against. Such a range was
        unchanged up to ``at``, so when it is still remembered as of that revision it is now that plus the
        transaction's puts, less its deletes. A range remembered from before ``at`` where it only deleted
        loses those keys and keeps its revision (deletes cannot add bytes). Any other range it put a key in
        is forgotten, to be read again. (Another thread may have stored a range in between: only a range
        known as of the revision the change was made against is changed, so no key written in between is
        lost.)"""
        puts: dict[str, KeyValue] = {}
        deleted: set[str] = set()
        for op in success:
            if "requestPut" in op:
                put = op["requestPut"]
                key = put["key"]
                if key.startswith(self.prefix + "b/"):
                    puts[key] = KeyValue(key, raw_bytes(put["value"]), at, at, int(put.get("lease", 0)))
            elif "requestDeleteRange" in op:
                deleted.add(op["requestDeleteRange"]["key"])
        touched: dict[str, list[KeyValue]] = {}
        for key, kv in puts.items():
            for rng in self._ranges_of(key):
                touched.setdefault(rng, []).append(kv)
        for key in deleted:
            for rng in self._ranges_of(key):
                touched.setdefault(rng, [])
        guarded = guarded or {}
        with self._ranges_lock:  # another thread's _see may be evicting: no pop while it iterates
            for rng, added in touched.items():
                seen = self._ranges.get(rng)
                if seen is None:
                    continue
                if rng in guarded and seen.revision == guarded[rng]:
                    kept = tuple(kv for kv in seen.kvs if kv.key not in deleted and kv.key not in puts)
                    self._see(rng, _Seen(at, kept + tuple(added)))
                elif added or rng in guarded:
                    self._ranges.pop(rng, None)
                elif seen.revision < at and deleted & {kv.key for kv in seen.kvs}:
                    self._see(rng, _Seen(seen.revision, tuple(kv for kv in seen.kvs if kv.key not in deleted)))

    def _note_stale(self, stale: bool) -> None:
        """Follow how often the remembered ranges of a reserve that fits in them were stale (a moving average)."""
        self._stale += STALE_WEIGHT * (float(stale) - self._stale)
