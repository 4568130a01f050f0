"""Prometheus exporter: seed 000's nine SRE signals and the service's own series, read from ``Stats``.

Nothing here is called by the solver: at each scrape the collector takes one ``ServiceState.stats()``
snapshot and turns it into series. Every signal is registered (its HELP and TYPE lines are always in
``/metrics``), but a signal only has a sample when the service has a real source for it:

    signal                                        sample when                 source
    toposched_nvlink_affinity_ratio               a placement is live         in-domain placements / live ones
    toposched_cross_domain_traffic_budget_ratio   always                      cross-domain GB/s / budget
    toposched_hbm_utilization_ratio               always                      HBM the plans need / capacity
    toposched_placements_by_tp{tp}                per TP in use               live placements per TP degree
    toposched_sidecar_drift_ratio                 a sidecar has reported      drift reports / instances placed
    toposched_cross_domain_compression_ratio      >= 1 GB/s compressible      GB/s after compression / before
    toposched_comm_overlap_ratio                  never (no measurement)      (the solver's 30 % is an assumption)
    toposched_migration_ratio                     a sidecar has reported      re-placements proposed / placed
    toposched_cross_domain_p99_gap_seconds        never (no latency source)   (the service sees no inference)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from toposched.service.state import ServiceState
from toposched.service.views import Stats
from toposched.solver.request import COMPRESSION_FLOOR_GBPS, Placement

SIGNALS: tuple[tuple[str, str], ...] = (
    ("toposched_nvlink_affinity_ratio", "Share of live placements whose TP groups each sit in one NVLink domain."),
    ("toposched_cross_domain_traffic_budget_ratio", "Cross-domain traffic of live placements over the budget."),
    ("toposched_hbm_utilization_ratio", "HBM the live placements' plans need over the ledger's HBM capacity."),
    ("toposched_placements_by_tp", "Live placements by tensor-parallel degree."),
    ("toposched_sidecar_drift_ratio", "Live instances whose latest sidecar report has topology drift."),
    ("toposched_cross_domain_compression_ratio", "Cross-domain traffic after compression over before it."),
    ("toposched_comm_overlap_ratio", "Communication hidden behind compute over all communication (measured)."),
    ("toposched_migration_ratio", "Live instances with a re-placement proposed on their latest sidecar report."),
    ("toposched_cross_domain_p99_gap_seconds", "P99 latency of cross-domain instances minus intra-domain ones."),
)
SIGNAL_NAMES = tuple(name for name, _help in SIGNALS)
DECISION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def in_one_domain(p: Placement) -> bool:
    """Every TP group (pipeline stage) of the placement sits in one NVLink domain (TP=1 trivially does)."""
    return p.tp == 1 or all(d is not None for d in p.stage_domains)


def signals(stats: Stats) -> dict[str, float | dict[str, float] | None]:
    """The nine signals from a snapshot; None where there is no source (or nothing to measure yet).

    The compression ratio is over the traffic compression could apply to (instances whose SLO class allows
    it: ``Stats.compressible_*``), and only from ``COMPRESSION_FLOOR_GBPS`` of it up."""
    live = stats.placements
    raw, sent = stats.compressible_raw_gbps, stats.compressible_sent_gbps
    by_tp: dict[str, float] = {}
    for p in live:
        by_tp[str(p.tp)] = by_tp.get(str(p.tp), 0.0) + 1
    watched = stats.reports_total > 0 and stats.instances > 0  # a sidecar has reported, something is live
    return {
        "toposched_nvlink_affinity_ratio": sum(map(in_one_domain, live)) / len(live) if live else None,
        "toposched_cross_domain_traffic_budget_ratio": stats.cross_used_gbps / stats.budget_gbps,
        "toposched_hbm_utilization_ratio": stats.hbm_planned_bytes / stats.hbm_capacity_bytes
        if stats.hbm_capacity_bytes
        else None,
        "toposched_placements_by_tp": by_tp,
        "toposched_sidecar_drift_ratio": stats.drifted / stats.instances if watched else None,
        "toposched_cross_domain_compression_ratio": sent / raw if raw >= COMPRESSION_FLOOR_GBPS else None,
        "toposched_comm_overlap_ratio": None,
        "toposched_migration_ratio": stats.moving / stats.instances if watched else None,
        "toposched_cross_domain_p99_gap_seconds": None,
    }


@dataclass(frozen=True)
class Threshold:
    """One alert of seed 000 section 9 (the same numbers as deploy/prometheus/toposched-rules.yml)."""

    alert: str
    signal: str
    op: Literal["<", ">"]
    value: float
    severity: Literal["P0", "P1", "P2"]
    summary: str


THRESHOLDS: tuple[Threshold, ...] = (
    Threshold("NvlinkAffinityLow", "toposched_nvlink_affinity_ratio", "<", 0.70, "P1", "affinity under 70 %"),
    Threshold("NvlinkAffinityCritical", "toposched_nvlink_affinity_ratio", "<", 0.65, "P0", "affinity under 65 %"),
    Threshold("CrossDomainBudgetHigh", "toposched_cross_domain_traffic_budget_ratio", ">", 0.80, "P1", "over 80 %"),
    Threshold("CrossDomainBudgetCritical", "toposched_cross_domain_traffic_budget_ratio", ">", 0.90, "P0", "> 90 %"),
    Threshold("HbmCapacityWarning", "toposched_hbm_utilization_ratio", ">", 0.85, "P1", "HBM over 85 %"),
    Threshold("HbmOomRisk", "toposched_hbm_utilization_ratio", ">", 0.95, "P1", "HBM over 95 %: OOM risk"),
    Threshold("SidecarTopologyDrift", "toposched_sidecar_drift_ratio", ">", 0.0, "P0", "a sidecar saw drift"),
    Threshold("SidecarDriftRatioHigh", "toposched_sidecar_drift_ratio", ">", 0.001, "P0", "drift over 0.1 %"),
    Threshold("CompressionRatioHigh", "toposched_cross_domain_compression_ratio", ">", 0.60, "P2", "over 60 %"),
    Threshold("CommOverlapLow", "toposched_comm_overlap_ratio", "<", 0.50, "P2", "overlap under 50 %"),
    Threshold("MigrationRatioHigh", "toposched_migration_ratio", ">", 0.005, "P0", "migrations over 0.5 %"),
    Threshold("CrossDomainP99GapHigh", "toposched_cross_domain_p99_gap_seconds", ">", 0.05, "P1", "gap > 50 ms"),
    Threshold("CrossDomainP99GapCritical", "toposched_cross_domain_p99_gap_seconds", ">", 0.10, "P1", "gap > 100 ms"),
)


def breaches(stats: Stats) -> list[dict[str, object]]:
    """Thresholds crossed right now (no ``for:`` duration: a preview for the web page, not the alerts)."""
    values = signals(stats)
    out: list[dict[str, object]] = []
    for t in THRESHOLDS:
        value = values[t.signal]
        if not isinstance(value, float | int):
            continue
        if (t.op == "<" and value < t.value) or (t.op == ">" and value > t.value):
            out.append(
                {"alert": t.alert, "severity": t.severity, "signal": t.signal, "value": value, "summary": t.summary}
            )
    return out


class StatsCollector(Collector):
    """Yields the signals and the service series from one stats snapshot per scrape."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        if not self.state.ready:
            for name, text in SIGNALS:
                yield GaugeMetricFamily(name, text, labels=["tp"] if name.endswith("_by_tp") else None)
            return
        stats = self.state.stats()
        values = signals(stats)
        for name, text in SIGNALS:
            value = values[name]
            if isinstance(value, dict):
                family = GaugeMetricFamily(name, text, labels=["tp"])
                for tp, count in sorted(value.items(), key=lambda kv: int(kv[0])):
                    family.add_metric([tp], count)
            else:
                family = GaugeMetricFamily(name, text)
                if value is not None:
                    family.add_metric([], value)
            yield family
        queue = GaugeMetricFamily(
            "toposched_queue_depth", "Requests waiting in the admission queue.", labels=["slo_class"]
        )
        for cls in ("realtime", "interactive", "standard", "batch"):
            queue.add_metric([cls], stats.queue_by_class.get(cls, 0))
        yield queue
        decisions = CounterMetricFamily(
            "toposched_decisions", "Placement decisions by outcome (this replica).", labels=["outcome"]
        )
        for outcome, count in sorted(stats.decisions.items()):
            decisions.add_metric([outcome], count)
        yield decisions
        yield GaugeMetricFamily("toposched_live_placements", "Instances placed and live.", value=len(stats.placements))
        yield GaugeMetricFamily("toposched_degraded_placements", "Instances a sidecar reported.", value=stats.degraded)
        yield GaugeMetricFamily("toposched_topology_version", "DomainMap version in use.", value=stats.topology_version)
        yield CounterMetricFamily("toposched_resyncs", "Rebuilds of the index from the ledger.", value=stats.resyncs)
        yield CounterMetricFamily("toposched_placed", "Instances placed by this replica.", value=stats.placed_total)
        yield CounterMetricFamily(
            "toposched_sidecar_reports", "Sidecar reports received.", value=stats.reports_total
        )  # fmt: skip
        yield CounterMetricFamily(
            "toposched_sidecar_drift_reports", "Sidecar reports with topology drift.", value=stats.drift_reports
        )
        yield CounterMetricFamily(
            "toposched_migrations_proposed",
            "Re-placements proposed on sidecar reports and defragmentation moves booked.",
            value=stats.migrations_proposed,
        )  # fmt: skip
        yield CounterMetricFamily(
            "toposched_ledger_refusals", "Bookings the ledger refused (another replica was first).",
            value=stats.ledger_refusals,
        )  # fmt: skip
        yield CounterMetricFamily(
            "toposched_state_sync_failures", "Background syncs with the ledger that failed (this replica).",
            value=stats.sync_failures,
        )  # fmt: skip


