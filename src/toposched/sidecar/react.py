"""What the service does with a sidecar report: mark the instance degraded, propose a migration.

``react(report, scheduler, placement, request)`` is a pure decision over the scheduler's state: the
GPUs named by active alerts are excluded, the request is searched again with the same policy for
one replica on other free GPUs, and nothing is committed (no ledger booking, no index change once
it returns). The service calls it for each ``POST /v1/reports`` (``service/views.py: Reporting.report``, which
also marks the instance degraded); ``toposched sidecar --react`` calls it in-process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from toposched.sidecar.checks import Alert
from toposched.sidecar.loop import Report
from toposched.solver.place import Assessment
from toposched.solver.policies import POLICIES
from toposched.solver.request import Placement, PlacementRequest
from toposched.solver.scheduler import Scheduler

Status = Literal["ok", "degraded"]


@dataclass(frozen=True)
class Reaction:
    placement_id: str
    status: Status
    drifted_gpus: tuple[str, ...]
    alerts: tuple[Alert, ...]
    proposal: Placement | None
    reasons: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "placement": self.placement_id,
            "status": self.status,
            "drifted_gpus": list(self.drifted_gpus),
            "alerts": [a.to_json() for a in self.alerts],
            "proposal": None
            if self.proposal is None
            else {
                "id": self.proposal.id,
                "tp": self.proposal.tp,
                "pp": self.proposal.pp,
                "gpus": list(self.proposal.gpu_refs),
            },
            "reasons": list(self.reasons),
        }


def react(
    report: Report, scheduler: Scheduler, placement: Placement, request: PlacementRequest, *, policy: str = "slo"
) -> Reaction:
    """Degrade the placement a report names and propose where to move it (without committing)."""
    if report.placement_id != placement.id:
        raise ValueError(f"report is for {report.placement_id}, not {placement.id}")
    alerts = report.active_alerts
    if not alerts:
        return Reaction(placement.id, "ok", (), (), None)
    drifted = report.drifted_gpus
    index = scheduler.index
    parked = [ref for ref in drifted if ref in index.free]
    index.take(parked)  # never propose a drifted GPU, even once its placement is gone
    try:
        one = request.model_copy(update={"id": f"{placement.id}-migrate", "replicas": 1})
        result = POLICIES.get(policy)(scheduler, one, one.id, set())
    finally:
        index.give(parked)
    if isinstance(result, Assessment):
        return Reaction(placement.id, "degraded", drifted, alerts, result.placement)
    return Reaction(placement.id, "degraded", drifted, alerts, None, result.reasons)
