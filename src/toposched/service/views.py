"""Sidecar reports and the read-only views: the stats snapshot (metrics, alerts) and the topology view (web page).

A sidecar report (``POST /v1/reports``, converted to the sidecar's ``Report`` value by the HTTP layer) marks
the instance it names degraded and gets a re-placement proposal from ``sidecar.react`` (never committed).

The web page reads ``topology_view`` (per GPU: NVLink domain, NUMA node, PCIe switch, the placement holding
it and its HBM split) and ``metrics.signal_gpus`` (per signal, the GPUs an alert on it points at).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from toposched.errors import InputError
from toposched.service.following import Following
from toposched.service.request import ServiceRequest
from toposched.solver.request import SLO_CLASSES, Placement, PlacementRequest
from toposched.topology.domains import gpu_ref
from toposched.topology.model import GPU

DEFAULT_SLO_CLASS = PlacementRequest.model_fields["slo_class"].default
"""The class of a request body that names none."""

if TYPE_CHECKING:
    from toposched.sidecar.loop import Report


@dataclass
class Stats:
    """A consistent snapshot for the metrics exporter and the web page (read under the lock)."""

    placements: list[Placement]
    degraded: int
    budget_gbps: float
    cross_used_gbps: float
    hbm_planned_bytes: int
    hbm_capacity_bytes: int
    queue_by_class: dict[str, int]
    decisions: dict[str, int]
    placed_total: int
    reports_total: int
    drift_reports: int
    migrations_proposed: int
    topology_version: int
    resyncs: int
    ledger_refusals: int
    sync_failures: int = 0
    instances: int = 0
    drifted: int = 0
    moving: int = 0
    degraded_gpus: frozenset[str] = frozenset()
    gpu_capacity_bytes: dict[str, int] = field(default_factory=dict)
    compressible_raw_gbps: float = 0.0
    """Cross-domain GB/s before compression of the instances whose SLO class allows compression: the traffic
    compression could apply to (a realtime or interactive instance's never is)."""
    compressible_sent_gbps: float = 0.0
    """What those instances put on the wire (after their compression)."""


class Reporting(Following):
    """Sidecar reports, and the snapshots the metrics exporter and the web page read (under ``lock``)."""

    def report(self, report: Report) -> dict[str, Any] | None:
        """Mark the instance a sidecar report names degraded and propose a re-placement (not committed)."""
        from toposched.sidecar.react import react

        with self.lock:
            instance = self.instances.get(report.placement_id)
            if instance is None:
                self.follow()  # placed by another replica since: the log says so (no full read per unknown id)
                instance = self.instances.get(report.placement_id)
            if instance is None:
                return None
            placement = instance.placement
            nodes = {r.node for r in placement.ranks}
            if report.node not in nodes:
                raise InputError(
                    f"report for placement {placement.id} comes from node {report.node!r}, which it does not use"
                )
            stray = sorted({a.gpu for a in (*report.active_alerts, *report.new_alerts)} - set(placement.gpu_refs))
            if stray:
                raise InputError(f"report for placement {placement.id} names GPUs it does not use: {stray[:4]}")
            asked = ServiceRequest.model_validate(instance.body)
            request = asked.request(instance.placement.request_id)
            reaction = react(report, self.scheduler, instance.placement, request, policy=asked.policy or "slo")
            self.counters.reports_total += 1
            instance.drifted = any(a.kind == "TOPOLOGY_DRIFT" for a in report.active_alerts)
            instance.moving = reaction.proposal is not None
            if instance.drifted:
                self.counters.drift_reports += 1
            if instance.moving:
                self.counters.migrations_proposed += 1
            instance.degraded = reaction.status == "degraded"
            return reaction.to_json()

    def stats(self) -> Stats:
        with self.lock:
            scheduler = self.scheduler
            placements = list(scheduler.placements.values())
            by_class: Counter[str] = Counter(item.slo_class for item in self.queue)
            capacity = sum(self.ledger.capacities.values())
            planned = sum(p.hbm_per_gpu.total * len(p.ranks) for p in placements)
            compressible = [
                i.placement
                for i in self.instances.values()
                if SLO_CLASSES[i.body.get("slo_class") or DEFAULT_SLO_CLASS].allow_compression
            ]
            return Stats(
                placements=placements,
                degraded=sum(1 for i in self.instances.values() if i.degraded),
                instances=len(self.instances),
                drifted=sum(1 for i in self.instances.values() if i.drifted),
                moving=sum(1 for i in self.instances.values() if i.moving),
                degraded_gpus=frozenset(
                    ref for i in self.instances.values() if i.degraded for ref in i.placement.gpu_refs
                ),
                budget_gbps=scheduler.budget_gbps,
                cross_used_gbps=sum(scheduler.cross_used.values()),
                hbm_planned_bytes=planned,
                hbm_capacity_bytes=capacity,
                gpu_capacity_bytes=dict(self.ledger.capacities),
                queue_by_class=dict(by_class),
                decisions=dict(self.counters.decisions),
                placed_total=self.counters.placed_total,
                reports_total=self.counters.reports_total,
                drift_reports=self.counters.drift_reports,
                migrations_proposed=self.counters.migrations_proposed,
                topology_version=self.topology.version if self.topology else 0,
                resyncs=self.counters.resyncs,
                ledger_refusals=self.counters.ledger_refusals,
                sync_failures=self.counters.sync_failures,
                compressible_raw_gbps=sum(p.cross_domain_gbps_uncompressed for p in compressible),
                compressible_sent_gbps=sum(p.cross_domain_gbps for p in compressible),
            )

    def topology_view(self) -> dict[str, Any]:
        """Nodes, NVLink domains, NUMA and PCIe-switch groups, who holds each GPU and its HBM (the web page).

        A GPU's ``hbm`` is the ledger's capacity and, when a placement holds it, that placement's plan per
        GPU: weights, KV cache and other (activations and workspace). The ledger books whole GPUs, so the
        rest of a held GPU is headroom of its holder, not free for others.
        """
        with self.lock:
            self.follow()
            scheduler, stored = self.scheduler, self.topology
            assert stored is not None
            holder = {ref: p for p in scheduler.placements.values() for ref in p.gpu_refs}
            free = scheduler.index.free
            dmap = scheduler.index.dmap
            capacities = self.ledger.capacities
            numa = {ref: g.id for g in dmap.numa_groups for ref in g.gpus}
            pcie = {ref: g.id for g in dmap.pcie_groups for ref in g.gpus}

            def gpu(node: str, g: GPU) -> dict[str, Any]:
                ref = gpu_ref(node, g.index)
                held = holder.get(ref)
                share = held.hbm_per_gpu if held is not None else None
                return {
                    "ref": ref,
                    "index": g.index,
                    "model": g.model,
                    "domain": dmap.gpu_domain.get(ref),
                    "numa": numa.get(ref),
                    "pcie": pcie.get(ref),
                    "health": g.health.value,
                    "free": ref in free,
                    "placement": held.id if held is not None else None,
                    "request": held.request_id if held is not None else None,
                    "hbm": {
                        "capacity": capacities.get(ref, 0),
                        "weights": share.weights if share else 0,
                        "kv": share.kv if share else 0,
                        "other": share.activations + share.workspace if share else 0,
                    },
                }

            nodes = [
                {"name": n.name, "rack": n.rack, "zone": n.zone, "gpus": [gpu(n.name, g) for g in n.gpus]}
                for n in scheduler.cluster.nodes
            ]
            domains = [
                {
                    "id": d.id,
                    "kind": d.kind,
                    "gpus": list(d.gpus),
                    "used": sum(1 for ref in d.gpus if ref not in free),
                    "occupancy": round(sum(1 for ref in d.gpus if ref not in free) / max(d.size, 1), 4),
                }
                for d in dmap.domains
            ]
            return {
                "cluster": scheduler.cluster.name,
                "version": stored.version,
                "created_at": stored.created_at,
                "source": stored.source.describe(),
                "gpus": len(scheduler.index.info),
                "free": len(free),
                "nodes": nodes,
                "domains": domains,
            }
