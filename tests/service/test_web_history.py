"""The signal history behind the web page's charts: bounded by count and by age, one sample per step, and
served at ``GET /v1/signals/history`` behind the token."""

from __future__ import annotations

import httpx
import pytest

from tests.service.conftest import Server
from tests.service.test_ui_views import pcie_box, place
from toposched.service.history import SignalHistory, take_sample
from toposched.service.metrics import SIGNAL_NAMES
from toposched.service.state import ServiceState

__all__ = ["pcie_box"]


def test_one_sample_per_step_and_none_older_than_the_window() -> None:
    history = SignalHistory(step_s=10, window_s=60)
    kept = [t for t in range(0, 1000, 3) if history.add(float(t), {"x": float(t)})]
    assert kept[:4] == [0, 12, 24, 36]  # 3 s apart: the first at or after each 10 s since the last kept
    samples = history.samples(999.0)
    assert [s.t for s in samples] == [t for t in kept if t >= 999 - 60]
    assert len(history) <= 60 // 10 + 1
    assert history.samples(999.0 + 3600) == []  # an hour later, nothing is left


def test_the_ring_is_bounded_whatever_the_uptime() -> None:
    history = SignalHistory(step_s=1, window_s=5)
    for t in range(100_000):
        history.add(float(t), {"x": None})
    assert len(history) == 6 and history.samples(99_999.0)[0].t == 99_994.0


def test_a_clock_set_back_starts_the_history_again() -> None:
    history = SignalHistory(step_s=10, window_s=3600)
    for t in (1000.0, 1010.0, 1020.0):
        assert history.add(t, {})
    assert history.add(500.0, {"back": 1.0})
    assert [s.t for s in history.samples(500.0)] == [500.0]


def test_a_step_over_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="at most the window"):
        SignalHistory(step_s=120, window_s=60)


def test_samples_are_the_signals_of_the_state(pcie_box: ServiceState) -> None:
    history = SignalHistory(step_s=10)
    times = iter([100.0, 105.0, 110.0])
    assert take_sample(pcie_box, history, clock=lambda: next(times))
    place(pcie_box, "one", allowed_tp=[1])
    assert not take_sample(pcie_box, history, clock=lambda: next(times))  # 5 s later: not due
    assert take_sample(pcie_box, history, clock=lambda: next(times))
    first, second = history.samples(110.0)
    assert set(first.signals) == set(second.signals) == set(SIGNAL_NAMES)
    assert first.signals["toposched_hbm_utilization_ratio"] == 0
    hbm = second.signals["toposched_hbm_utilization_ratio"]
    assert isinstance(hbm, float) and 0 < hbm < 1
    assert second.signals["toposched_placements_by_tp"] == {"1": 1.0}


def test_the_endpoint_needs_the_token_and_answers_what_was_sampled(sqlite_server: Server) -> None:
    assert httpx.get(f"{sqlite_server.url}/v1/signals/history").status_code == 401
    answer = sqlite_server.client.get("/v1/signals/history")
    assert answer.status_code == 200
    body = answer.json()
    assert (body["step_s"], body["window_s"]) == (10.0, 3600.0)
    assert body["samples"], "the service samples once as it starts"
    first = body["samples"][0]
    assert set(first["signals"]) == set(SIGNAL_NAMES) and first["t"] <= body["now"]
