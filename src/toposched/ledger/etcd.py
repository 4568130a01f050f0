"""The ledger for several scheduler replicas: etcd, through its gRPC API (``etcd_grpc``) or its v3 JSON gateway.

Keys, under ``/NAMESPACE/ledger/`` (namespace from the URL path, default ``toposched``; refs and ids
are percent-encoded so ``/`` in them cannot collide):

    format             the key layout's version (``2``), written by ``set_capacity``
    b/BB/g/REF/cap     capacity of a GPU; BB is the GPU's bucket (CRC-32 of its node name mod 64, in hex)
    b/BB/g/REF/h/ID    bytes a small reservation (at most 32 GPUs) holds on REF
    b/BB/all/ID        ``{REF: bytes}``: what a large reservation holds on the GPUs of bucket BB
    res/ID             ``{"lease": N}``, attached to the reservation's lease: the reservation is live
                       while this key exists
    index/ID           the reservation (JSON, no lease), until it is released or its expiry is logged
    audit/UUID-N       one audit entry, written in the same transaction as the change

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

Leases are etcd's: whole seconds, at least etcd's minimum (about 2 s), kept by etcd's clock, so the
clock given to ``open_ledger`` only stamps times (``Feature.CLOCK`` is unsupported). ``expires_at`` is
the clock read before the commit plus the TTL asked for, capped at the clock read *before* the lease was
granted plus its TTL, so never after the lease's real end; the lease outlives it by at most about two
seconds (the spare second and etcd's whole seconds). A call made while etcd is down raises
``StateError``; a ``reserve`` whose answer was lost is retried safely with the same id (idempotent).
"""

from __future__ import annotations

import functools
import json
import math
import random
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import quote, unquote, urlsplit

from pydantic import ValidationError

from toposched.errors import EtcdError, InputError, StateError
from toposched.ledger.base import (
    AuditAction,
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
    Transport,
    absent,
    connect,
    count_of,
    delete_op,
    kvs_of,
    mod_equals,
    op_bytes,
    put_op,
    range_op,
    raw_bytes,
    unchanged_since,
)

LAYOUT = "2"
BUCKETS = 64  # a large reservation touches at most this many bucket keys
SMALL_MAX = 32  # reservations of up to this many GPUs keep one hold key per GPU
CAPACITY_CHUNK = 100  # capacity keys per transaction
CHUNK_BYTES = 512 * 1024  # and at most about this many bytes
SEQ_PER_REVISION = 16  # audit seq = revision * 16 + position in the transaction
MAX_ATTEMPTS = 200
FRESH_READS_AFTER = 3  # lost races answered from the failure branch; later ones back off and read again
LEASE_SPARE_S = 1  # a shared lease is granted this much longer than asked, and shared while it has it to spare
KNOWN_MAX = 4096  # reservations remembered per ledger object, for one-round-trip releases and renewals
RANGES_MAX = 16384  # guarded key ranges remembered per ledger object, for reserves that commit without a read
STALE_READ_FIRST = 0.5  # reserves read before committing while remembered ranges were stale this often lately
STALE_WEIGHT = 0.25  # weight of the latest reserve in that moving average


def split_url(url: str) -> tuple[str, str]:
    """``http://HOST:PORT[/NAMESPACE]`` -> (endpoint, namespace). User and password are refused: the
    endpoint appears in error messages, and etcd's own authentication is not supported."""
    fix = "give it as etcd:http://HOST:PORT[/NAMESPACE], PORT from 1 to 65535"
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        port = parts.port  # ValueError: not a number, or out of range
    except ValueError as exc:
        raise InputError(f"not an etcd endpoint: {url[:200]!r} ({exc})", fix=fix) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"not an etcd endpoint: {url[:200]!r}", fix=fix)
    if parts.username is not None or parts.password is not None:
        raise InputError(
            "an etcd endpoint with a user or password is not supported (it would show in error messages)",
            fix="give it as etcd:http://HOST:PORT; restrict access to etcd by network or client certificates",
        )
    if port == 0 or not parts.netloc.isascii():
        raise InputError(f"not an etcd endpoint: {url[:200]!r} (port 0 or non-ASCII characters)", fix=fix)
    return f"{parts.scheme}://{parts.netloc}", parts.path.strip("/") or "toposched"


@functools.lru_cache(maxsize=1 << 16)
def _q(text: str) -> str:
    """A ref or id, percent-encoded for a key (cached: every call builds the same few keys again)."""
    return quote(text, safe="")


@functools.lru_cache(maxsize=1 << 16)
def _unq(text: str) -> str:
    """A ref or id from a key (cached: a large reservation's read brings thousands of capacity keys)."""
    return unquote(text)


@functools.lru_cache(maxsize=1 << 16)
def bucket_of(ref: str) -> str:
    """The bucket of a GPU ref: its node's name (``node`` of ``node/index``) hashed into 64."""
    node = ref.rpartition("/")[0] or ref
    return f"{zlib.crc32(node.encode()) % BUCKETS:02x}"


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@dataclass
class _Holds:
    """Capacities and holds read from ``b/`` keys: GPU -> capacity, reservation id -> {GPU: bytes}."""

    caps: dict[str, int] = field(default_factory=dict)
    by_id: dict[str, dict[str, int]] = field(default_factory=dict)

    def used(self, ref: str, ids: set[str] | None = None) -> int:
        return sum(h.get(ref, 0) for rid, h in self.by_id.items() if ids is None or rid in ids)

    def holders(self, refs: set[str]) -> set[str]:
        return {rid for rid, h in self.by_id.items() if refs & h.keys()}