def build_registry(state: ServiceState) -> tuple[CollectorRegistry, Histogram]:
    """A registry of this app's own (never the global one) and the decision-latency histogram."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(state))
    latency = Histogram(
        "toposched_decision_seconds",
        "Time to decide a placement request (lock wait, solver and ledger), by outcome.",
        ["outcome"],
        buckets=DECISION_BUCKETS,
        registry=registry,
    )
    return registry, latency


def signal_gpus(stats: Stats) -> dict[str, list[str]]:
    """Per signal, the GPUs of the placements that move it: where an alert on that signal sends an operator.

    Affinity: placements with a TP group outside one NVLink domain; budget: placements sending cross-domain
    traffic; compression: those that compress it; HBM: GPUs whose own plan fills more of them than the
    cluster-wide ratio alerts on (the lowest HBM threshold); drift and migrations: instances a sidecar
    reported. Signals without a source (overlap, P99 gap) point nowhere.
    """

    def refs(placements: list[Placement]) -> list[str]:
        return sorted({ref for p in placements for ref in p.gpu_refs})

    live = stats.placements
    hbm_alert = min(t.value for t in THRESHOLDS if t.signal == "toposched_hbm_utilization_ratio")
    capacity = stats.gpu_capacity_bytes
    full = sorted(r for p in live for r in p.gpu_refs if p.hbm_per_gpu.total > hbm_alert * capacity.get(r, 0))
    reported = sorted(stats.degraded_gpus)
    return {
        "toposched_nvlink_affinity_ratio": refs([p for p in live if not in_one_domain(p)]),
        "toposched_cross_domain_traffic_budget_ratio": refs([p for p in live if p.cross_domain_gbps > 0]),
        "toposched_hbm_utilization_ratio": full,
        "toposched_placements_by_tp": [],
        "toposched_sidecar_drift_ratio": reported,
        "toposched_cross_domain_compression_ratio": refs([p for p in live if p.compression]),
        "toposched_comm_overlap_ratio": [],
        "toposched_migration_ratio": reported,
        "toposched_cross_domain_p99_gap_seconds": [],
    }
