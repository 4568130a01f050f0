"""The in-memory ledger's promises; the same checks apply to every backend (see contract())."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from toposched.ledger import MemoryLedger, open_ledger, supports
from toposched.ledger.base import GIB, Feature, Ledger


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


CAP = {f"n/{i}": 80 * GIB for i in range(4)}


def test_atomic_all_or_nothing() -> None:
    ledger = MemoryLedger(CAP)
    assert ledger.reserve("a", {"n/0": 70 * GIB}).status == "reserved"
    result = ledger.reserve("b", {"n/0": 20 * GIB, "n/1": 20 * GIB})
    assert result.status == "insufficient"
    assert set(result.reasons) == {"n/0"} and "10.00 GiB free" in result.reasons["n/0"]
    assert ledger.accounts()["n/1"].reserved_bytes == 0  # nothing of b was booked


def test_idempotent_by_id_and_conflict() -> None:
    ledger = MemoryLedger(CAP)
    first = ledger.reserve("a", {"n/0": GIB, "n/1": GIB})
    again = ledger.reserve("a", {"n/1": GIB, "n/0": GIB})
    assert again.status == "already_held" and again.reservation == first.reservation
    assert ledger.accounts()["n/0"].reserved_bytes == GIB
    clash = ledger.reserve("a", {"n/2": GIB})
    assert clash.status == "conflict" and ledger.accounts()["n/2"].reserved_bytes == 0


def test_lease_expiry_and_renewal() -> None:
    clock = FakeClock()
    ledger = MemoryLedger(CAP, clock=clock)
    ledger.reserve("a", {"n/0": 40 * GIB}, ttl_s=10)
    clock.now += 9
    renewed = ledger.renew("a", 10)
    assert renewed is not None and renewed.expires_at == clock.now + 10
    clock.now += 9.5
    assert ledger.get("a") is not None  # the renewal kept it past its first expiry
    clock.now += 1
    assert ledger.get("a") is None
    assert ledger.accounts()["n/0"].reserved_bytes == 0
    assert ledger.renew("a", 10) is None
    assert ledger.release("a") is False


def test_bad_requests_change_nothing() -> None:
    ledger = MemoryLedger(CAP)
    assert ledger.reserve("x", {}).status == "invalid"
    assert ledger.reserve("x", {"n/0": -5}).status == "invalid"
    assert ledger.reserve("x", {"n/0": GIB}, ttl_s=0).status == "invalid"
    assert ledger.reserve("x", {"n/9": GIB}).status == "unknown_gpu"
    assert all(a.reserved_bytes == 0 for a in ledger.accounts().values())
    assert ledger.reservations() == []


def test_registry_and_features() -> None:
    ledger = open_ledger("memory")
    assert isinstance(ledger, MemoryLedger)
    assert not supports(ledger, Feature.MULTI_HOST)
    assert supports(ledger, Feature.LEASES)


ops = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "release", "renew", "tick"]),
        st.integers(0, 5),  # reservation id
        st.dictionaries(st.sampled_from(sorted(CAP)), st.integers(1, 60), min_size=1, max_size=3),
        st.one_of(st.none(), st.floats(1, 20)),
    ),
    max_size=60,
)


def _reserved(ledger: Ledger) -> dict[str, int]:
    return {ref: a.reserved_bytes for ref, a in ledger.accounts().items()}


@settings(max_examples=200, deadline=None)
@given(ops)
def test_never_overcommitted_and_sums_match(sequence: list[tuple[str, int, dict[str, int], float | None]]) -> None:
    clock = FakeClock()
    ledger = MemoryLedger(CAP, clock=clock)
    for op, n, gpus, ttl in sequence:
        rid = f"r{n}"
        if op == "reserve":
            before = _reserved(ledger)
            result = ledger.reserve(rid, {k: v * GIB for k, v in gpus.items()}, ttl_s=ttl)
            if not result.ok:
                assert _reserved(ledger) == before
        elif op == "release":
            before = _reserved(ledger)
            held = ledger.get(rid)
            assert ledger.release(rid) == (held is not None)
            if held is not None:
                after = _reserved(ledger)
                assert all(after[k] == before[k] - held.gpus.get(k, 0) for k in before)
        elif op == "renew":
            ledger.renew(rid, ttl or 5.0)
        else:
            clock.now += ttl or 3.0
        accounts = ledger.accounts()
        assert all(0 <= a.reserved_bytes <= a.capacity_bytes for a in accounts.values())
        live = ledger.reservations()
        for ref, account in accounts.items():
            assert account.reserved_bytes == sum(r.gpus.get(ref, 0) for r in live)
