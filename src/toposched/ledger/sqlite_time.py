"""Ledger time: the clock leases are judged against in a SQLite file that several processes share (issue 37).

Each process has its own clock, and a lease is a time one process wrote and another judges. Judged by each
process's own wall clock, a client whose clock ran 2 h ahead expired a live 600 s lease and booked its GPU.
Ledger time is a process's clock bounded by the newest audit entry's time plus the real (monotonic) time
elapsed since this process first saw that entry, and never before that entry: no process moves faster than
real time from the last change it saw, so none can jump past the live leases others wrote (docs/ledger.md has
the failure model: a clock ahead or stepped forward, a clock behind, a paused or dead holder, a restart).
"""

from __future__ import annotations

import math

from toposched.ledger.base import Clock


class LedgerTime:
    """One process's ledger time for one ledger file."""

    def __init__(self, clock: Clock, monotonic: Clock) -> None:
        self._clock = clock
        self._monotonic = monotonic
        self._last_at = -math.inf  # the newest audit time seen, and the monotonic time when it was first seen
        self._last_seen = 0.0
        self._mono = 0.0  # the monotonic time of the running transaction

    def now(self, last_at: float | None, soonest_expiry: float) -> float:
        """Ledger time for a transaction: ``last_at`` is the newest audit entry's time (None: no entry),
        ``soonest_expiry`` the earliest lease's end (``inf``: no lease). With no lease there is nothing to cut
        short, and it is the clock itself (never before the last entry); a clock behind only makes leases
        last longer. A process that starts after a quiet spell counts from the last change it finds, so it
        reclaims a dead holder's lease at most one TTL after it starts, however its clock is set."""
        wall = float(self._clock())
        mono = self._mono = float(self._monotonic())
        if last_at is None:
            return wall
        if soonest_expiry == math.inf:
            return max(last_at, wall)
        if last_at != self._last_at:
            self._last_at, self._last_seen = last_at, mono
        return max(last_at, min(wall, last_at + (mono - self._last_seen)))

    def wrote(self, at: float) -> None:
        """This process wrote an audit entry at ``at``: ledger time counts from when it was written."""
        if at != self._last_at:
            self._last_at, self._last_seen = at, self._mono


__all__ = ["LedgerTime"]
