"""The ledger for several scheduler replicas: etcd, through its v3 JSON gateway.

Keys, under ``/NAMESPACE/ledger/`` (namespace from the URL path, default ``toposched``; refs and ids
are percent-encoded so ``/`` in them cannot collide):

    cap/REF            capacity of a GPU
    res/ID             the reservation (JSON), attached to its lease
    hold/REF/ID        bytes the reservation holds on REF, attached to the same lease
    index/ID           a copy of the reservation without lease, so an expiry can be noticed and logged
    audit/UUID-N       one audit entry, written in the same transaction as the change

Why it is exact: the reserved bytes of a GPU are the sum of its ``hold/REF/`` keys. ``reserve``
reads them (and the capacity) at one revision R, checks the fit, then commits a transaction whose
compares say "no key under ``hold/REF/`` and no ``cap/REF`` was written after R" for every GPU it
books, and "``res/ID`` does not exist". Any other booking on one of those GPUs after R makes the
compare fail, and the reserve reads again and retries; a booking on other GPUs does not conflict.
Deletes (release, expiry) only free bytes, so missing one between the read and the commit can
refuse too much, never book too much. All keys of a reservation share one etcd lease: when a
holder crashes and stops renewing, etcd deletes them all in one revision after the TTL.

Leases are etcd's: whole seconds, at least etcd's minimum (about 2 s), kept by etcd's clock, so the
clock given to ``open_ledger`` only stamps times (``Feature.CLOCK`` is unsupported). A call made
while etcd is down raises ``StateError``; a ``reserve`` whose answer was lost is retried safely with
the same id (idempotent). ``expire`` audit entries are written by whichever replica next reads the
audit log or reserves the same id; their ``at`` is the lease's end.
"""

from __future__ import annotations

import json
import math
import random
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar
from urllib.parse import quote, unquote, urlsplit

from toposched.errors import InputError, StateError
from toposched.ledger.base import (
    BACKENDS,
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
    EtcdClient,
    Json,
    KeyValue,
    absent,
    delete_op,
    kvs_of,
    mod_equals,
    put_op,
    range_op,
    unchanged_since,
)

SEQ_PER_REVISION = 16  # audit seq = revision * 16 + position in the transaction
MAX_ATTEMPTS = 200
ETCD_MIN_TTL_S = 2  # etcd raises shorter lease TTLs to about this


