"""HBM ledger: one interface (``base.Ledger``), backends "memory", "sqlite:PATH", "etcd:URL" (``open_ledger``)."""

from toposched.ledger import memory as _memory  # noqa: F401  (registers the backend)
from toposched.ledger import sqlite as _sqlite  # noqa: F401  (registers the backend)
from toposched.ledger.base import (
    BACKENDS,
    AuditEntry,
    Clock,
    Feature,
    GpuAccount,
    Ledger,
    Reservation,
    ReserveResult,
    capacities_from_cluster,
    open_ledger,
    supports,
)
from toposched.ledger.memory import MemoryLedger


def _etcd(arg: str, clock: Clock) -> Ledger:
    """The etcd backend, imported on first use (its HTTP client is not needed by local commands)."""
    from toposched.ledger.etcd import EtcdLedger

    return EtcdLedger(arg or "http://127.0.0.1:2379", clock=clock)


BACKENDS.register("etcd", _etcd)

__all__ = [
    "AuditEntry",
    "Feature",
    "GpuAccount",
    "Ledger",
    "MemoryLedger",
    "Reservation",
    "ReserveResult",
    "capacities_from_cluster",
    "open_ledger",
    "supports",
]
