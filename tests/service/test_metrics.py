"""The nine signals from a stats snapshot: values where there is a source, None where there is none."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import generate_latest

from toposched.service.config import ServiceConfig
from toposched.service.metrics import breaches, build_registry, in_one_domain, signals
from toposched.service.schemas import PlaceBody
from toposched.service.state import ServiceState
from toposched.service.views import Stats
from toposched.solver.request import COMPRESSION_FLOOR_GBPS
from toposched.topology.sources import SourceRef


def placed_stats(*bodies: dict[str, object], preset: str = "hgx-h100") -> Stats:
    state = ServiceState(ServiceConfig(state="memory", source=SourceRef(kind="preset", ref=preset), auth=False))
    state.open()
    for n, extra in enumerate(bodies):
        decision = state.place(PlaceBody.model_validate({"model": "llama-3.1-8b", "id": f"p{n}", **extra}))
        assert decision.status == "placed", decision
    stats = state.stats()
    state.close()
    return stats


def test_an_empty_cluster_has_only_the_always_defined_signals() -> None:
    values = signals(placed_stats())
    assert values["toposched_cross_domain_traffic_budget_ratio"] == 0.0
    assert values["toposched_hbm_utilization_ratio"] == 0.0
    assert values["toposched_placements_by_tp"] == {}
    for absent in (
        "toposched_nvlink_affinity_ratio",
        "toposched_sidecar_drift_ratio",
        "toposched_cross_domain_compression_ratio",
        "toposched_comm_overlap_ratio",
        "toposched_migration_ratio",
        "toposched_cross_domain_p99_gap_seconds",
    ):
        assert values[absent] is None, absent


def test_placements_feed_affinity_tp_and_hbm() -> None:
    stats = placed_stats({"allowed_tp": [2]}, {"allowed_tp": [4]})
    values = signals(stats)
    assert values["toposched_nvlink_affinity_ratio"] == 1.0
    assert values["toposched_placements_by_tp"] == {"2": 1.0, "4": 1.0}
    expected = sum(p.hbm_per_gpu.total * p.tp for p in stats.placements) / stats.hbm_capacity_bytes
    assert values["toposched_hbm_utilization_ratio"] == expected


def test_a_tp_group_across_domains_lowers_affinity_and_compression_is_after_over_before() -> None:
    # PCIe-only boxes: TP=2 cannot sit in an NVLink domain; batch work may compress its traffic
    stats = placed_stats({"allowed_tp": [2], "affinity": "none", "slo_class": "batch"}, preset="l40s-8x-pcie")
    (p,) = stats.placements
    assert not in_one_domain(p)
    values = signals(stats)
    assert values["toposched_nvlink_affinity_ratio"] == 0.0
    assert p.compression == "fp8" and stats.compressible_raw_gbps == p.cross_domain_gbps_uncompressed > 0
    assert stats.compressible_sent_gbps == pytest.approx(stats.compressible_raw_gbps / 2)
    ratio = values["toposched_cross_domain_compression_ratio"]
    assert ratio == (pytest.approx(0.5) if stats.compressible_raw_gbps >= COMPRESSION_FLOOR_GBPS else None)
    fired = {b["alert"] for b in breaches(stats)}
    assert {"NvlinkAffinityLow", "NvlinkAffinityCritical"} <= fired
    assert "CompressionRatioHigh" not in fired


def test_the_compression_ratio_counts_only_traffic_compression_could_apply_to() -> None:
    """Issue 35: an interactive instance across domains sends uncompressed (its class forbids compression):
    its traffic is not counted, so a healthy cluster does not fire CompressionRatioHigh; nor does a trickle."""
    stats = placed_stats({"allowed_tp": [2], "affinity": "none"}, preset="l40s-8x-pcie")  # interactive
    (p,) = stats.placements
    assert p.compression is None and p.cross_domain_gbps > 0
    assert stats.compressible_raw_gbps == 0.0
    assert signals(stats)["toposched_cross_domain_compression_ratio"] is None
    assert "CompressionRatioHigh" not in {b["alert"] for b in breaches(stats)}
    trickle = replace(stats, compressible_raw_gbps=0.01, compressible_sent_gbps=0.01)  # below the floor
    assert signals(trickle)["toposched_cross_domain_compression_ratio"] is None
    flowing = replace(stats, compressible_raw_gbps=4.0, compressible_sent_gbps=2.0)
    assert signals(flowing)["toposched_cross_domain_compression_ratio"] == 0.5
    failing = replace(stats, compressible_raw_gbps=4.0, compressible_sent_gbps=3.6)  # compression barely helps
    assert "CompressionRatioHigh" in {b["alert"] for b in breaches(failing)}


def test_sidecar_ratios_appear_once_a_sidecar_reported() -> None:
    stats = placed_stats({"allowed_tp": [1]})
    counts = {"reports_total": 4, "drift_reports": 1, "migrations_proposed": 1}
    reported = replace(stats, **counts, instances=100, drifted=1, moving=1)
    values = signals(reported)
    assert values["toposched_sidecar_drift_ratio"] == 0.01  # live instances flagged by their latest report
    assert values["toposched_migration_ratio"] == 0.01
    fired = {b["alert"] for b in breaches(reported)}
    assert {"SidecarTopologyDrift", "SidecarDriftRatioHigh", "MigrationRatioHigh"} <= fired
    cleared = replace(reported, reports_total=40, drift_reports=30, drifted=0, moving=0)  # a later report is clean
    assert signals(cleared)["toposched_sidecar_drift_ratio"] == 0.0 and not {b["alert"] for b in breaches(cleared)}


def test_failed_syncs_are_a_counter_in_the_exposition() -> None:
    stats = replace(placed_stats(), sync_failures=3)

    class Snapshot:
        ready = True

        def stats(self) -> Stats:
            return stats

    registry, _latency = build_registry(Snapshot())  # type: ignore[arg-type]
    lines = generate_latest(registry).decode().splitlines()
    assert "# TYPE toposched_state_sync_failures_total counter" in lines
    assert "toposched_state_sync_failures_total 3.0" in lines
