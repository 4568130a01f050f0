"""What only the in-memory backend has to say; the shared promises are in test_contract.py."""

from __future__ import annotations

from tests.ledger.common import CAP, FakeClock
from toposched.ledger import MemoryLedger, open_ledger, supports
from toposched.ledger.base import GIB, Feature


def test_registry_and_features() -> None:
    ledger = open_ledger("memory")
    assert isinstance(ledger, MemoryLedger)
    assert not supports(ledger, Feature.MULTI_HOST)
    assert supports(ledger, Feature.LEASES)


def test_free_bytes_follows_expiry_without_a_snapshot() -> None:
    clock = FakeClock()
    ledger = MemoryLedger(CAP, clock=clock)
    ledger.reserve("a", {"n/0": 30 * GIB}, ttl_s=5)
    assert ledger.free_bytes("n/0") == 50 * GIB
    clock.now += 5
    assert ledger.free_bytes("n/0") == 80 * GIB
