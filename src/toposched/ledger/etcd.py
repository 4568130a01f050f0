"""The ledger for several scheduler replicas: etcd, through its gRPC API (``etcd_grpc``) or its v3 JSON gateway.

The key layout is in ``etcd_keys``; what a ledger object remembers between calls (and the round trips that
saves) in ``etcd_memory``; shared leases and the logging of their ends in ``etcd_leases``.

Transactions stay within etcd's defaults (128 operations, 1.5 MiB) at any cluster and reservation
size. A small reservation reads, compares and writes per GPU (2 + 2 x 32 compares at most); a large
one per bucket it touches (2 + 64). ``set_capacity`` writes in chunks of 100 GPUs, only the GPUs
whose capacity changed, so it is idempotent and simply redone after a crash half-way.

Why it is exact: ``reserve`` knows the capacity and holds of the GPUs it books, each key range as of
a revision R (one read at one revision, or ranges it remembers, each at its own), checks the fit, then
commits a transaction whose compares say "``res/ID`` and ``index/ID`` do not exist" and, per range,
"nothing under these keys was written after R": per GPU (``b/BB/g/REF/``) and per bucket
(``b/BB/all/``) for a small reservation, per bucket (``b/BB/``, which holds both) for a large one. Any
booking on those GPUs, or capacity change, after R fails the compare; the reserve reads again and
retries. Deletes (release, logged expiry) only free bytes, so missing one between the read and the
commit can refuse too much, never book too much; that is also why a remembered range stays usable after
this object's own deletes, and is updated after its own commits only when it was known as of the revision
the commit was checked against.

Leases are etcd's: whole seconds, at least etcd's minimum (about 2 s), kept by etcd's clock, so the
clock given to ``open_ledger`` only stamps times (``Feature.CLOCK`` is unsupported). ``expires_at`` is
the clock read before the commit plus the TTL asked for, capped at the clock read *before* the lease was
granted plus its TTL, so never after the lease's real end; the lease outlives it by at most about two
seconds (the spare second and etcd's whole seconds). A call made while etcd is down raises
``StateError``; a ``reserve`` whose answer was lost is retried safely with the same id (idempotent).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ClassVar

from pydantic import ValidationError

from toposched.errors import EtcdError, StateError
from toposched.ledger.base import (
    AuditEntry,
    Clock,
    Feature,
    GpuAccount,
    Reservation,
    ReserveResult,
    judge,
    validate_request,
    wall_clock,
)
from toposched.ledger.etcd_client import (
    ETCD_MAX_REQUEST_BYTES,
    Json,
    KeyValue,
    absent,
    delete_op,
    kvs_of,
    mod_equals,
    op_bytes,
    put_op,
    range_op,
    unchanged_since,
)
from toposched.ledger.etcd_keys import SMALL_MAX, _Holds, split_url
from toposched.ledger.etcd_leases import EtcdLeases, _SharedLease
from toposched.ledger.etcd_memory import STALE_READ_FIRST, _Seen
from toposched.ledger.etcd_transport import Transport, connect

LAYOUT = "2"
CAPACITY_CHUNK = 100  # capacity keys per transaction
CHUNK_BYTES = 512 * 1024  # and at most about this many bytes
SEQ_PER_REVISION = 16  # audit seq = revision * 16 + position in the transaction
MAX_ATTEMPTS = 200
FRESH_READS_AFTER = 3  # lost races answered from the failure branch; later ones back off and read again


class EtcdLedger(EtcdLeases):
    """A ledger shared by scheduler replicas through etcd. The constructor does no I/O."""

    UNSUPPORTED: ClassVar[Mapping[Feature, str]] = {
        Feature.CLOCK: "leases expire by etcd's own clock, in whole seconds",
    }

    def __init__(
        self,
        url: str,
        *,
        clock: Clock = wall_clock,
        timeout_s: float = 5.0,
        max_request_bytes: int = ETCD_MAX_REQUEST_BYTES,
        transport: Transport | None = None,
    ) -> None:
        endpoint, namespace = split_url(url)
        self.url = url
        self.client = connect(endpoint, timeout_s=timeout_s, transport=transport)
        self._clock = clock
        self.prefix = f"/{namespace}/ledger/"
        self.max_request_bytes = max_request_bytes
        self._leases: dict[int, _SharedLease] = {}  # by the TTL asked for, in whole seconds
        self._lease_lock = threading.Lock()
        self._known: dict[str, tuple[KeyValue, KeyValue]] = {}  # id -> (res/ID, index/ID) as last seen
        self._ranges: dict[str, _Seen] = {}  # guarded range (a key prefix) -> its keys as last seen
        self._ranges_lock = threading.RLock()  # _after_commit holds it around its _see calls
        self._stale = 0.0  # how often remembered ranges were stale lately (0-1): reserves read first past a half

    @staticmethod
    def _backoff(attempt: int) -> None:
        time.sleep(random.uniform(0, 0.002 * min(attempt, 10)))

    # ------------------------------------------------------------------------------ capacity and reads

    def set_capacity(self, capacities: Mapping[str, int]) -> None:
        for ref, cap in capacities.items():
            if not isinstance(cap, int) or cap < 0:
                raise ValueError(f"capacity of {ref} must be an integer >= 0 (got {cap!r})")
        if not capacities:
            return
        _ok, data = self.client.txn(
            [],
            [
                range_op(f"{self.prefix}format"),
                range_op(f"{self.prefix}cap/", prefix=True, keys_only=True, limit=1),
                range_op(f"{self.prefix}b/", prefix=True),
            ],
        )
        fmt, old, current = (kvs_of(r) for r in data["responses"])
        if old or (fmt and fmt[0].value.decode() != LAYOUT):
            found = "the layout before 2" if old else f"layout {fmt[0].value.decode()}"
            raise StateError(
                f"etcd at {self.client.endpoint}: {self.prefix} holds a ledger in another key layout "
                f"({found}; this toposched writes {LAYOUT})",
                fix="give the ledger a new namespace (etcd:http://HOST:PORT/NAME), or release everything and "
                f"`etcdctl del --prefix {self.prefix}`",
            )
        existing = self._holds(current).caps
        self._ranges.clear()  # capacities change below: read the ranges again
        changed = [(ref, cap) for ref, cap in capacities.items() if existing.get(ref) != cap]
        ops = [] if fmt else [put_op(f"{self.prefix}format", LAYOUT)]
        for ref, cap in changed:  # chunks by count and bytes: each one a transaction, redone safely
            op = put_op(self._gpu(ref) + "cap", str(cap))
            if len(ops) >= CAPACITY_CHUNK or op_bytes([*ops, op]) > CHUNK_BYTES:
                self.client.txn([], ops)
                ops = []
            ops.append(op)
        if ops:
            self.client.txn([], ops)

    def accounts(self) -> dict[str, GpuAccount]:
        _ok, data = self.client.txn(
            [], [range_op(f"{self.prefix}b/", prefix=True), range_op(f"{self.prefix}res/", prefix=True, keys_only=True)]
        )
        holds = self._holds(kvs_of(data["responses"][0]))
        live = self._names(kvs_of(data["responses"][1]), "res")
        reserved: dict[str, int] = {}
        for rid in holds.by_id.keys() & live:
            for ref, b in holds.by_id[rid].items():
                reserved[ref] = reserved.get(ref, 0) + b
        return {
            ref: GpuAccount(ref=ref, capacity_bytes=cap, reserved_bytes=reserved.get(ref, 0))
            for ref, cap in holds.caps.items()
        }

    def _find(self, rid: str) -> tuple[KeyValue | None, KeyValue | None]:
        """(``res/ID``, ``index/ID``) as they are now."""
        _ok, data = self.client.txn([], self._find_ops(rid))
        return self._found(rid, data)

    def _last_seen(self, rid: str) -> tuple[KeyValue | None, KeyValue | None]:
        """What this object last saw of ``rid`` (a commit's compares check it is current), else a read."""
        known = self._known.get(rid)
        return known if known is not None else self._find(rid)

    def get(self, rid: str) -> Reservation | None:
        res, index = self._find(rid)
        return self._reservation(index) if res is not None and index is not None else None

    def reservations(self) -> list[Reservation]:
        _ok, data = self.client.txn(
            [],
            [
                range_op(f"{self.prefix}res/", prefix=True, keys_only=True),
                range_op(f"{self.prefix}index/", prefix=True),
            ],
        )
        live = self._names(kvs_of(data["responses"][0]), "res")
        found = [self._reservation(kv) for kv in kvs_of(data["responses"][1])]
        return [r for r in found if r.id in live]

    # ------------------------------------------------------------------------------ changes

    def reserve(
        self,
        rid: str,
        gpus: Mapping[str, int],
        *,
        ttl_s: float | None = None,
        owner: str = "",
        meta: Mapping[str, str] | None = None,
    ) -> ReserveResult:
        problem = validate_request(gpus, ttl_s)
        if problem:
            return ReserveResult(status="invalid", reasons={"request": problem})
        draft = Reservation(
            id=rid, gpus=dict(gpus), owner=owner, created_at=self._clock(), expires_at=None, meta=dict(meta or {})
        )
        watched = self._watched(gpus)
        base = self._find_ops(rid) + [range_op(key, prefix=prefix) for key, prefix in watched]
        size = 0
        if self._size_bound(draft) > self.max_request_bytes - 4096:  # then measure it exactly
            booking = self._booking(draft, 0, [0] * len(watched))
            size = op_bytes([*booking[0], *booking[1], *base])
        if size > self.max_request_bytes - 4096:
            reason = (
                f"{len(gpus)} GPUs in one reservation make a {size}-byte etcd transaction, over etcd's request "
                f"limit ({self.max_request_bytes} bytes, --max-request-bytes)"
            )
            return ReserveResult(status="invalid", reasons={"request": reason})
        # Every read, and a commit's failure branch, also counts the ``index/`` and ``res/`` keys (equal
        # when no lease ran out unlogged), so a refusal knows without another round trip whether bytes of
        # a holder whose lease ran out are in its way.
        reads = base + self._sweep_reads()
        # When this object remembers every range and the booking fits in them, it commits at once: one round
        # trip when they are current; when not, the failed commit's failure branch was the read it would
        # have made first, so it never costs more round trips than reading first. It refuses only on a
        # fresh read (remembered keys may hold bytes freed since).
        # Under contention (other replicas booking the same GPUs between two of this object's reserves) what it
        # remembers is mostly stale, and a commit that fails its compares is a raft proposal for etcd, where a
        # read is not: then it reads first (``_stale``, below). The same number of round trips either way.
        remembered = self._remembered(watched)
        in_memory = None if remembered is None else self._holds([kv for seen in remembered for kv in seen.kvs])
        data: Json | None = None
        from_memory = in_memory is not None and self._fits(in_memory, gpus)
        if not from_memory or self._stale >= STALE_READ_FIRST:
            _ok, data = self.client.txn([], reads)
            if from_memory and remembered is not None:  # would the commit from memory have gone through?
                fresh = [kvs_of(r) for r in data["responses"][2 : len(base)]]
                self._note_stale(
                    any(
                        kv.mod_revision > seen.revision
                        for seen, kvs in zip(remembered, fresh, strict=True)
                        for kv in kvs
                    )
                )
        for attempt in range(MAX_ATTEMPTS):
            index: KeyValue | None = None
            memory_commit = data is None
            if data is None:  # remembered: whether the id is taken is left to the commit's compares
                assert remembered is not None and in_memory is not None
                revisions = [seen.revision for seen in remembered]
                holds = in_memory
            else:
                revision = int(data["header"]["revision"])
                found, index = self._found(rid, data)
                if found is not None and index is None:
                    raise self._damaged(found.key, KeyError(f"no {self._index(rid)} next to it"))
                if index is not None and found is None:  # an expired reservation under this id, end not logged
                    self._log_expiry(index)
                    _ok, data = self.client.txn([], reads)
                    continue
                ranges = [kvs_of(r) for r in data["responses"][2 : len(base)]]
                for (key, _prefix), kvs in zip(watched, ranges, strict=True):
                    self._see(key, _Seen(revision, tuple(kvs)))
                revisions = [revision] * len(watched)
                holds = self._holds([kv for kvs in ranges for kv in kvs])
            touched = {
                ref: GpuAccount(ref=ref, capacity_bytes=holds.caps[ref], reserved_bytes=holds.used(ref))
                for ref in gpus
                if ref in holds.caps
            }
            refusal = judge(rid, gpus, self._reservation(index) if index is not None else None, touched)
            if refusal is not None:
                if data is None:  # remembered keys may hold bytes freed since: refuse only on a fresh read
                    _ok, data = self.client.txn([], reads)
                    continue
                # bytes of reservations whose lease ran out count until their expiry is logged
                counts = {"responses": data["responses"][len(base) :]}
                if refusal.status == "insufficient" and self._sweep_answer(counts):
                    _ok, data = self.client.txn([], reads)
                    continue
                return refusal
            lease = None if ttl_s is None else self._lease(ttl_s)
            now = self._clock()
            expires_at = None if lease is None or ttl_s is None else lease.expires_at(now, ttl_s)
            reservation = draft.model_copy(update={"created_at": now, "expires_at": expires_at})
            compare, success = self._booking(reservation, 0 if lease is None else lease.id, revisions)
            try:
                committed, data = self.client.txn(compare, success, reads)  # lost: the failure branch reads again
            except EtcdError as exc:
                if exc.code != 5 or lease is None:  # NotFound: the shared lease ran out (etcd was down)
                    raise
                self._lease_gone(lease)
                _ok, data = self.client.txn([], reads)
                continue
            if memory_commit:
                self._note_stale(not committed)
            if committed:
                at = int(data["header"]["revision"])
                self._remember_commit(rid, success, at, (0, 0))
                self._after_commit(at, success, {key: rev for (key, _p), rev in zip(watched, revisions, strict=True)})
                return ReserveResult(status="reserved", reservation=reservation)
            if attempt >= FRESH_READS_AFTER:  # many lost races: let the others through, then read afresh
                self._backoff(attempt)
                _ok, data = self.client.txn([], reads)
        raise StateError(
            f"etcd at {self.client.endpoint}: reserve {rid} lost {MAX_ATTEMPTS} races in a row",
            fix="too many replicas booking the same GPUs at once; retry with the same id",
        )

    def _size_bound(self, reservation: Reservation) -> int:
        """An upper bound on the bytes (``op_bytes``) of a small reservation's transaction, cheaper than building
        it: at most 5n + 9 operations (compares, writes and the failure branch's reads), each 16 bytes with a key
        and a range end of at most 12 bytes per character of the namespace, id and longest ref (a character is at
        most 4 bytes of UTF-8, each percent-encoded in 3) and 64 more; two JSON values (the index and audit
        entries) of at most 12 bytes per character of id, owner, refs and meta (escapes), 64 per GPU and 512
        more; 20 bytes per GPU of held bytes. A large reservation gets no bound: its size is measured."""
        n = len(reservation.gpus)
        if n > SMALL_MAX:
            return self.max_request_bytes
        key = 12 * (len(self.prefix) + len(reservation.id) + max(map(len, reservation.gpus), default=0)) + 64
        text = len(reservation.id) + len(reservation.owner) + sum(map(len, reservation.gpus))
        text += sum(len(k) + len(v) for k, v in reservation.meta.items())
        return (5 * n + 9) * (16 + 2 * key) + 2 * (12 * text + 64 * n + 512) + 20 * n

    @staticmethod
    def _fits(holds: _Holds, gpus: Mapping[str, int]) -> bool:
        return all(ref in holds.caps and holds.caps[ref] - holds.used(ref) >= b for ref, b in gpus.items())

    def _booking(self, reservation: Reservation, lease: int, revisions: Sequence[int]) -> tuple[list[Json], list[Json]]:
        """The compares and writes that book ``reservation``; its guarded ranges (``_watched``) were read
        at ``revisions``."""
        rid = reservation.id
        compare = [absent(self._res(rid)), absent(self._index(rid))]
        watched = self._watched(reservation.gpus)
        compare += [
            unchanged_since(key, revision, prefix=prefix)
            for (key, prefix), revision in zip(watched, revisions, strict=True)
        ]
        success = [put_op(key, value) for key, value in self._hold_keys(rid, reservation.gpus).items()]
        success += [
            put_op(self._res(rid), json.dumps({"lease": lease}), lease=lease),
            put_op(self._index(rid), reservation.model_dump_json()),
            self._audit_op("reserve", reservation, at=reservation.created_at),
        ]
        return compare, success

    def _change(
        self, rid: str, write: Callable[[KeyValue, KeyValue], tuple[list[Json], Reservation | None]]
    ) -> tuple[bool, Reservation | None]:
        """Commit ``write(res, index)`` for the live reservation ``rid``, guarded by the ``mod_revision``s
        of both keys: (False, None) when it is gone (its expiry logged if due), else (True, what ``write``
        returned). Starts from what this object last saw of ``rid``, so it is one round trip when that is
        current; a lost compare brings the keys as they are now, and it tries again."""
        res, index = self._last_seen(rid)
        for attempt in range(MAX_ATTEMPTS):
            if res is None or index is None:
                if index is not None:
                    self._log_expiry(index)
                self._known.pop(rid, None)
                return False, None
            compare = [mod_equals(res.key, res.mod_revision), mod_equals(index.key, index.mod_revision)]
            created = (res.create_revision, index.create_revision)
            success, changed = write(res, index)
            committed, data = self.client.txn(compare, success, self._find_ops(rid))
            if committed:
                at = int(data["header"]["revision"])
                self._remember_commit(rid, success, at, created)
                self._after_commit(at, success)
                return True, changed
            res, index = self._found(rid, data)
            if attempt >= FRESH_READS_AFTER:
                self._backoff(attempt)
                res, index = self._find(rid)
        raise StateError(
            f"etcd at {self.client.endpoint}: a change to {rid} lost {MAX_ATTEMPTS} races in a row",
            fix="too many replicas changing the same reservation at once; retry",
        )

    def renew(self, rid: str, ttl_s: float) -> Reservation | None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive (got {ttl_s})")
        leases: list[_SharedLease] = []

        def write(res: KeyValue, index: KeyValue) -> tuple[list[Json], Reservation | None]:
            lease = self._lease(ttl_s)
            leases[:] = [lease]
            now = self._clock()
            renewed = self._reservation(index).model_copy(update={"expires_at": lease.expires_at(now, ttl_s)})
            value = json.dumps({"lease": lease.id})
            ops = [put_op(res.key, value, lease=lease.id), put_op(index.key, renewed.model_dump_json())]
            return [*ops, self._audit_op("renew", renewed, at=now)], renewed

        for _ in range(MAX_ATTEMPTS):
            try:
                _live, renewed = self._change(rid, write)
            except EtcdError as exc:
                if exc.code != 5 or not leases:  # NotFound: the shared lease ran out (etcd was down)
                    raise
                self._lease_gone(leases[0])
                continue
            return renewed
        raise StateError(f"etcd at {self.client.endpoint}: renew {rid} found no lease {MAX_ATTEMPTS} times")

    def release(self, rid: str) -> bool:
        def write(res: KeyValue, index: KeyValue) -> tuple[list[Json], Reservation | None]:
            held = self._reservation(index)
            ops = [delete_op(res.key), delete_op(index.key), *map(delete_op, self._hold_keys(rid, held.gpus))]
            return [*ops, self._audit_op("release", held, at=self._clock())], None

        released, _ = self._change(rid, write)
        return released

    # ------------------------------------------------------------------------------ the audit log

    def _entry(self, kv: KeyValue) -> AuditEntry:
        try:
            position = int(kv.key.rsplit("-", 1)[1])
            return AuditEntry(seq=kv.create_revision * SEQ_PER_REVISION + position, **json.loads(kv.value))
        except (ValueError, TypeError, ValidationError) as exc:
            raise self._damaged(kv.key, exc) from exc

    def audit(self, *, since: int = 0, limit: int | None = None) -> list[AuditEntry]:
        """The log after the expiries that are due are logged: one read when none are."""
        entries_op = range_op(
            f"{self.prefix}audit/", prefix=True, sort_by_create=True, min_create_revision=since // SEQ_PER_REVISION
        )
        reads = [*self._sweep_reads(), entries_op]
        _ok, data = self.client.txn([], reads)
        if self._sweep_answer(data):
            _ok, data = self.client.txn([], reads)
        kvs = kvs_of(data["responses"][2])
        entries = sorted((e for e in map(self._entry, kvs) if e.seq > since), key=lambda e: e.seq)
        return entries if limit is None else entries[:limit]

    def watch_audit(self, *, since: int = 0) -> Iterator[AuditEntry]:
        """Audit entries as replicas commit them (after ``since``); runs until closed or etcd goes away."""
        for event in self.client.watch(
            f"{self.prefix}audit/", prefix=True, start_revision=since // SEQ_PER_REVISION + 1
        ):
            if event.kind == "PUT":
                entry = self._entry(event.kv)
                if entry.seq > since:
                    yield entry

    def close(self) -> None:
        self.client.close()


# registered as "etcd" in ``toposched.ledger`` (imported there on first use)
