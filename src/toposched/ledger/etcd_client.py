"""A small client for etcd's v3 JSON gateway (``/v3/kv/*``, ``/v3/lease/*``, ``/v3/watch``) over HTTP/1.1.

Only what the ledger and the DomainMap store need: ranges, transactions with compares, leases and
watches. Keys and values travel base64-encoded; revisions come back as strings and go out as
integers. Fields equal to their zero value are left out of the gateway's answers (a failed
transaction has no ``succeeded``; a PUT event has no ``type``), so every read has a default.

Errors are translated here, in one place: a connection that fails or times out is
``EtcdUnreachable``; an answer with an error status is ``EtcdError`` with etcd's code and message.
Both are ``StateError``s, defined in ``toposched.errors`` with the rest of the tree.

The transport is httpx (``httpx.Client``: its pool of keep-alive connections, made lazily and again
after a fork; watches stream on a connection of their own). Until issue 33 the unary calls spoke HTTP/1.1
on plain sockets to save about 0.1 ms of client CPU per call, then through ``http.client`` with a pool of
our own; the ledger's calls go through gRPC now (``etcd_grpc``), so the gateway is not on the hot path
and the protocol and the pool are left to the library.

The request builders below make etcd's messages for both transports (this client and
``etcd_grpc.EtcdGrpcClient``; ``etcd_transport.connect`` picks one), with the gateway's field names and raw
keys and values.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from toposched.errors import EtcdError, EtcdUnreachable

Json = dict[str, Any]

ETCD_MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: at most this many compares, and this many operations, per transaction."""
ETCD_MAX_REQUEST_BYTES = 1536 * 1024
"""etcd's default ``--max-request-bytes``: the largest request (a transaction and all its values)."""


def b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix`` (its last byte plus one)."""
    raw = prefix.encode()
    return raw[:-1] + bytes([raw[-1] + 1])


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
# Operations are etcd's messages in the gateway's JSON field names, with keys, values and range ends as they
# are (``str`` or ``bytes``): the gRPC client builds protobuf from them, ``EtcdClient`` base64-encodes them
# (``_gateway``) as it sends. Neither transport pays for the other's encoding.


def range_req(
    key: str,
    *,
    prefix: bool = False,
    keys_only: bool = False,
    limit: int = 0,
    sort_by_create: bool = False,
    min_create_revision: int = 0,
    count_only: bool = False,
) -> Json:
    req: Json = {"key": key}
    if prefix:
        req["range_end"] = prefix_end(key)
    if keys_only:
        req["keys_only"] = True
    if count_only:
        req["count_only"] = True
    if limit:
        req["limit"] = limit
    if sort_by_create:
        req.update(sort_order="ASCEND", sort_target="CREATE")
    if min_create_revision:
        req["min_create_revision"] = min_create_revision
    return req


def put_op(key: str, value: str | bytes, *, lease: int = 0) -> Json:
    req: Json = {"key": key, "value": value}
    if lease:
        req["lease"] = lease
    return {"requestPut": req}


def delete_op(key: str, *, prefix: bool = False) -> Json:
    req: Json = {"key": key}
    if prefix:
        req["range_end"] = prefix_end(key)
    return {"requestDeleteRange": req}


def range_op(key: str, **how: Any) -> Json:
    """A read inside a transaction; ``how`` as for ``range_req``."""
    return {"requestRange": range_req(key, **how)}


def absent(key: str) -> Json:
    """Compare: ``key`` does not exist."""
    return {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}


def mod_equals(key: str, revision: int) -> Json:
    """Compare: ``key`` was last changed at ``revision`` (0: does not exist)."""
    return {"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": revision}


def unchanged_since(key: str, revision: int, *, prefix: bool = False) -> Json:
    """Compare: no key at ``key`` (or under the prefix) was written after ``revision``."""
    cmp: Json = {"key": key, "result": "LESS", "target": "MOD", "mod_revision": revision + 1}
    if prefix:
        cmp["range_end"] = prefix_end(key)
    return cmp


_RAW = ("key", "value", "range_end")


def raw_bytes(text: str | bytes) -> bytes:
    """A key, value or range end as the bytes etcd stores."""
    return text.encode() if isinstance(text, str) else text


def _gateway(body: Json) -> Json:
    """An operation or compare in the gateway's JSON: keys, values and range ends base64-encoded."""
    out: Json = {}
    for name, value in body.items():
        if name in _RAW:
            out[name] = b64(value)
        elif isinstance(value, dict):
            out[name] = _gateway(value)
        else:
            out[name] = value
    return out


def op_bytes(ops: Sequence[Json]) -> int:
    """About how many bytes ``ops`` (puts, deletes, compares) take in etcd's request, whose size
    etcd bounds (``--max-request-bytes``, 1.5 MiB by default): their keys and values."""
    total = 0
    for op in ops:
        body = op.get("requestPut") or op.get("requestDeleteRange") or op.get("requestRange") or op
        total += 16
        for name in _RAW:
            if name in body:
                text = body[name]
                total += len(text) if isinstance(text, bytes) or text.isascii() else len(text.encode())
    return total


