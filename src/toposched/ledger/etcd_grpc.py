"""etcd's native gRPC API (``etcdserverpb.KV`` / ``Lease``) for the etcd ledger, with ``EtcdClient``'s calls.

The JSON gateway that ``EtcdClient`` talks to is a proxy inside etcd that turns each HTTP request into a
gRPC call; on a 2-core CI VM it was about 60 % of etcd's CPU per request (see docs/ledger.md). This client
makes the same calls directly. It takes the same operations (the gateway-shaped dicts that
``etcd_client``'s builders make: base64 keys, enum names) and answers in the same shape, except that
the key-values inside a transaction's ``response_range`` are already ``KeyValue``s (``kvs_of`` takes
both), so ``EtcdLedger`` does not know which transport it has. Watches are streams that are rare and
long-lived: they stay on the HTTP gateway (``EtcdClient.watch``).

The channel is opened on first use and again in a forked child (a gRPC channel must not cross a fork;
the parent's is left alone). Errors are translated here as in ``etcd_client``: UNAVAILABLE and
DEADLINE_EXCEEDED are ``EtcdUnreachable``; any other status is ``EtcdError`` with the gRPC status code,
which is the ``code`` the gateway reports for the same error (5, NOT_FOUND: a lease that ran out).

The messages are generated from etcd's v3 API (``etcdrpc/``, see its README). Importing this module
needs ``grpcio`` and ``protobuf`` >= 6.31.1; ``etcd_client.connect`` falls back to HTTP without them.
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import grpc  # type: ignore[import-untyped,import-not-found,unused-ignore]

from toposched.errors import EtcdError, EtcdUnreachable
from toposched.ledger import etcd_client
from toposched.ledger.etcd_client import Json, KeyValue, WatchEvent
from toposched.ledger.etcdrpc import rpc_pb2

pb: Any = rpc_pb2  # generated: its message classes are made at import time, out of mypy's sight

_BYTES = frozenset(("key", "value", "range_end"))
_OPS = {"requestRange": "request_range", "requestPut": "request_put", "requestDeleteRange": "request_delete_range"}
_OP_TYPES = {"request_range": "RangeRequest", "request_put": "PutRequest", "request_delete_range": "DeleteRangeRequest"}
_UNREACHABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
_OPTIONS = [
    # A channel's own connections: by default grpc shares them between channels to the same target, so a
    # forked child's new channel could pick up the parent's connection ("Wrong file descriptor generation").
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", -1),  # an `accounts` read grows with the cluster: no 4 MiB cap
    ("grpc.initial_reconnect_backoff_ms", 100),  # etcd back after a restart: answer within about a second
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _fields(body: Json) -> Json:
    """A gateway-shaped body as message fields: base64 keys and values to bytes (enum names pass as they are)."""
    return {name: base64.b64decode(value) if name in _BYTES else value for name, value in body.items()}


def _op(op: Json) -> Any:
    """One ``{"requestPut": {...}}`` (or range, delete) as a ``RequestOp``."""
    ((kind, body),) = op.items()
    field = _OPS[kind]
    return pb.RequestOp(**{field: getattr(pb, _OP_TYPES[field])(**_fields(body))})


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


class _Calls:
    """One process's channel and its unary calls."""

    def __init__(self, target: str, https: bool) -> None:
        if https:
            self.channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(), options=_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(target, options=_OPTIONS)

        def call(path: str, request: str, response: str) -> Callable[..., Any]:
            return self.channel.unary_unary(  # type: ignore[no-any-return,unused-ignore]
                path,
                request_serializer=getattr(pb, request).SerializeToString,
                response_deserializer=getattr(pb, response).FromString,
            )

        self.range = call("/etcdserverpb.KV/Range", "RangeRequest", "RangeResponse")
        self.txn = call("/etcdserverpb.KV/Txn", "TxnRequest", "TxnResponse")
        self.grant = call("/etcdserverpb.Lease/LeaseGrant", "LeaseGrantRequest", "LeaseGrantResponse")
        self.revoke = call("/etcdserverpb.Lease/LeaseRevoke", "LeaseRevokeRequest", "LeaseRevokeResponse")


class EtcdGrpcClient:
    """``EtcdClient``'s calls over etcd's gRPC API, to one endpoint (``http://HOST:PORT``, the same port).
    The constructor does no I/O; it is safe to share between threads and survives a fork."""

    def __init__(self, endpoint: str, *, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        parts = urlsplit(self.endpoint)
        self._https = parts.scheme == "https"
        self._target = f"{parts.hostname or '127.0.0.1'}:{parts.port or (443 if self._https else 80)}"
        self._lock = threading.Lock()
        self._calls: _Calls | None = None
        self._pid = os.getpid()
        self._http = etcd_client.EtcdClient(endpoint, timeout_s=timeout_s)  # for watches

    def _open(self) -> _Calls:
        calls = self._calls
        if calls is not None and self._pid == os.getpid():
            return calls
        with self._lock:
            if self._calls is None or self._pid != os.getpid():  # first use, or a forked child
                self._calls, self._pid = _Calls(self._target, self._https), os.getpid()
            return self._calls

    def _call(self, name: str, request: Any) -> Any:
        calls = self._open()
        try:
            return getattr(calls, name)(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            if code is not None and code.name in _UNREACHABLE:
                raise EtcdUnreachable(f"etcd at {self.endpoint} is unreachable ({code.name}: {details})") from exc
            number = code.value[0] if code is not None else 0
            raise EtcdError(f"etcd at {self.endpoint} refused {name}: {details}", code=number) from exc

    def range(
        self, key: str, *, prefix: bool = False, sort_by_create: bool = False, min_create_revision: int = 0
    ) -> tuple[list[KeyValue], int]:
        """Key-values at ``key`` (or under the prefix) and the store's revision."""
        body = etcd_client.range_req(
            key, prefix=prefix, sort_by_create=sort_by_create, min_create_revision=min_create_revision
        )
        resp = self._call("range", pb.RangeRequest(**_fields(body)))
        return [_kv(kv) for kv in resp.kvs], int(resp.header.revision)

    def txn(self, compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()) -> tuple[bool, Json]:
        """Run a transaction; (whether the compares held, the answer)."""
        request = pb.TxnRequest(
            compare=[pb.Compare(**_fields(c)) for c in compare],
            success=[_op(op) for op in success],
            failure=[_op(op) for op in failure],
        )
        resp = self._call("txn", request)
        return bool(resp.succeeded), _answer(resp)

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be longer than asked)."""
        resp = self._call("grant", pb.LeaseGrantRequest(TTL=ttl_s))
        return int(resp.ID), int(resp.TTL)

    def revoke(self, lease: int) -> None:
        """End a lease now, and delete the keys attached to it."""
        self._call("revoke", pb.LeaseRevokeRequest(ID=lease))

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
