"""HBM ledger: one interface (``base.Ledger``), backends "memory", "sqlite:PATH", "etcd:URL" (``open_ledger``)."""

from toposched.ledger import etcd as _etcd  # noqa: F401  (registers the backend)
from toposched.ledger import memory as _memory  # noqa: F401  (registers the backend)
from toposched.ledger import sqlite as _sqlite  # noqa: F401  (registers the backend)
from toposched.ledger.base import (
    AuditEntry,
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
