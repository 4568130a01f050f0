"""The promises of ``base.Ledger``, checked against every backend (memory, SQLite, real etcd)."""

from __future__ import annotations

import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ledger.common import CAP, FakeClock
from tests.ledger.conftest import LedgerFactory
from toposched.ledger import supports
from toposched.ledger.base import GIB, Feature, Ledger


def _reserved(ledger: Ledger) -> dict[str, int]:
    return {ref: a.reserved_bytes for ref, a in ledger.accounts().items()}


def test_atomic_all_or_nothing(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(CAP)
    assert ledger.reserve("a", {"n/0": 70 * GIB}).status == "reserved"
    result = ledger.reserve("b", {"n/0": 20 * GIB, "n/1": 20 * GIB})
    assert result.status == "insufficient"
    assert set(result.reasons) == {"n/0"} and "10.00 GiB free" in result.reasons["n/0"]
    assert _reserved(ledger) == {"n/0": 70 * GIB, "n/1": 0, "n/2": 0, "n/3": 0}
    assert [r.id for r in ledger.reservations()] == ["a"]


def test_idempotent_by_id_and_conflict(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(CAP)
    first = ledger.reserve("a", {"n/0": GIB, "n/1": GIB}, owner="me", meta={"model": "m"})
    again = ledger.reserve("a", {"n/1": GIB, "n/0": GIB})
    assert again.status == "already_held" and again.reservation == first.reservation
    assert ledger.get("a") == first.reservation
    assert ledger.accounts()["n/0"].reserved_bytes == GIB
    clash = ledger.reserve("a", {"n/2": GIB})
    assert clash.status == "conflict" and ledger.accounts()["n/2"].reserved_bytes == 0


def test_release_frees_and_is_logged(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(CAP)
    ledger.reserve("a", {"n/0": 40 * GIB, "n/3": GIB}, owner="svc")
    assert ledger.release("a") is True
    assert ledger.release("a") is False
    assert all(v == 0 for v in _reserved(ledger).values())
    entries = ledger.audit()
    assert [(e.action, e.id, e.owner) for e in entries] == [("reserve", "a", "svc"), ("release", "a", "svc")]
    assert entries[1].gpus == {"n/0": 40 * GIB, "n/3": GIB}
    assert entries[0].seq < entries[1].seq
    assert ledger.audit(since=entries[0].seq) == entries[1:]


def test_lease_expiry_and_renewal(make_ledger: LedgerFactory) -> None:
    clock = FakeClock()
    ledger = make_ledger(CAP, clock=clock)
    if supports(ledger, Feature.CLOCK):
        ledger.reserve("a", {"n/0": 40 * GIB}, ttl_s=10)
        clock.now += 9
        renewed = ledger.renew("a", 10)
        assert renewed is not None and renewed.expires_at == clock.now + 10
        clock.now += 9.5
        assert ledger.get("a") is not None  # the renewal kept it past its first expiry
        clock.now += 1
    else:  # real leases of a couple of seconds (etcd's minimum)
        ledger.reserve("a", {"n/0": 40 * GIB}, ttl_s=2)
        time.sleep(1.5)
        assert ledger.renew("a", 2) is not None
        time.sleep(1.5)
        assert ledger.get("a") is not None  # the renewal kept it past its first expiry
        deadline = time.monotonic() + 6
        while ledger.get("a") is not None and time.monotonic() < deadline:
            time.sleep(0.2)
    assert ledger.get("a") is None
    assert ledger.accounts()["n/0"].reserved_bytes == 0
    assert ledger.renew("a", 10) is None
    assert ledger.release("a") is False
    assert [e.action for e in ledger.audit()] == ["reserve", "renew", "expire"]


def test_bad_requests_change_nothing(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(CAP)
    assert ledger.reserve("x", {}).status == "invalid"
    assert ledger.reserve("x", {"n/0": -5}).status == "invalid"
    assert ledger.reserve("x", {"n/0": GIB}, ttl_s=0).status == "invalid"
    assert ledger.reserve("x", {"n/9": GIB}).status == "unknown_gpu"
    assert ledger.reserve("x", {"n/0": 81 * GIB}).status == "insufficient"
    assert all(a.reserved_bytes == 0 for a in ledger.accounts().values())
    assert ledger.reservations() == []
    assert ledger.audit() == []


def test_capacity_updates_and_odd_names(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger({"node/a/0": GIB})
    ledger.set_capacity({"node/a/0": 2 * GIB, "node/a/01": GIB})
    assert ledger.reserve("id/with/slash", {"node/a/0": 2 * GIB}).ok
    assert ledger.reserve("other", {"node/a/01": GIB}).ok
    accounts = ledger.accounts()
    assert accounts["node/a/0"].free_bytes == 0 and accounts["node/a/01"].free_bytes == 0


ops = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "release", "renew", "tick"]),
        st.integers(0, 5),  # reservation id
        st.dictionaries(st.sampled_from(sorted(CAP)), st.integers(1, 60), min_size=1, max_size=3),
        st.one_of(st.none(), st.floats(1, 20)),
    ),
    max_size=40,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=ops)
def test_never_overcommitted_and_sums_match(
    make_ledger: LedgerFactory, sequence: list[tuple[str, int, dict[str, int], float | None]]
) -> None:
    clock = FakeClock()
    ledger = make_ledger(CAP, clock=clock)
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