def kvs_of(response: Json) -> list[KeyValue]:
    """The key-values of one ``response_range`` inside a transaction answer (the gRPC client's answers
    carry them as ``KeyValue``s already, the gateway's as JSON)."""
    return [
        kv if isinstance(kv, KeyValue) else KeyValue.parse(kv)
        for kv in response.get("response_range", {}).get("kvs", [])
    ]


def count_of(response: Json) -> int:
    """How many keys one ``response_range`` inside a transaction answer found (``count_only`` or not)."""
    return int(response.get("response_range", {}).get("count", 0))


# ------------------------------------------------------------------------------ the client


class EtcdClient:
    """Calls to one etcd endpoint (``http://HOST:PORT``). The constructor does no I/O; it is safe to
    share between threads."""

    def __init__(self, endpoint: str, *, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._watching: set[httpx.Response] = set()
        self._pid = os.getpid()

    def _http(self) -> httpx.Client:
        """The connection pool (httpx: keep-alive, a closed idle connection is not reused), made at the
        first call and again in a forked child (the parent's sockets are not ours to use)."""
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._client = httpx.Client(base_url=self.endpoint, timeout=self.timeout_s)
                self._watching, self._pid = set(), os.getpid()
            return self._client

    def _unreachable(self, exc: Exception) -> EtcdUnreachable:
        return EtcdUnreachable(f"etcd at {self.endpoint} is unreachable ({type(exc).__name__}: {exc})")

    def post(self, path: str, body: Json) -> Json:
        payload = json.dumps(body, separators=(",", ":")).encode()
        try:
            answer = self._http().post(path, content=payload, headers={"Content-Type": "application/json"})
        except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: the pool was closed meanwhile
            raise self._unreachable(exc) from exc
        status, raw = answer.status_code, answer.content
        try:
            data: Json = json.loads(raw)
        except ValueError:
            data = {"message": raw[:200].decode(errors="replace")}
        if status >= 400 or "error" in data:
            code = int(data.get("code", 0))
            message = data.get("message") or data.get("error") or f"HTTP {status}"
            raise EtcdError(f"etcd at {self.endpoint} refused {path}: {message}", code=code)
        return data

    def range(
        self, key: str, *, prefix: bool = False, sort_by_create: bool = False, min_create_revision: int = 0
    ) -> tuple[list[KeyValue], int]:
        """Key-values at ``key`` (or under the prefix) and the store's revision."""
        body = range_req(key, prefix=prefix, sort_by_create=sort_by_create, min_create_revision=min_create_revision)
        data = self.post("/v3/kv/range", _gateway(body))
        return [KeyValue.parse(kv) for kv in data.get("kvs", [])], int(data["header"]["revision"])

    def txn(self, compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()) -> tuple[bool, Json]:
        """Run a transaction; (whether the compares held, the answer)."""
        body = {
            "compare": [_gateway(c) for c in compare],
            "success": [_gateway(op) for op in success],
            "failure": [_gateway(op) for op in failure],
        }
        data = self.post("/v3/kv/txn", body)
        return bool(data.get("succeeded", False)), data

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be longer than asked)."""
        data = self.post("/v3/lease/grant", {"TTL": ttl_s})
        return int(data["ID"]), int(data["TTL"])

    def revoke(self, lease: int) -> None:
        """End a lease now, and delete the keys attached to it."""
        self.post("/v3/lease/revoke", {"ID": lease})

    def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0) -> Iterator[WatchEvent]:
        """Events at ``key`` (or under the prefix) from ``start_revision`` on; runs until closed.

        Raises ``EtcdUnreachable`` when the stream breaks (etcd stopped); callers resume from the
        last revision they saw plus one.
        """
        request = _gateway(range_req(key, prefix=prefix))
        if start_revision:
            request["start_revision"] = start_revision
        body = json.dumps({"create_request": request}).encode()
        # a stream of its own (httpx takes it from the pool and gives it back closed); no read timeout:
        # events may be hours apart
        timeout = httpx.Timeout(self.timeout_s, read=None)
        try:
            with self._http().stream(
                "POST", "/v3/watch", content=body, headers={"Content-Type": "application/json"}, timeout=timeout
            ) as answer:
                if answer.status_code >= 400:
                    raise EtcdError(f"etcd at {self.endpoint} refused /v3/watch: HTTP {answer.status_code}")
                with self._lock:
                    self._watching.add(answer)
                try:
                    for line in answer.iter_lines():
                        if not line.strip():
                            continue
                        result = json.loads(line).get("result", {})
                        revision = int(result.get("header", {}).get("revision", 0))
                        for event in result.get("events", []):
                            yield WatchEvent(event.get("type", "PUT"), KeyValue.parse(event["kv"]), revision)
                finally:
                    with self._lock:
                        self._watching.discard(answer)
        except (httpx.HTTPError, RuntimeError) as exc:
            raise self._unreachable(exc) from exc

    def close(self) -> None:
        """Close the pool and end the watches in progress (their iterators stop)."""
        with self._lock:
            client, watching = self._client, list(self._watching)
            self._client, self._watching = None, set()
            mine = self._pid == os.getpid()
        if not mine:
            return
        for answer in watching:  # wakes a thread blocked reading the stream
            with contextlib.suppress(Exception):
                answer.close()
        if client is not None:
            client.close()
