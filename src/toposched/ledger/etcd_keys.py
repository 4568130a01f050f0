"""The etcd ledger's keys (``EtcdKeys``): where each value lives under the namespace, and what the values
read back as (capacities and holds, reservations).

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
"""

from __future__ import annotations

import functools
import json
import uuid
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

from pydantic import ValidationError

from toposched.errors import InputError, StateError
from toposched.ledger.base import AuditAction, Reservation
from toposched.ledger.etcd_client import Json, KeyValue, put_op, range_op
from toposched.ledger.etcd_transport import EtcdCalls

BUCKETS = 64  # a large reservation touches at most this many bucket keys
SMALL_MAX = 32  # reservations of up to this many GPUs keep one hold key per GPU


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


@dataclass
class _Holds:
    """Capacities and holds read from ``b/`` keys: GPU -> capacity, reservation id -> {GPU: bytes}."""

    caps: dict[str, int] = field(default_factory=dict)
    by_id: dict[str, dict[str, int]] = field(default_factory=dict)

    def used(self, ref: str, ids: set[str] | None = None) -> int:
        return sum(h.get(ref, 0) for rid, h in self.by_id.items() if ids is None or rid in ids)

    def holders(self, refs: set[str]) -> set[str]:
        return {rid for rid, h in self.by_id.items() if refs & h.keys()}


class EtcdKeys:
    """The keys of one etcd ledger (under ``prefix``) and the decoding of what they hold."""

    prefix: str
    client: EtcdCalls

    def _gpu(self, ref: str) -> str:
        return f"{self.prefix}b/{bucket_of(ref)}/g/{_q(ref)}/"

    def _bucket(self, bucket: str) -> str:
        return f"{self.prefix}b/{bucket}/"

    def _res(self, rid: str) -> str:
        return f"{self.prefix}res/{_q(rid)}"

    def _index(self, rid: str) -> str:
        return f"{self.prefix}index/{_q(rid)}"

    def _find_ops(self, rid: str) -> list[Json]:
        return [range_op(self._res(rid)), range_op(self._index(rid))]

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

    def _ranges_of(self, key: str) -> tuple[str, ...]:
        """The guarded ranges that hold ``key`` (a ``b/`` key): its bucket, and its GPU's range or its
        bucket's range of large reservations."""
        parts = key[len(self.prefix) :].split("/")  # b, BB, g, REF, ... | b, BB, all, ID
        if len(parts) < 4 or parts[0] != "b":
            return ()
        bucket = self._bucket(parts[1])
        return (bucket, f"{bucket}all/" if parts[2] == "all" else f"{bucket}g/{parts[3]}/")

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