@dataclass(frozen=True)
class _Seen:
    """The keys under one guarded range as this ledger object last knew them, at ``revision``: every key
    in the range now is among ``kvs`` as long as none was written after ``revision`` (deletes only drop
    keys), which is what a commit's compare on the range checks."""

    revision: int
    kvs: tuple[KeyValue, ...]


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


class EtcdLedger:
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

    # ------------------------------------------------------------------------------ keys

    def _gpu(self, ref: str) -> str:
        return f"{self.prefix}b/{bucket_of(ref)}/g/{_q(ref)}/"

    def _bucket(self, bucket: str) -> str:
        return f"{self.prefix}b/{bucket}/"

    def _res(self, rid: str) -> str:
        return f"{self.prefix}res/{_q(rid)}"

    def _index(self, rid: str) -> str:
        return f"{self.prefix}index/{_q(rid)}"

    def _hold_keys(self, rid: str, gpus: Mapping[str, int]) -> dict[str, str]:
        """The keys (and values) that hold a reservation's bytes: per GPU when small, else per bucket."""
        if len(gpus) <= SMALL_MAX:
            return {f"{self._gpu(ref)}h/{_q(rid)}": str(b) for ref, b in gpus.items()}
        parts: dict[str, dict[str, int]] = {}
        for ref, b in gpus.items():
            parts.setdefault(bucket_of(ref), {})[ref] = b
        return {f"{self._bucket(bb)}all/{_q(rid)}": json.dumps(part) for bb, part in parts.items()}

    def _watched(self, gpus: Mapping[str, int]) -> list[tuple[str, bool]]:
        """The key ranges a booking of ``gpus`` reads and guards: (key, is a prefix)."""
        buckets = sorted({bucket_of(ref) for ref in gpus})
        if len(gpus) <= SMALL_MAX:
            return [(self._gpu(ref), True) for ref in sorted(gpus)] + [
                (self._bucket(b) + "all/", True) for b in buckets
            ]
        return [(self._bucket(b), True) for b in buckets]

    def _audit_op(self, action: AuditAction, held: Reservation, *, at: float, position: int = 0) -> Json:
        entry: Json = {"at": at, "action": action, "id": held.id, "owner": held.owner, "gpus": held.gpus}
        entry["expires_at"] = held.expires_at
        return put_op(f"{self.prefix}audit/{uuid.uuid4().hex}-{position}", json.dumps(entry))

    # ------------------------------------------------------------------------------ decoding

    def _damaged(self, key: str, exc: Exception) -> StateError:
        return StateError(
            f"etcd at {self.client.endpoint}: key {key} is damaged ({type(exc).__name__}: {exc})",
            fix="release the reservation (or delete the key with etcdctl); the ledger writes only valid values",
        )

    def _reservation(self, kv: KeyValue) -> Reservation:
        try:
            return Reservation.model_validate_json(kv.value)
        except ValidationError as exc:
            raise self._damaged(kv.key, exc) from exc

    def _holds(self, kvs: Sequence[KeyValue]) -> _Holds:
        out = _Holds()
        for kv in kvs:
            parts = kv.key[len(self.prefix) :].split("/")  # b, BB, g, REF, cap | b, BB, g, REF, h, ID | b, BB, all, ID
            try:
                if parts[2] == "g" and parts[4] == "cap":
                    out.caps[_unq(parts[3])] = int(kv.value)
                elif parts[2] == "g":
                    out.by_id.setdefault(_unq(parts[5]), {})[_unq(parts[3])] = int(kv.value)
                else:
                    part = {str(ref): int(b) for ref, b in json.loads(kv.value).items()}
                    out.by_id.setdefault(_unq(parts[3]), {}).update(part)
            except (ValueError, IndexError, AttributeError) as exc:
                raise self._damaged(kv.key, exc) from exc
        return out

    def _names(self, kvs: Sequence[KeyValue], kind: str) -> set[str]:
        skip = len(self.prefix) + len(kind) + 1
        return {unquote(kv.key[skip:]) for kv in kvs}

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

    def _find_ops(self, rid: str) -> list[Json]:
        return [range_op(self._res(rid)), range_op(self._index(rid))]

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

    def _ranges_of(self, key: str) -> tuple[str, ...]:
        """The guarded ranges that hold ``key`` (a ``b/`` key): its bucket, and its GPU's range or its
        bucket's range of large reservations."""
        parts = key[len(self.prefix) :].split("/")  # b, BB, g, REF, ... | b, BB, all, ID
        if len(parts) < 4 or parts[0] != "b":
            return ()
        bucket = self._bucket(parts[1])
        return (bucket, f"{bucket}all/" if parts[2] == "all" else f"{bucket}g/{parts[3]}/")

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

    # ------------------------------------------------------------------------------ leases

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

    def _note_stale(self, stale: bool) -> None:
        """Follow how often the remembered ranges of a reserve that fits in them were stale (a moving average)."""
        self._stale += STALE_WEIGHT * (float(stale) - self._stale)

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
