"""Reconciliation of reservations with observed per-GPU use."""

from __future__ import annotations

import pytest

from toposched.ledger.base import GIB, Reservation
from toposched.ledger.reconcile import reconcile


def _res(rid: str, **gpus: int) -> Reservation:
    return Reservation(id=rid, gpus={k.replace("_", "/"): v * GIB for k, v in gpus.items()}, created_at=0.0)


def test_reports_only_differences_beyond_tolerance() -> None:
    held = [_res("a", n_0=40, n_1=40), _res("b", n_0=20)]
    observed = {"n/0": 63 * GIB, "n/1": 30 * GIB, "n/2": 5 * GIB}
    found = {d.ref: d for d in reconcile(held, observed)}
    assert set(found) == {"n/1", "n/2"}  # n/0: 63 of 60 is within 10 %
    assert found["n/1"].kind == "under" and found["n/1"].reservations == ("a",)
    assert found["n/2"].kind == "untracked" and found["n/2"].reserved_bytes == 0
    assert found["n/1"].describe() == "n/1: under: 40.00 GiB reserved by a, 30.00 GiB in use"


def test_over_and_unobserved_and_tolerance() -> None:
    held = [_res("a", n_0=10, n_1=10)]
    found = reconcile(held, {"n/0": 12 * GIB})
    assert [(d.ref, d.kind) for d in found] == [("n/0", "over"), ("n/1", "unobserved")]
    assert [d.ref for d in reconcile(held, {"n/0": 12 * GIB, "n/1": 10 * GIB}, tolerance=0.25)] == []
    assert reconcile([], {}) == []
    with pytest.raises(ValueError, match="tolerance"):
        reconcile(held, {}, tolerance=1.5)
