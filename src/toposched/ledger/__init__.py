"""HBM ledger: one interface (``base.Ledger``), several backends; ``open_ledger("memory")``."""

from toposched.ledger import memory as _memory  # noqa: F401  (registers the backend)
from toposched.ledger.base import (
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
