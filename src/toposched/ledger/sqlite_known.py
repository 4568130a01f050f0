"""What one connection to a SQLite ledger file knows of it while no other connection commits (``ledger/sqlite.py``:
read inside a transaction, kept up to date by the connection's own changes, read again when ``PRAGMA
data_version`` changes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Known:
    """What a connection knows of the file while ``PRAGMA data_version`` stays ``version`` (no other
    connection committed): read inside a transaction, kept up to date by this connection's own changes."""

    version: int
    next_seq: int
    """The seq of the next audit entry."""
    commits: int
    """``ledger_meta``'s commit count."""
    expiry_floor: float
    """No stored reservation's lease ends before this (``inf``: none has a lease). A lower bound: a released
    lease leaves it where it was; a sweep sets it exactly."""
    logged_after: int
    """``logged`` holds every audit entry with a greater seq (seqs without gaps: nobody else wrote)."""
    logged: list[tuple[Any, ...]] = field(default_factory=list)
    """The values of the audit rows this connection committed, oldest first (as ``checked_row`` returns them)."""
    last_at: float | None = None
    """The ``at`` of the newest audit entry (None: the log is empty): ledger time's anchor (``_ledger_now``)."""


__all__ = ["Known"]
