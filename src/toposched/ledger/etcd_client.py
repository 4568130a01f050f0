"""A small client for etcd's v3 JSON gateway (``/v3/kv/*``, ``/v3/lease/*``, ``/v3/watch``) over httpx.

Only what the ledger and the DomainMap store need: ranges, transactions with compares, leases and
watches. Keys and values travel base64-encoded; revisions come back as strings and go out as
integers. Fields equal to their zero value are left out of the gateway's answers (a failed
transaction has no ``succeeded``; a PUT event has no ``type``), so every read has a default.

Errors are translated here, in one place: a connection that fails or times out is
``EtcdUnreachable``; an answer with an error status is ``EtcdError`` with etcd's code and message.
Both are ``StateError``s. The client is created lazily and again after a fork.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from toposched.errors import StateError

Json = dict[str, Any]

ETCD_MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: at most this many compares, and this many operations, per transaction."""
ETCD_MAX_REQUEST_BYTES = 1536 * 1024
"""etcd's default ``--max-request-bytes``: the largest request (a transaction and all its values)."""


class EtcdError(StateError):
    """etcd answered with an error (``code`` is etcd's gRPC code: 5 not found, 14 unavailable ...)."""

    def __init__(self, message: str, *, code: int = 0, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.code = code


class EtcdUnreachable(StateError):
    """No answer from etcd (refused, reset, timed out)."""


def b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that selects every key starting with ``prefix`` (its last byte plus one)."""
    raw = prefix.encode()
    return b64(raw[:-1] + bytes([raw[-1] + 1]))


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    @classmethod
    def parse(cls, kv: Json) -> KeyValue:
        return cls(
            key=unb64(kv["key"]).decode(),
            value=unb64(kv.get("value", "")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            lease=int(kv.get("lease", 0)),
        )


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "PUT" or "DELETE"
    kv: KeyValue
    revision: int


# ------------------------------------------------------------------------------ request builders


def range_req(key: str, *, prefix: bool = False, keys_only: bool = False, limit: int = 0) -> Json:
    req: Json = {"key": b64(key)}
    if prefix:
        req["range_end"] = prefix_end(key)
    if keys_only:
        req["keys_only"] = True
    if limit:
        req["limit"] = limit
    return req


def put_op(key: str, value: str | bytes, *, lease: int = 0) -> Json:
    req: Json = {"key": b64(key), "value": b64(value)}
    if lease:
        req["lease"] = lease
    return {"requestPut": req}


def delete_op(key: str, *, prefix: bool = False) -> Json:
    req: Json = {"key": b64(key)}
    if prefix:
        req["range_end"] = prefix_end(key)
    return {"requestDeleteRange": req}


def range_op(key: str, *, prefix: bool = False, keys_only: bool = False, limit: int = 0) -> Json:
    return {"requestRange": range_req(key, prefix=prefix, keys_only=keys_only, limit=limit)}


def absent(key: str) -> Json:
    """Compare: ``key`` does not exist."""
    return {"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}


def mod_equals(key: str, revision: int) -> Json:
    """Compare: ``key`` was last changed at ``revision`` (0: does not exist)."""
    return {"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": revision}


def unchanged_since(key: str, revision: int, *, prefix: bool = False) -> Json:
    """Compare: no key at ``key`` (or under the prefix) was written after ``revision``."""
    cmp: Json = {"key": b64(key), "result": "LESS", "target": "MOD", "mod_revision": revision + 1}
    if prefix:
        cmp["range_end"] = prefix_end(key)
    return cmp


def op_bytes(ops: Sequence[Json]) -> int:
    """About how many bytes ``ops`` (puts, deletes, compares) take in etcd's request, whose size
    etcd bounds (``--max-request-bytes``, 1.5 MiB by default): their keys and values, unencoded."""
    total = 0
    for op in ops:
        body = op.get("requestPut") or op.get("requestDeleteRange") or op.get("requestRange") or op
        total += 16 + sum(len(body.get(k, "")) * 3 // 4 for k in ("key", "value", "range_end"))
    return total


def kvs_of(response: Json) -> list[KeyValue]:
    """The key-values of one ``response_range`` inside a transaction answer."""
    return [KeyValue.parse(kv) for kv in response.get("response_range", {}).get("kvs", [])]


# ------------------------------------------------------------------------------ the client


class EtcdClient:
    """Calls to one etcd endpoint (``http://HOST:PORT``). The constructor does no I/O."""

    def __init__(self, endpoint: str, *, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self._http: httpx.Client | None = None
        self._pid = 0

    def _client(self) -> httpx.Client:
        if self._http is None or self._pid != os.getpid():
            self._http = httpx.Client(base_url=self.endpoint, timeout=self.timeout_s)
            self._pid = os.getpid()
        return self._http

    def _unreachable(self, exc: Exception) -> EtcdUnreachable:
        return EtcdUnreachable(
            f"etcd at {self.endpoint} is unreachable ({type(exc).__name__}: {exc})",
            fix="start etcd or check --endpoint / --state; calls succeed again once it answers",
        )

    def post(self, path: str, body: Json) -> Json:
        try:
            answer = self._client().post(path, json=body)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        try:
            data: Json = answer.json()
        except json.JSONDecodeError:
            data = {"message": answer.text[:200]}
        if answer.status_code >= 400 or "error" in data:
            code = int(data.get("code", 0))
            message = data.get("message") or data.get("error") or f"HTTP {answer.status_code}"
            raise EtcdError(f"etcd at {self.endpoint} refused {path}: {message}", code=code)
        return data

    def range(
        self, key: str, *, prefix: bool = False, sort_by_create: bool = False, min_create_revision: int = 0
    ) -> tuple[list[KeyValue], int]:
        """Key-values at ``key`` (or under the prefix) and the store's revision."""
        body = range_req(key, prefix=prefix)
        if sort_by_create:
            body.update(sort_order="ASCEND", sort_target="CREATE")
        if min_create_revision:
            body["min_create_revision"] = min_create_revision
        data = self.post("/v3/kv/range", body)
        return [KeyValue.parse(kv) for kv in data.get("kvs", [])], int(data["header"]["revision"])

    def txn(self, compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()) -> tuple[bool, Json]:
        """Run a transaction; (whether the compares held, the answer)."""
        data = self.post("/v3/kv/txn", {"compare": list(compare), "success": list(success), "failure": list(failure)})
        return bool(data.get("succeeded", False)), data

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be longer than asked)."""
        data = self.post("/v3/lease/grant", {"TTL": ttl_s})
        return int(data["ID"]), int(data["TTL"])

    def keepalive(self, lease: int) -> int:
        """Reset a lease to its full TTL; the TTL, or 0 when the lease is gone."""
        data = self.post("/v3/lease/keepalive", {"ID": lease})
        return int(data.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """Drop a lease and every key attached to it; a lease already gone is fine."""
        try:
            self.post("/v3/lease/revoke", {"ID": lease})
        except EtcdError as exc:
            if exc.code != 5:  # NotFound: expired or revoked already
                raise

    def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0) -> Iterator[WatchEvent]:
        """Events at ``key`` (or under the prefix) from ``start_revision`` on; runs until closed.

        Raises ``EtcdUnreachable`` when the stream breaks (etcd stopped); callers resume from the
        last revision they saw plus one.
        """
        request = range_req(key, prefix=prefix)
        if start_revision:
            request["start_revision"] = start_revision
        timeout = httpx.Timeout(self.timeout_s, read=None)
        try:
            with self._client().stream(
                "POST", "/v3/watch", json={"create_request": request}, timeout=timeout
            ) as answer:
                for line in answer.iter_lines():
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result", {})
                    revision = int(result.get("header", {}).get("revision", 0))
                    for event in result.get("events", []):
                        yield WatchEvent(event.get("type", "PUT"), KeyValue.parse(event["kv"]), revision)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc

    def close(self) -> None:
        if self._http is not None and self._pid == os.getpid():
            self._http.close()
        self._http = None