def split_url(url: str) -> tuple[str, str]:
    """``http://HOST:PORT[/NAMESPACE]`` -> (endpoint, namespace)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InputError(f"not an etcd endpoint: {url!r}", fix="give it as etcd:http://HOST:PORT")
    return f"{parts.scheme}://{parts.netloc}", parts.path.strip("/") or "toposched"


def _q(text: str) -> str:
    return quote(text, safe="")


def _record(reservation: Reservation, lease: int) -> str:
    return json.dumps({**reservation.model_dump(), "lease": lease}, sort_keys=True)


def _parse(kv: KeyValue) -> tuple[Reservation, int]:
    data: dict[str, Any] = json.loads(kv.value)
    lease = int(data.pop("lease", 0))
    return Reservation.model_validate(data), lease


class EtcdLedger:
    """A ledger shared by scheduler replicas through etcd. The constructor does no I/O."""

    UNSUPPORTED: ClassVar[Mapping[Feature, str]] = {
        Feature.CLOCK: "leases expire by etcd's own clock, in whole seconds",
    }

    def __init__(self, url: str, *, clock: Clock = wall_clock, timeout_s: float = 5.0) -> None:
        endpoint, namespace = split_url(url)
        self.url = url
        self.client = EtcdClient(endpoint, timeout_s=timeout_s)
        self._clock = clock
        self.prefix = f"/{namespace}/ledger/"

    # ------------------------------------------------------------------------------ keys

    def _cap(self, ref: str) -> str:
        return f"{self.prefix}cap/{_q(ref)}"

    def _res(self, rid: str) -> str:
        return f"{self.prefix}res/{_q(rid)}"

    def _index(self, rid: str) -> str:
        return f"{self.prefix}index/{_q(rid)}"

    def _holds(self, ref: str) -> str:
        return f"{self.prefix}hold/{_q(ref)}/"

    def _audit_op(self, action: AuditAction, held: Reservation, position: int, *, at: float) -> Json:
        entry: Json = {"at": at, "action": action, "id": held.id, "owner": held.owner, "gpus": held.gpus}
        entry["expires_at"] = held.expires_at
        return put_op(f"{self.prefix}audit/{uuid.uuid4().hex}-{position}", json.dumps(entry))

    def _ref_of_hold(self, key: str) -> str:
        return unquote(key[len(self.prefix) + len("hold/") :].split("/", 1)[0])

    @staticmethod
    def _backoff(attempt: int) -> None:
        time.sleep(random.uniform(0, 0.002 * min(attempt, 10)))

    # ------------------------------------------------------------------------------ the interface

    def set_capacity(self, capacities: Mapping[str, int]) -> None:
        for ref, cap in capacities.items():
            if cap < 0:
                raise ValueError(f"capacity of {ref} must be >= 0 (got {cap})")
        if capacities:
            self.client.txn([], [put_op(self._cap(ref), str(cap)) for ref, cap in capacities.items()])

    def accounts(self) -> dict[str, GpuAccount]:
        _ok, data = self.client.txn(
            [], [range_op(f"{self.prefix}cap/", prefix=True), range_op(f"{self.prefix}hold/", prefix=True)]
        )
        caps, holds = (kvs_of(r) for r in data["responses"])
        sums: dict[str, int] = {}
        for kv in holds:
            ref = self._ref_of_hold(kv.key)
            sums[ref] = sums.get(ref, 0) + int(kv.value)
        out = {}
        for kv in caps:
            ref = unquote(kv.key[len(self.prefix) + len("cap/") :])
            out[ref] = GpuAccount(ref=ref, capacity_bytes=int(kv.value), reserved_bytes=sums.get(ref, 0))
        return out

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
        refs = sorted(gpus)
        lease, granted = 0, 0
        try:
            for attempt in range(MAX_ATTEMPTS):
                reads = [range_op(self._res(rid)), range_op(self._index(rid))]
                for ref in refs:
                    reads += [range_op(self._cap(ref)), range_op(self._holds(ref), prefix=True)]
                _ok, data = self.client.txn([], reads)
                revision = int(data["header"]["revision"])
                responses = data["responses"]
                found, index = kvs_of(responses[0]), kvs_of(responses[1])
                held = _parse(found[0])[0] if found else None
                touched = {}
                for i, ref in enumerate(refs):
                    cap, holds = kvs_of(responses[2 + 2 * i]), kvs_of(responses[3 + 2 * i])
                    if cap:
                        used = sum(int(kv.value) for kv in holds)
                        touched[ref] = GpuAccount(ref=ref, capacity_bytes=int(cap[0].value), reserved_bytes=used)
                refusal = judge(rid, gpus, held, touched)
                if refusal is not None:
                    return refusal
                if ttl_s is not None and not lease:
                    lease, granted = self.client.grant(max(1, math.ceil(ttl_s)))
                now = self._clock()
                reservation = Reservation(
                    id=rid,
                    gpus=dict(gpus),
                    owner=owner,
                    created_at=now,
                    expires_at=None if ttl_s is None else now + granted,
                    meta=dict(meta or {}),
                )
                compare = [absent(self._res(rid))]
                compare.append(mod_equals(self._index(rid), index[0].mod_revision if index else 0))
                success = []
                if index:  # an expired reservation under the same id that no one logged yet
                    old, _lease = _parse(index[0])
                    success.append(self._audit_op("expire", old, 0, at=old.expires_at or now))
                for ref in refs:
                    compare += [
                        unchanged_since(self._cap(ref), revision),
                        unchanged_since(self._holds(ref), revision, prefix=True),
                    ]
                    success.append(put_op(self._holds(ref) + _q(rid), str(gpus[ref]), lease=lease))
                success += [
                    put_op(self._res(rid), _record(reservation, lease), lease=lease),
                    put_op(self._index(rid), _record(reservation, lease)),
                    self._audit_op("reserve", reservation, 1, at=now),
                ]
                committed, _data = self.client.txn(compare, success)
                if committed:
                    lease = 0  # now owned by the reservation
                    return ReserveResult(status="reserved", reservation=reservation)
                self._backoff(attempt)
            raise StateError(
                f"etcd at {self.client.endpoint}: reserve {rid} lost {MAX_ATTEMPTS} races in a row",
                fix="too many replicas booking the same GPUs at once; retry with the same id",
            )
        finally:
            if lease:
                self.client.revoke(lease)

    def _read(self, rid: str) -> tuple[Reservation, int, KeyValue] | None:
        kvs, _rev = self.client.range(self._res(rid))
        if not kvs:
            return None
        held, lease = _parse(kvs[0])
        return held, lease, kvs[0]

    def renew(self, rid: str, ttl_s: float) -> Reservation | None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive (got {ttl_s})")
        want = max(1, math.ceil(ttl_s))
        for attempt in range(MAX_ATTEMPTS):
            found = self._read(rid)
            if found is None:
                return None
            held, lease, kv = found
            now = self._clock()
            granted = self.client.keepalive(lease) if lease else -1
            if granted == 0:
                return None  # the lease ran out between the read and the keepalive
            if granted == want or want < granted <= ETCD_MIN_TTL_S:
                # the lease has the asked length: reset it to its full TTL and stamp the new end time
                renewed = held.model_copy(update={"expires_at": now + granted})
                success = [put_op(self._res(rid), _record(renewed, lease), lease=lease)]
                success += [
                    put_op(self._index(rid), _record(renewed, lease)),
                    self._audit_op("renew", renewed, 0, at=now),
                ]
                if self.client.txn([mod_equals(self._res(rid), kv.mod_revision)], success)[0]:
                    return renewed
            else:
                # move every key of the reservation to a new lease of the asked length
                new_lease, granted = self.client.grant(want)
                renewed = held.model_copy(update={"expires_at": now + granted})
                success = [put_op(self._holds(ref) + _q(rid), str(b), lease=new_lease) for ref, b in held.gpus.items()]
                success += [
                    put_op(self._res(rid), _record(renewed, new_lease), lease=new_lease),
                    put_op(self._index(rid), _record(renewed, new_lease)),
                    self._audit_op("renew", renewed, 0, at=now),
                ]
                if self.client.txn([mod_equals(self._res(rid), kv.mod_revision)], success)[0]:
                    if lease:
                        self.client.revoke(lease)
                    return renewed
                self.client.revoke(new_lease)
            self._backoff(attempt)
        raise StateError(f"etcd at {self.client.endpoint}: renew {rid} lost {MAX_ATTEMPTS} races in a row")

    def release(self, rid: str) -> bool:
        for attempt in range(MAX_ATTEMPTS):
            found = self._read(rid)
            if found is None:
                return False
            held, lease, kv = found
            success = [delete_op(self._res(rid)), delete_op(self._index(rid))]
            success += [delete_op(self._holds(ref) + _q(rid)) for ref in held.gpus]
            success.append(self._audit_op("release", held, 0, at=self._clock()))
            if self.client.txn([mod_equals(self._res(rid), kv.mod_revision)], success)[0]:
                if lease:
                    self.client.revoke(lease)
                return True
            self._backoff(attempt)
        raise StateError(f"etcd at {self.client.endpoint}: release {rid} lost {MAX_ATTEMPTS} races in a row")

    def get(self, rid: str) -> Reservation | None:
        found = self._read(rid)
        return None if found is None else found[0]

    def reservations(self) -> list[Reservation]:
        kvs, _rev = self.client.range(f"{self.prefix}res/", prefix=True)
        return [_parse(kv)[0] for kv in kvs]

    def sweep(self) -> int:
        """Log ``expire`` for reservations whose lease ran out; how many were logged."""
        _ok, data = self.client.txn(
            [], [range_op(f"{self.prefix}index/", prefix=True), range_op(f"{self.prefix}res/", prefix=True)]
        )
        index, live = (kvs_of(r) for r in data["responses"])
        live_keys = {kv.key[len(self.prefix) + len("res/") :] for kv in live}
        logged = 0
        for kv in index:
            name = kv.key[len(self.prefix) + len("index/") :]
            if name in live_keys:
                continue
            old, _lease = _parse(kv)
            compare = [absent(self._res(old.id)), mod_equals(kv.key, kv.mod_revision)]
            success = [delete_op(kv.key), self._audit_op("expire", old, 0, at=old.expires_at or self._clock())]
            logged += self.client.txn(compare, success)[0]
        return logged

    def _entry(self, kv: KeyValue) -> AuditEntry:
        position = int(kv.key.rsplit("-", 1)[1])
        return AuditEntry(seq=kv.create_revision * SEQ_PER_REVISION + position, **json.loads(kv.value))

    def audit(self, *, since: int = 0, limit: int | None = None) -> list[AuditEntry]:
        self.sweep()
        kvs, _rev = self.client.range(
            f"{self.prefix}audit/",
            prefix=True,
            sort_by_create=True,
            min_create_revision=since // SEQ_PER_REVISION,
        )
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


BACKENDS.register("etcd", lambda arg, clock: EtcdLedger(arg or "http://127.0.0.1:2379", clock=clock))
