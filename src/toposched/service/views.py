"""Sidecar reports and the read-only views: the stats snapshot (metrics, alerts) and the topology view (web page).

A sidecar report (``POST /v1/reports``, converted to the sidecar's ``Report`` value by the HTTP layer) marks
the instance it names degraded and gets a re-placement proposal from ``sidecar.react`` (never committed).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toposched.service.following import Following
from toposched.service.request import ServiceRequest
from toposched.solver.request import Placement

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


class Reporting(Following):
    """Sidecar reports, and the snapshots the metrics exporter and the web page read (under ``lock``)."""

    def report(self, report: Report) -> dict[str, Any] | None:
        """Mark the instance a sidecar report names degraded and propose a re-placement (not committed)."""
        from toposched.sidecar.react import react

        with self.lock:
            instance = self.instances.get(report.placement_id)
            if instance is None:
                self.resync()
                instance = self.instances.get(report.placement_id)
            if instance is None:
                return None
            asked = ServiceRequest.model_validate(instance.body)
            request = asked.request(instance.placement.request_id)
            reaction = react(report, self.scheduler, instance.placement, request, policy=asked.policy or "slo")
            self.counters.reports_total += 1
            if any(a.kind == "TOPOLOGY_DRIFT" for a in report.active_alerts):
                self.counters.drift_reports += 1
            if reaction.proposal is not None:
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
            return Stats(
                placements=placements,
                degraded=sum(1 for i in self.instances.values() if i.degraded),
                budget_gbps=scheduler.budget_gbps,
                cross_used_gbps=sum(scheduler.cross_used.values()),
                hbm_planned_bytes=planned,
                hbm_capacity_bytes=capacity,
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
            )

    def topology_view(self) -> dict[str, Any]:
        """Nodes, NVLink domains and who holds each GPU (the web page's heat map)."""
        with self.lock:
            self.follow()
            scheduler, stored = self.scheduler, self.topology
            assert stored is not None
            holder = {ref: p.id for p in scheduler.placements.values() for ref in p.gpu_refs}
            free = scheduler.index.free
            dmap = scheduler.index.dmap
            nodes = [
                {
                    "name": n.name,
                    "rack": n.rack,
                    "zone": n.zone,
                    "gpus": [
                        {
                            "ref": f"{n.name}/{g.index}",
                            "index": g.index,
                            "model": g.model,
                            "domain": dmap.gpu_domain.get(f"{n.name}/{g.index}"),
                            "free": f"{n.name}/{g.index}" in free,
                            "placement": holder.get(f"{n.name}/{g.index}"),
                        }
                        for g in n.gpus
                    ],
                }
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
