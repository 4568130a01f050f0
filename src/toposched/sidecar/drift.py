"""Predicted-vs-observed latency of a placement, from its engine's own Prometheus ``/metrics``.

Each sidecar cycle scrapes the engine (vLLM or SGLang; metric names in ``perf/prometheus.py``) and
compares the means over the window since the previous scrape with what the placement predicted:

* ``toposched_sidecar_latency_drift_ratio{placement,kind}``: observed / predicted, ``kind`` ``ttft``
  or ``tpot`` (1.0: as predicted; 1.5: 50 % slower). Set only when a request finished in the window.
* ``toposched_sidecar_observed_latency_seconds{placement,kind}`` and
  ``toposched_sidecar_predicted_latency_seconds{placement,kind}``: the two figures (in seconds, Prometheus'
  base unit; the cost model and the engines' readers work in milliseconds).
* ``toposched_sidecar_engine_running_requests{placement}``: the engine's running batch. The
  prediction is for the batch and lengths the placement was planned for; a ratio away from 1 at a
  very different batch is load, not model error. Samples at the planned load are what
  ``toposched calibrate --metrics-url`` refits a profile from.

A scrape that fails is reported as an error event; the next cycle tries again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from toposched.perf.prometheus import Exposition, Window, observe, scrape

KINDS = ("ttft", "tpot")


class DriftMetrics:
    """The drift series, registered in the sidecar's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        labels = ["placement", "kind"]
        self.ratio = Gauge(
            "toposched_sidecar_latency_drift_ratio", "Observed / predicted latency, by kind.", labels, registry=r
        )
        self.observed = Gauge(
            "toposched_sidecar_observed_latency_seconds", "Engine's mean latency over the window.", labels, registry=r
        )
        self.predicted = Gauge(
            "toposched_sidecar_predicted_latency_seconds", "Placement's predicted latency.", labels, registry=r
        )
        self.running = Gauge(
            "toposched_sidecar_engine_running_requests", "Engine's running requests.", ["placement"], registry=r
        )


@dataclass
class LatencyDrift:
    """Scrapes ``url`` each cycle; compares the window with ``predicted`` (ms per kind)."""

    url: str
    placement_id: str
    predicted: dict[str, float]
    scrape: Callable[[str], Exposition] = scrape
    last: tuple[float, Exposition] | None = None

    def update(self, metrics: DriftMetrics, now: float) -> Window | None:
        """Scrape once; the window since the previous scrape (None on the first one)."""
        exp = self.scrape(self.url)
        previous, self.last = self.last, (now, exp)
        for kind, value in self.predicted.items():
            metrics.predicted.labels(placement=self.placement_id, kind=kind).set(value / 1e3)
        if previous is None:
            return None
        window = observe(exp, previous[1], seconds=max(now - previous[0], 1e-9))
        if window.running is not None:
            metrics.running.labels(placement=self.placement_id).set(window.running)
        for kind, observed in (("ttft", window.ttft_ms), ("tpot", window.tpot_ms)):
            predicted = self.predicted.get(kind)
            if observed is None or not predicted:
                continue
            metrics.observed.labels(placement=self.placement_id, kind=kind).set(observed / 1e3)
            metrics.ratio.labels(placement=self.placement_id, kind=kind).set(observed / predicted)
        return window


__all__ = ["KINDS", "DriftMetrics", "LatencyDrift"]
