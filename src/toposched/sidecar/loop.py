"""The sidecar loop: run the three checks every interval, report what changed.

Each cycle runs ``check_topology``, ``check_traffic`` and ``check_hbm`` on the placement's GPUs of
this node and compares the alerts with the ones already active:

* a new alert is written as one JSON line on stdout (``"event": "alert"``), counted in
  ``toposched_sidecar_alerts_total{kind}``, POSTed to the webhook when one is set, and put in the
  cycle's ``Report`` (what the service receives: ``sidecar.react`` marks the placement degraded and
  proposes a migration);
* an alert that no longer holds is written as ``"event": "resolved"``;
* every cycle writes one ``"event": "check"`` line with the CPU time the checks cost
  (``time.process_time()``), also exported as ``toposched_sidecar_check_cpu_seconds``;
* with the engine's ``/metrics`` (``drift``), every cycle also scrapes it and exports observed
  against predicted TTFT/TPOT (``toposched_sidecar_latency_drift_ratio{placement,kind}``, see
  ``sidecar/drift.py``), written as ``"event": "latency"`` lines.

NVML failures during a cycle become ``"event": "error"`` lines on stderr and the loop goes on.
Metrics live in a ``CollectorRegistry`` owned by the loop (no global state between runs).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from toposched.errors import ToposchedError
from toposched.sidecar.checks import ALERT_KINDS, GB, Alert, Expectations, NvlinkSample, check_hbm, check_topology
from toposched.sidecar.checks import check_traffic as _check_traffic
from toposched.sidecar.drift import DriftMetrics, LatencyDrift

Emit = Callable[[dict[str, Any]], None]


class LoopConfig(BaseModel):
    """How the sidecar loop runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    interval_s: float = Field(default=10.0, gt=0, le=3600)
    """Seconds between check cycles (seed 000: every 10 s)."""
    iterations: int | None = Field(default=None, ge=1)
    """Stop after this many cycles; None runs until interrupted."""
    webhook: str | None = None
    """URL that receives a JSON POST for each cycle with new alerts."""
    webhook_timeout_s: float = Field(default=2.0, gt=0, le=60)
    """Timeout of one webhook POST."""
    token: SecretStr | None = None
    """Bearer token for the webhook; None: ``$TOPOSCHED_REPORT_TOKEN`` (the service's token for reports only),
    else ``$TOPOSCHED_API_TOKEN`` (if set)."""


def webhook_token(given: SecretStr | None) -> str | None:
    """The webhook's bearer token: ``given`` (``--token-file``), else ``$TOPOSCHED_REPORT_TOKEN`` (the service's
    token that may only post reports), else ``$TOPOSCHED_API_TOKEN``; surrounding blanks dropped."""
    if given is not None:
        return given.get_secret_value()
    return (
        os.environ.get("TOPOSCHED_REPORT_TOKEN", "").strip()
        or os.environ.get("TOPOSCHED_API_TOKEN", "").strip()
        or None
    )


@dataclass(frozen=True)
class Report:
    """What the sidecar tells the service after a cycle with new alerts."""

    placement_id: str
    node: str
    cycle: int
    new_alerts: tuple[Alert, ...]
    active_alerts: tuple[Alert, ...]
    cpu_seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "placement": self.placement_id,
            "node": self.node,
            "cycle": self.cycle,
            "new_alerts": [a.to_json() for a in self.new_alerts],
            "active_alerts": [a.to_json() for a in self.active_alerts],
            "cpu_seconds": self.cpu_seconds,
        }

    @property
    def drifted_gpus(self) -> tuple[str, ...]:
        return tuple(sorted({a.gpu for a in self.active_alerts}))


@dataclass
class CycleResult:
    cycle: int
    alerts: tuple[Alert, ...]
    new: tuple[Alert, ...]
    resolved: tuple[Alert, ...]
    cpu_seconds: float
    wall_seconds: float
    errors: tuple[str, ...] = ()


