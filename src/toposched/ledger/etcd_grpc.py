"""etcd's native gRPC API (``etcdserverpb.KV`` / ``Lease``) for the etcd ledger, with ``EtcdClient``'s calls.

The JSON gateway that ``EtcdClient`` talks to is a proxy inside etcd that turns each HTTP request into a
gRPC call; on a 2-core CI VM it was about 60 % of etcd's CPU per request (see docs/ledger.md). This client
makes the same calls directly, through ``grpcio`` (the gRPC project's own client: HTTP/2, HPACK, flow
control, TLS and reconnection are its business). It takes the same operations (the dicts that
``etcd_client``'s builders make: the gateway's field and enum names, raw keys and values) and answers in the
same shape, except that the key-values inside a transaction's ``response_range`` are already ``KeyValue``s
(``kvs_of`` takes both), so ``EtcdLedger`` does not know which transport it has. Watches are streams that
are rare and long-lived: they stay on the HTTP gateway (``EtcdClient.watch``).

A unary call sends a request serialized by the generated messages and parses the answer with them (here, not
by grpcio, so that an answer that does not parse is ``EtcdUnreachable``, not a refusal). The channel is opened
on first use and again in a forked child (a gRPC channel must not cross a fork; the parent's is left alone),
with a subchannel pool of its own so the child never picks up the parent's connection. ``https://`` endpoints
trust the CA file Python's default context names (``SSL_CERT_FILE``, else the system's CA file; not a CA
directory).

Errors are translated here as in ``etcd_client``: UNAVAILABLE and DEADLINE_EXCEEDED (refused, reset, timed
out, no answer within ``timeout_s``), a call cancelled by ``close()`` from another thread and an answer that
does not parse are ``EtcdUnreachable``; any other status is ``EtcdError`` with the
gRPC status code, which is the ``code`` the gateway reports for the same error (5, NOT_FOUND: a lease that
ran out).

The messages are generated from etcd's v3 API (``etcdrpc/``, see its README). Importing this module
needs ``grpcio`` and ``protobuf`` >= 6.31.1; ``etcd_transport.connect`` falls back to HTTP without them.
"""

from __future__ import annotations

import os
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc  # type: ignore[import-untyped,import-not-found,unused-ignore]
from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]

from toposched.errors import EtcdError, EtcdUnreachable
from toposched.ledger import etcd_client
from toposched.ledger.etcd_client import Json, KeyValue, WatchEvent, raw_bytes
from toposched.ledger.etcdrpc import rpc_pb2

pb: Any = rpc_pb2  # generated: its message classes are made at import time, out of mypy's sight

_BYTES = frozenset(("key", "value", "range_end"))
_OPS = {"requestRange": "request_range", "requestPut": "request_put", "requestDeleteRange": "request_delete_range"}
_OP_TYPES = {"request_range": "RangeRequest", "request_put": "PutRequest", "request_delete_range": "DeleteRangeRequest"}
_UNREACHABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
_NOT_SENT = "failed to connect to all addresses"  # grpc's pick failure: the call never left the client
RECONNECT_WAIT_S = 1.5  # the longest reconnection backoff (1 s, below) with its jitter, and a connection
_OPTIONS = [
    # A channel's own connections: by default grpc shares them between channels to the same target, so a
    # forked child's new channel could pick up the parent's connection ("Wrong file descriptor generation").
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", -1),  # an `accounts` read grows with the cluster: no 4 MiB cap
    ("grpc.initial_reconnect_backoff_ms", 100),  # etcd back after a restart: answer within about a second
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_METHODS = {
    "range": ("/etcdserverpb.KV/Range", "RangeResponse"),
    "txn": ("/etcdserverpb.KV/Txn", "TxnResponse"),
    "grant": ("/etcdserverpb.Lease/LeaseGrant", "LeaseGrantResponse"),
    "revoke": ("/etcdserverpb.Lease/LeaseRevoke", "LeaseRevokeResponse"),
}


def _fields(body: Json) -> Json:
    """An operation's or a compare's fields as its message takes them: keys, values and range ends as bytes
    (enum names pass as they are)."""
    return {name: raw_bytes(value) if name in _BYTES else value for name, value in body.items()}


def _op(op: Json) -> Any:
    """One ``{"requestPut": {...}}`` (or range, delete) as a ``RequestOp``."""
    put = op.get("requestPut")
    if put is not None:  # the most frequent, made without the general path's dicts
        value, lease = put["value"], put.get("lease", 0)
        return pb.RequestOp(request_put=pb.PutRequest(key=raw_bytes(put["key"]), value=raw_bytes(value), lease=lease))
    ((kind, body),) = op.items()
    field = _OPS[kind]
    return pb.RequestOp(**{field: getattr(pb, _OP_TYPES[field])(**_fields(body))})


def _txn_request(compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json]) -> bytes:
    """A serialized ``TxnRequest``, made by the generated messages (protobuf's own encoder; concatenating
    cached operation bytes by hand saved about 30 µs on a transaction of 18 compares and 30 operations, 2 %
    of a client's CPU per operation, and was not kept)."""
    return pb.TxnRequest(  # type: ignore[no-any-return]
        compare=[pb.Compare(**_fields(c)) for c in compare],
        success=[_op(op) for op in success],
        failure=[_op(op) for op in failure],
    ).SerializeToString()


