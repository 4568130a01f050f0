"""sidecar/drift.py: predicted-vs-observed latency from the engine's /metrics, per placement."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.perf.test_readers import EngineMetrics
from tests.sidecar.conftest import Scenario
from toposched.errors import InputError
from toposched.perf.prometheus import Exposition, parse_exposition
from toposched.sidecar.drift import LatencyDrift
from toposched.sidecar.loop import LoopConfig, Sidecar, SidecarMetrics


class Engine:
    """A vLLM or SGLang engine serving requests between the sidecar's scrapes."""

    def __init__(self, engine: str) -> None:
        self.metrics = EngineMetrics(engine)
        self.scrapes = 0
        self.down = False

    def scrape(self, url: str) -> Exposition:
        if self.down:
            raise InputError(f"{url}: cannot scrape: connection refused")
        self.scrapes += 1
        # each window: 10 requests at 24 ms TTFT and 12 ms TPOT, 8 running
        self.metrics.running.set(8)
        self.metrics.finish(ttft_s=0.024, tpot_s=0.012, input_len=512, output_len=32, n=10)
        return parse_exposition(self.metrics.text(), source=url)


def value(metrics: SidecarMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_drift_ratio_per_kind(engine: str) -> None:
    fake = Engine(engine)
    metrics = SidecarMetrics()
    drift = LatencyDrift("http://e/metrics", "inst-0", {"ttft": 20.0, "tpot": 8.0}, scrape=fake.scrape)
    assert drift.update(metrics.drift, now=0.0) is None  # the first scrape is the baseline
    assert value(metrics, "toposched_sidecar_latency_drift_ratio", placement="inst-0", kind="tpot") is None
    window = drift.update(metrics.drift, now=10.0)
    assert window is not None and window.requests == 10
    assert value(metrics, "toposched_sidecar_latency_drift_ratio", placement="inst-0", kind="tpot") == (
        pytest.approx(12.0 / 8.0)
    )
    assert value(metrics, "toposched_sidecar_latency_drift_ratio", placement="inst-0", kind="ttft") == (
        pytest.approx(24.0 / 20.0)
    )
    # in seconds (Prometheus' base unit): 8 ms predicted, 12 ms observed
    assert value(metrics, "toposched_sidecar_predicted_latency_seconds", placement="inst-0", kind="tpot") == 0.008
    assert value(metrics, "toposched_sidecar_observed_latency_seconds", placement="inst-0", kind="tpot") == (
        pytest.approx(0.012)
    )
    assert value(metrics, "toposched_sidecar_engine_running_requests", placement="inst-0") == 8
    assert 'toposched_sidecar_latency_drift_ratio{kind="tpot",placement="inst-0"} 1.5' in metrics.text()


def test_sidecar_cycle_reports_latency_and_survives_a_failed_scrape(scenario: Scenario) -> None:
    fake_nvml, exp, _ = scenario("steady")
    engine = Engine("vllm")
    events: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    drift = LatencyDrift("http://e/metrics", exp.placement_id, {"ttft": 24.0, "tpot": 12.0}, scrape=engine.scrape)

    def before(n: int) -> None:
        fake_nvml.advance(n)
        engine.down = n == 2

    ticks = itertools.count()
    sidecar = Sidecar(
        fake_nvml, exp, config=LoopConfig(interval_s=1, iterations=4), emit=events.append, emit_error=errors.append,
        before_cycle=before, sleep=lambda _s: None, clock=lambda: float(next(ticks)), drift=drift,
    )  # fmt: skip
    sidecar.run()
    latency = [e for e in events if e["event"] == "latency"]
    assert [e["cycle"] for e in latency] == [1, 3]  # cycle 0: baseline; cycle 2: the engine was down
    assert latency[0]["observed_ms"]["tpot"] == pytest.approx(12.0)
    assert [e["message"] for e in errors] == ["engine metrics: http://e/metrics: cannot scrape: connection refused"]
    assert engine.scrapes == 3
    ratio = value(sidecar.metrics, "toposched_sidecar_latency_drift_ratio", placement=exp.placement_id, kind="tpot")
    assert ratio == pytest.approx(1.0)