class SidecarMetrics:
    """The sidecar's Prometheus series, in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.checks = Counter("toposched_sidecar_checks", "Check cycles run.", registry=r)
        self.alerts = Counter("toposched_sidecar_alerts", "New alerts raised, by kind.", ["kind"], registry=r)
        self.active = Gauge("toposched_sidecar_active_alerts", "Alerts holding now, by kind.", ["kind"], registry=r)
        self.errors = Counter("toposched_sidecar_errors", "Check cycles that failed to read NVML.", registry=r)
        self.cpu = Gauge("toposched_sidecar_check_cpu_seconds", "CPU time of the last check cycle.", registry=r)
        self.wall = Gauge("toposched_sidecar_check_seconds", "Wall time of the last check cycle.", registry=r)
        # Prometheus' base units (bytes, seconds), as its naming guide asks; the checks reason in GB/s
        self.pcie = Gauge(
            "toposched_sidecar_pcie_bytes_per_second", "PCIe throughput (max of TX/RX).", ["gpu"], registry=r
        )
        self.nvlink = Gauge("toposched_sidecar_nvlink_bytes_per_second", "NVLink data throughput.", ["gpu"], registry=r)
        self.hbm = Gauge("toposched_sidecar_hbm_used_bytes", "HBM in use.", ["gpu"], registry=r)
        self.drift = DriftMetrics(r)
        for kind in ALERT_KINDS:
            self.alerts.labels(kind=kind)
            self.active.labels(kind=kind).set(0)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def _stdout(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event, sort_keys=False) + "\n")
    sys.stdout.flush()


def _stderr(event: dict[str, Any]) -> None:
    sys.stderr.write(json.dumps(event, sort_keys=False) + "\n")
    sys.stderr.flush()


@dataclass
class Sidecar:
    """One sidecar: a placement's expectations on this node, an NVML-like ``lib``, and state."""

    lib: Any
    expectations: Expectations
    config: LoopConfig = field(default_factory=LoopConfig)
    metrics: SidecarMetrics = field(default_factory=SidecarMetrics)
    emit: Emit = _stdout
    emit_error: Emit = _stderr
    before_cycle: Callable[[int], None] | None = None
    on_report: Callable[[Report], None] | None = None
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.time
    active: dict[tuple[str, str, str], Alert] = field(default_factory=dict)
    samples: dict[int, NvlinkSample] = field(default_factory=dict)
    fabric: dict[int, str | None] | None = None
    reports: list[Report] = field(default_factory=list)
    drift: LatencyDrift | None = None
    """Predicted-vs-observed latency from the engine's /metrics (``--engine-metrics``), when given."""

    def _event(self, event: str, **fields: Any) -> dict[str, Any]:
        return {
            "ts": round(self.clock(), 3),
            "event": event,
            "placement": self.expectations.placement_id,
            "node": self.expectations.node,
            **fields,
        }

    def cycle(self, n: int) -> CycleResult:
        """Run the three checks once and report the changes."""
        if self.before_cycle is not None:
            self.before_cycle(n)
        if self.drift is not None:
            self._latency(n, self.drift)
        exp = self.expectations
        cpu0, wall0 = time.process_time(), time.perf_counter()
        found: list[Alert] = []
        errors: list[str] = []
        try:
            topo = check_topology(self.lib, exp, fabric_baseline=self.fabric)
            traffic = _check_traffic(self.lib, exp, previous=self.samples)
            hbm = check_hbm(self.lib, exp)
        except ToposchedError as exc:
            errors.append(exc.message)
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
        self.metrics.checks.inc()
        self.metrics.cpu.set(cpu)
        self.metrics.wall.set(wall)
        if errors:
            self.metrics.errors.inc()
            for message in errors:
                self.emit_error(self._event("error", cycle=n, message=message))
            return CycleResult(n, tuple(self.active.values()), (), (), cpu, wall, tuple(errors))
        if self.fabric is None:
            self.fabric = dict(topo.fabric)
        self.samples = dict(traffic.samples)
        found = [*topo.alerts, *traffic.alerts, *hbm.alerts]
        for g in exp.gpus:
            self.metrics.pcie.labels(gpu=g.ref).set(traffic.pcie_gbps.get(g.index, 0.0) * GB)
            rate = traffic.nvlink_gbps.get(g.index)
            if rate is not None:
                self.metrics.nvlink.labels(gpu=g.ref).set(rate * GB)
            self.metrics.hbm.labels(gpu=g.ref).set(hbm.used.get(g.index, 0))
        now = {a.key: a for a in found}
        new = [a for k, a in now.items() if k not in self.active]
        resolved = [a for k, a in self.active.items() if k not in now]
        self.active = now
        for a in new:
            self.metrics.alerts.labels(kind=a.kind).inc()
            self.emit(self._event("alert", cycle=n, **a.to_json()))
        for a in resolved:
            self.emit(self._event("resolved", cycle=n, kind=a.kind, gpu=a.gpu, subject=a.subject))
        for kind in ALERT_KINDS:
            self.metrics.active.labels(kind=kind).set(sum(1 for a in now.values() if a.kind == kind))
        self.emit(
            self._event(
                "check",
                cycle=n,
                cpu_seconds=round(cpu, 6),
                wall_seconds=round(wall, 6),
                active_alerts=len(now),
                gpus=[g.ref for g in exp.gpus],
            )
        )
        if new:
            report = Report(exp.placement_id, exp.node, n, tuple(new), tuple(now.values()), cpu)
            self.reports.append(report)
            self._post(report)
            if self.on_report is not None:
                self.on_report(report)
        return CycleResult(n, tuple(now.values()), tuple(new), tuple(resolved), cpu, wall)

    def _latency(self, n: int, drift: LatencyDrift) -> None:
        """Scrape the engine; a ``latency`` event with observed and predicted figures (errors: an error event)."""
        try:
            window = drift.update(self.metrics.drift, self.clock())
        except ToposchedError as exc:
            self.emit_error(self._event("error", cycle=n, message=f"engine metrics: {exc.message}"))
            return
        if window is None:
            return
        self.emit(
            self._event(
                "latency",
                cycle=n,
                requests=window.requests,
                running=window.running,
                observed_ms={"ttft": window.ttft_ms, "tpot": window.tpot_ms},
                predicted_ms=drift.predicted,
            )
        )

    def _post(self, report: Report) -> None:
        if not self.config.webhook:
            return
        try:
            token = webhook_token(self.config.token)
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            response = httpx.post(
                self.config.webhook, json=report.to_json(), headers=headers, timeout=self.config.webhook_timeout_s
            )
            response.raise_for_status()
        except httpx.HTTPError as exc:
            self.emit_error(self._event("error", cycle=report.cycle, message=f"webhook {self.config.webhook}: {exc}"))

    def run(self) -> list[CycleResult]:
        """Cycle every ``interval_s`` until ``iterations`` cycles ran (or forever)."""
        results: list[CycleResult] = []
        n = 0
        while self.config.iterations is None or n < self.config.iterations:
            started = time.monotonic()
            results.append(self.cycle(n))
            n += 1
            if self.config.iterations is not None and n >= self.config.iterations:
                break
            self.sleep(max(0.0, self.config.interval_s - (time.monotonic() - started)))
        return results
