"""The views the web page reads: per-GPU NUMA, PCIe switch, holder and HBM split; the GPUs behind each alert."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from toposched.service.config import ServiceConfig
from toposched.service.metrics import SIGNAL_NAMES, signal_gpus
from toposched.service.schemas import PlaceBody
from toposched.service.state import ServiceState
from toposched.topology.sources import SourceRef


@pytest.fixture
def pcie_box() -> Iterator[ServiceState]:
    """8 L40S on PCIe (two per switch, four per socket): a TP=2 group must leave NVLink (there is none)."""
    state = ServiceState(ServiceConfig(state="memory", source=SourceRef(kind="preset", ref="l40s-8x-pcie"), auth=False))
    state.open()
    yield state
    state.close()


def place(state: ServiceState, pid: str, **extra: object) -> None:
    decision = state.place(PlaceBody.model_validate({"model": "llama-3.1-8b", "id": pid, **extra}))
    assert decision.status == "placed", decision


def test_each_gpu_has_its_numa_node_pcie_switch_holder_and_planned_hbm(pcie_box: ServiceState) -> None:
    place(pcie_box, "one", allowed_tp=[1])
    (held,) = pcie_box.scheduler.placements.values()
    view = pcie_box.topology_view()
    gpus = {g["ref"]: g for n in view["nodes"] for g in n["gpus"]}
    dmap = pcie_box.scheduler.index.dmap
    assert len(dmap.pcie_groups) == 4
    for group in dmap.pcie_groups:
        assert {gpus[ref]["pcie"] for ref in group.gpus} == {group.id}
    for group in dmap.numa_groups:
        assert {gpus[ref]["numa"] for ref in group.gpus} == {group.id}
    share = held.hbm_per_gpu
    for ref, g in gpus.items():
        assert g["hbm"]["capacity"] == pcie_box.ledger.capacities[ref] > 0
        if ref in held.gpu_refs:
            assert (g["placement"], g["request"], g["free"]) == (held.id, "one", False)
            other = share.activations + share.workspace
            assert (g["hbm"]["weights"], g["hbm"]["kv"], g["hbm"]["other"]) == (share.weights, share.kv, other)
        else:
            assert g["placement"] is None and g["free"] and g["health"] == "ok"
            assert g["hbm"]["weights"] == g["hbm"]["kv"] == g["hbm"]["other"] == 0


def test_alerts_point_at_the_gpus_of_the_placements_that_move_their_signal(pcie_box: ServiceState) -> None:
    place(pcie_box, "inside", allowed_tp=[1])
    place(pcie_box, "across", allowed_tp=[2], affinity="none", slo_class="batch")
    inside, across = (pcie_box.scheduler.placements[pid] for pid in ("inside", "across"))
    stats = pcie_box.stats()
    gpus = signal_gpus(stats)
    assert set(gpus) == set(SIGNAL_NAMES)
    assert gpus["toposched_nvlink_affinity_ratio"] == sorted(across.gpu_refs)
    assert gpus["toposched_cross_domain_traffic_budget_ratio"] == (
        sorted(across.gpu_refs) if across.cross_domain_gbps else []
    )
    assert gpus["toposched_cross_domain_compression_ratio"] == (sorted(across.gpu_refs) if across.compression else [])
    assert gpus["toposched_sidecar_drift_ratio"] == gpus["toposched_migration_ratio"] == []

    # HBM: the GPUs whose plan fills more than the lowest HBM alert (85 %) of their capacity
    roomy = {ref: 2 * max(p.hbm_per_gpu.total for p in stats.placements) for ref in stats.gpu_capacity_bytes}
    assert signal_gpus(replace(stats, gpu_capacity_bytes=roomy))["toposched_hbm_utilization_ratio"] == []
    (small,) = inside.gpu_refs
    tight = {**roomy, small: int(inside.hbm_per_gpu.total / 0.86)}
    assert signal_gpus(replace(stats, gpu_capacity_bytes=tight))["toposched_hbm_utilization_ratio"] == [small]
    tight[small] = int(inside.hbm_per_gpu.total / 0.84)
    assert signal_gpus(replace(stats, gpu_capacity_bytes=tight))["toposched_hbm_utilization_ratio"] == []

    # drift and migrations: the instances a sidecar reported
    gpus = signal_gpus(replace(stats, degraded_gpus=frozenset(across.gpu_refs)))
    assert gpus["toposched_sidecar_drift_ratio"] == gpus["toposched_migration_ratio"] == sorted(across.gpu_refs)
    for unmeasured in ("toposched_comm_overlap_ratio", "toposched_cross_domain_p99_gap_seconds"):
        assert gpus[unmeasured] == []


def test_stats_name_the_gpus_of_degraded_instances(pcie_box: ServiceState) -> None:
    place(pcie_box, "hurt", allowed_tp=[1])
    assert pcie_box.stats().degraded_gpus == frozenset()
    pcie_box.instances["hurt"].degraded = True
    assert pcie_box.stats().degraded_gpus == frozenset(pcie_box.scheduler.placements["hurt"].gpu_refs)
