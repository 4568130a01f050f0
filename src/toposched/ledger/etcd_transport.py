"""Choosing the etcd ledger's transport: ``connect`` gives a client with the calls the ledger makes (``EtcdCalls``),
etcd's gRPC API (``etcd_grpc.EtcdGrpcClient``, the same calls and answers) when ``grpcio`` and ``protobuf`` are
installed, else the JSON gateway (``etcd_client.EtcdClient``); ``TOPOSCHED_ETCD_TRANSPORT`` (``grpc``, ``http``,
``auto``) overrides.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Literal, Protocol

from toposched.errors import InputError
from toposched.ledger.etcd_client import EtcdClient, Json, KeyValue, WatchEvent

Transport = Literal["auto", "grpc", "http"]
TRANSPORT_ENV = "TOPOSCHED_ETCD_TRANSPORT"
"""Environment variable that picks the transport where none is given: ``grpc``, ``http`` or ``auto`` (default)."""


class EtcdCalls(Protocol):
    """What the etcd ledger calls, over either transport (``EtcdClient``, ``etcd_grpc.EtcdGrpcClient``)."""

    endpoint: str

    def range(
        self, key: str, *, prefix: bool = False, sort_by_create: bool = False, min_create_revision: int = 0
    ) -> tuple[list[KeyValue], int]: ...

    def txn(
        self, compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()
    ) -> tuple[bool, Json]: ...

    def grant(self, ttl_s: int) -> tuple[int, int]: ...

    def revoke(self, lease: int) -> None: ...

    def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0) -> Iterator[WatchEvent]: ...

    def close(self) -> None: ...


def connect(endpoint: str, *, timeout_s: float = 5.0, transport: Transport | None = None) -> EtcdCalls:
    """A client for ``endpoint`` (no I/O yet): etcd's gRPC API when ``grpcio`` and ``protobuf`` are installed
    (``auto``), else the JSON gateway. ``transport`` None reads ``TOPOSCHED_ETCD_TRANSPORT``."""
    chosen = transport or os.environ.get(TRANSPORT_ENV, "").strip().lower() or "auto"
    if chosen not in ("auto", "grpc", "http"):
        raise InputError(f"{TRANSPORT_ENV}={chosen!r} is not an etcd transport", fix="set it to grpc, http or auto")
    if chosen == "http":
        return EtcdClient(endpoint, timeout_s=timeout_s)
    try:
        from toposched.ledger.etcd_grpc import EtcdGrpcClient
    except Exception as exc:  # ImportError, or protobuf's VersionError: a runtime older than the generated code
        if not isinstance(exc, ImportError) and type(exc).__name__ != "VersionError":
            raise
        if chosen == "grpc":
            raise InputError(
                f"etcd's gRPC transport needs grpcio and protobuf >= 6.31.1 ({type(exc).__name__}: {exc})",
                fix=f"install them (pip install grpcio 'protobuf>=6.31.1'), or set {TRANSPORT_ENV}=http",
            ) from exc
        return EtcdClient(endpoint, timeout_s=timeout_s)
    return EtcdGrpcClient(endpoint, timeout_s=timeout_s)