def _kv(kv: Any) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.lease)


def _answer(resp: Any) -> Json:
    """A ``TxnResponse`` in the gateway's shape, with ``response_range`` key-values as ``KeyValue``s."""
    responses: list[Json] = []
    for one in resp.responses:
        kind = one.WhichOneof("response")
        if kind == "response_range":
            found = one.response_range
            responses.append({"response_range": {"kvs": [_kv(kv) for kv in found.kvs], "count": found.count}})
        else:
            responses.append({kind: {}})
    return {"header": {"revision": resp.header.revision}, "succeeded": resp.succeeded, "responses": responses}


def _roots() -> bytes | None:
    """The CA certificates Python's default TLS context trusts (``SSL_CERT_FILE``, else the system's CA
    file), for a ``https://`` channel; None: grpc's own default roots."""
    paths = ssl.get_default_verify_paths()
    for name in (os.environ.get(paths.openssl_cafile_env), paths.cafile):
        if name and Path(name).is_file():
            return Path(name).read_bytes()
    return None


class _Calls:
    """One process's channel and its unary calls (requests go out serialized already)."""

    def __init__(self, target: str, https: bool) -> None:
        if https:
            credentials = grpc.ssl_channel_credentials(root_certificates=_roots())
            self.channel = grpc.secure_channel(target, credentials, options=_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(target, options=_OPTIONS)
        # answers are parsed by the caller (``EtcdGrpcClient._call``): grpcio would turn a parse error into
        # an INTERNAL status, which reads as etcd refusing the call
        self.methods: dict[str, tuple[Callable[..., Any], Callable[[bytes], Any]]] = {
            name: (self.channel.unary_unary(path), getattr(pb, response).FromString)
            for name, (path, response) in _METHODS.items()
        }


class EtcdGrpcClient:
    """``EtcdClient``'s calls over etcd's gRPC API, to one endpoint (``http://HOST:PORT``, the same port).
    The constructor does no I/O; it is safe to share between threads and survives a fork."""

    def __init__(self, endpoint: str, *, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        parts = urlsplit(self.endpoint)
        self._https = parts.scheme == "https"
        host, port = parts.hostname or "127.0.0.1", parts.port or (443 if self._https else 80)
        self._target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 address in brackets
        self._lock = threading.Lock()
        self._calls: _Calls | None = None
        self._pid = os.getpid()
        self._http = etcd_client.EtcdClient(endpoint, timeout_s=timeout_s)  # for watches

    def _open(self) -> _Calls:
        calls = self._calls
        if calls is not None and self._pid == os.getpid():
            return calls
        if self._pid != os.getpid():  # a forked child: the parent's lock may have been held at the fork
            self._lock = threading.Lock()
        with self._lock:
            if self._calls is None or self._pid != os.getpid():  # first use, or a forked child
                self._calls, self._pid = _Calls(self._target, self._https), os.getpid()
            return self._calls

    def _call(self, name: str, request: bytes) -> Any:
        """Call ``name`` with a serialized request; the answer, parsed."""
        method, parse = self._open().methods[name]
        began = time.monotonic()
        try:
            try:
                raw = method(request, timeout=self.timeout_s)
            except grpc.RpcError as first:
                # A channel in its reconnection backoff (etcd restarted a moment ago) fails a call at once,
                # without sending it ("failed to connect to all addresses": no connection was picked). Such a
                # call is made once more, waiting for the connection for at most RECONNECT_WAIT_S (about one
                # backoff step), so an etcd that is back answers and one that is down fails soon after.
                details = first.details() or ""
                if first.code() != grpc.StatusCode.UNAVAILABLE or not details.startswith(_NOT_SENT):
                    raise
                left = min(self.timeout_s - (time.monotonic() - began), RECONNECT_WAIT_S)
                if left <= 0:
                    raise
                try:
                    raw = method(request, timeout=left, wait_for_ready=True)
                except grpc.RpcError as second:
                    if second.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise first from None  # still no connection: the first error says why
                    raise
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            if code is None or code.name in _UNREACHABLE:
                what = code.name if code is not None else "no status"
                raise EtcdUnreachable(f"etcd at {self.endpoint} is unreachable ({what}: {details})") from exc
            if code.name == "CANCELLED":  # the client was closed under the call: no answer, not a refusal
                raise EtcdUnreachable(f"etcd at {self.endpoint} is unreachable (CANCELLED: {details})") from exc
            raise EtcdError(f"etcd at {self.endpoint} refused {name}: {details}", code=code.value[0]) from exc
        except ValueError as exc:  # "Cannot invoke RPC on closed channel!": closed by another thread
            raise EtcdUnreachable(f"etcd at {self.endpoint} is unreachable (the client was closed: {exc})") from exc
        try:
            return parse(raw)
        except DecodeError as exc:
            reason = f"an answer to {name} that is not etcd's: {exc}"
            raise EtcdUnreachable(f"etcd at {self.endpoint} is unreachable ({reason})") from exc

    def range(
        self, key: str, *, prefix: bool = False, sort_by_create: bool = False, min_create_revision: int = 0
    ) -> tuple[list[KeyValue], int]:
        """Key-values at ``key`` (or under the prefix) and the store's revision."""
        body = etcd_client.range_req(
            key, prefix=prefix, sort_by_create=sort_by_create, min_create_revision=min_create_revision
        )
        resp = self._call("range", pb.RangeRequest(**_fields(body)).SerializeToString())
        return [_kv(kv) for kv in resp.kvs], int(resp.header.revision)

    def txn(self, compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()) -> tuple[bool, Json]:
        """Run a transaction; (whether the compares held, the answer)."""
        resp = self._call("txn", _txn_request(compare, success, failure))
        return bool(resp.succeeded), _answer(resp)

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be longer than asked)."""
        resp = self._call("grant", pb.LeaseGrantRequest(TTL=ttl_s).SerializeToString())
        return int(resp.ID), int(resp.TTL)

    def revoke(self, lease: int) -> None:
        """End a lease now, and delete the keys attached to it."""
        self._call("revoke", pb.LeaseRevokeRequest(ID=lease).SerializeToString())

    def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0) -> Iterator[WatchEvent]:
        """As ``EtcdClient.watch`` (over the JSON gateway: a watch is one long stream, not a hot path)."""
        return self._http.watch(key, prefix=prefix, start_revision=start_revision)

    def close(self) -> None:
        """Close this process's channel and end the watches in progress."""
        with self._lock:
            calls, mine = self._calls, self._pid == os.getpid()
            self._calls = None
        if calls is not None and mine:
            calls.channel.close()
        self._http.close()
