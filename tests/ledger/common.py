"""Shared pieces of the ledger tests."""

from __future__ import annotations

from toposched.ledger.base import GIB


class FakeClock:
    """A clock the tests move by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


CAP = {f"n/{i}": 80 * GIB for i in range(4)}
