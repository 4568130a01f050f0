"""Request and response bodies of the HTTP API (the OpenAPI schema is generated from these)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from toposched.errors import UnknownNameError
from toposched.names import PlacementId
from toposched.service.history import SignalValues
from toposched.service.request import ServiceRequest
from toposched.solver.request import PlacementRequest
from toposched.workload.catalog import ENTRIES, catalog_entry

if TYPE_CHECKING:
    from toposched.sidecar.loop import Report


class PlaceBody(ServiceRequest):
    """A placement request as the API takes it: the solver's fields plus how to wait, lease and decide.

    ``id`` is the idempotency key (generated when absent): the same id with the same body answers the
    existing placement; with another body, 409. ``model`` must be a catalog name (no file paths over HTTP).
    """

    # (the OpenAPI spec shows the docstring.) What the replica decides on is the ``ServiceRequest`` part;
    # ``wait_s`` is the HTTP layer's (``api._wait_in_queue``) and never part of the request's key.

    model: str = Field(
        min_length=1,
        description="catalog model name (aliases such as Hugging Face ids are accepted too)",
        json_schema_extra={"enum": [e.name for e in ENTRIES]},
    )
    wait_s: float = Field(default=0.0, ge=0, le=3600, description="seconds to wait in the admission queue")

    @field_validator("model")
    @classmethod
    def _catalog_model(cls, value: str) -> str:
        try:
            return catalog_entry(value).name
        except UnknownNameError as exc:  # its message lists the close names
            raise ValueError(exc.message) from None


class DefragBody(BaseModel):
    """What to make room for: ``need_gpus`` free GPUs in one group, or the TP group of ``model`` (at ``tp``)."""

    model_config = ConfigDict(allow_inf_nan=False, frozen=True, extra="forbid")

    need_gpus: int | None = Field(default=None, ge=1, le=4096, description="free GPUs wanted in one group")
    model: str | None = Field(
        default=None,
        min_length=1,
        description="catalog model name: make room for its TP group (instead of need_gpus)",
        json_schema_extra={"enum": [e.name for e in ENTRIES]},
    )
    tp: int | None = Field(default=None, ge=1, le=1024, description="tensor-parallel degree of model (a power of 2)")
    level: Literal["nvlink", "node"] | None = Field(
        default=None, description="group to free: an NVLink domain or a node (default: from the model, else nvlink)"
    )
    max_moves: int = Field(default=4, ge=1, le=16, description="most instances moved (the service's limit applies)")
    dry_run: bool = Field(default=True, description="plan only; false books the replacements")

    @field_validator("model")
    @classmethod
    def _catalog_model(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return catalog_entry(value).name
        except UnknownNameError as exc:
            raise ValueError(exc.message) from None

    @model_validator(mode="after")
    def _one_target(self) -> DefragBody:
        if (self.need_gpus is None) == (self.model is None):
            raise ValueError("give need_gpus or model (one of them)")
        if self.tp is not None and (self.model is None or self.tp & (self.tp - 1)):
            raise ValueError(f"tp goes with model and is a power of 2 (got {self.tp})")
        return self

    def request(self) -> PlacementRequest:
        """The placement request whose TP group the plan makes room for (``model`` given)."""
        assert self.model is not None
        return PlacementRequest(id="defrag", model=self.model, allowed_tp=None if self.tp is None else (self.tp,))


class FinishMoveBody(BaseModel):
    """A move whose new engine is up and whose old one is drained: release the old copy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    placement_id: PlacementId = Field(description="the old copy (the instance moved)")
    replacement_id: PlacementId = Field(description="its booked replacement")


class RenewBody(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, frozen=True, extra="forbid")

    ttl_s: float = Field(gt=0, le=30 * 24 * 3600, description="new lease length from now")


class RankOut(BaseModel):
    instance: str
    rank: int
    node: str
    gpu: int
    stage: int


class PdOut(BaseModel):
    """A disaggregated request's roles as asked, and which prefill instance each decode instance pairs with."""

    prefill: int
    decode: int
    kv_store: Literal["mooncake"] | None
    same_rack_required: bool
    pairs: dict[str, str | None] = Field(description="decode instance id -> its prefill instance id")


class StoreOut(BaseModel):
    """One KV-cache store: a node's host memory and RDMA NICs (no GPUs)."""

    node: str
    rack: str | None
    nics: list[str]


class PlacementOut(BaseModel):
    """One placement request's result: every instance, and all their ranks.

    A disaggregated request's instances carry ``role``, ``kv_nics`` and ``host_numa`` (one per rank);
    the answer adds ``pd`` and ``stores``.
    """

    id: str
    model: str
    status: Literal["placed", "degraded"]
    replicas: int
    ranks: list[RankOut]
    instances: list[dict[str, Any]]
    expires_at: float | None = None
    owner: str = ""
    request: dict[str, Any]
    pd: PdOut | None = Field(default=None, description="disaggregated requests only")
    stores: list[StoreOut] | None = Field(default=None, description="disaggregated requests only (empty: no store)")


class NotPlacedOut(BaseModel):
    id: str
    status: Literal["no-capacity", "rejected", "conflict"]
    reasons: list[str]


class ReportAlert(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")

    kind: Literal["TOPOLOGY_DRIFT", "PCIE_BUDGET_WARNING", "HBM_DRIFT"]
    gpu: str = Field(max_length=200)
    subject: str = Field(default="", max_length=200)
    observed: float = 0.0
    expected: float = 0.0
    message: str = Field(default="", max_length=2000)


class ReportBody(BaseModel):
    """What ``toposched sidecar --webhook`` posts (``Report.to_json()``)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")

    placement: str = Field(min_length=1, max_length=200, description="instance id the sidecar watches")
    node: str = Field(default="", max_length=200)
    cycle: int = Field(default=0, ge=0)
    new_alerts: list[ReportAlert] = Field(default_factory=list, max_length=1000)
    active_alerts: list[ReportAlert] = Field(default_factory=list, max_length=1000)
    cpu_seconds: float = 0.0

    def report(self) -> Report:
        """The sidecar's own ``Report`` value, which the replica reacts to (``ServiceState.report``)."""
        from toposched.sidecar.checks import Alert
        from toposched.sidecar.loop import Report

        return Report(
            placement_id=self.placement,
            node=self.node,
            cycle=self.cycle,
            new_alerts=tuple(Alert(**a.model_dump()) for a in self.new_alerts),
            active_alerts=tuple(Alert(**a.model_dump()) for a in self.active_alerts),
            cpu_seconds=self.cpu_seconds,
        )


# ---------------------------------------------------------------------------------------------- answers
# Documented in the OpenAPI spec; the routes build their JSON directly (no validation on the way out), and
# schemathesis checks every answer against these (tests/service/test_schemathesis.py).


class FieldProblem(BaseModel):
    field: str = Field(description="where, e.g. body.replicas")
    message: str


class ErrorOut(BaseModel):
    """Every error answer: what went wrong, and where there is one, the detail, the fix or the bad fields."""

    error: str = Field(description="short kind: invalid request, unauthorized, not found, body too large, ...")
    detail: str | None = None
    fix: str | None = None
    fields: list[FieldProblem] | None = None


class PlacementListOut(BaseModel):
    placements: list[PlacementOut]


class ReleasedOut(BaseModel):
    id: str
    released: list[str] = Field(description="instance ids released")


class MoveOut(BaseModel):
    placement_id: str
    replacement_id: str
    from_gpus: list[str]
    to_gpus: list[str]


class DefragOut(BaseModel):
    """A defragmentation plan: the group freed, its GPUs free afterwards, the moves in order."""

    need_gpus: int
    level: str
    group: str
    frees: list[str]
    moves: list[MoveOut] = Field(description="in the order to start them; empty: the room is there already")
    gpus_moved: int
    dry_run: bool
    booked: list[str] = Field(description="replacement ids booked (not a dry run)")


class FinishedOut(BaseModel):
    placement_id: str
    replacement_id: str
    released: list[str] = Field(description="the old copy, or nothing when it was released already")


class QueueDefragOut(BaseModel):
    """The queue head's defragmentation plan (shown, never run: the service cannot restart engines)."""

    need_gpus: int
    level: str
    group: str | None
    frees: list[str]
    moves: list[MoveOut]
    gpus_moved: int
    reason: str | None = Field(default=None, description="why there is no plan")
    planned_s_ago: float


class QueueItemOut(BaseModel):
    id: str
    slo_class: str
    gpus: int
    occupancy: float
    waited_s: float
    finish_tag: float
    defrag: QueueDefragOut | None = Field(default=None, description="the head only, when its TP group finds no room")
    headroom_left_s: float | None = Field(
        default=None, description="seconds it is still decided with the service's headroom (keep_whole_domains)"
    )
    held_for_headroom: bool | None = Field(
        default=None, description="it has waited because placing it would break a domain the headroom keeps whole"
    )


class QueueOut(BaseModel):
    depth: int
    items: list[QueueItemOut]


class FiringOut(BaseModel):
    alert: str
    severity: str
    signal: str
    value: float
    summary: str
    gpus: list[str] = Field(description="GPUs (node/index) the signal points at, for the web page to outline")


class ThresholdOut(BaseModel):
    alert: str
    signal: str
    op: Literal["<", ">"]
    value: float
    severity: Literal["P0", "P1", "P2"]
    summary: str


class AlertsOut(BaseModel):
    signals: SignalValues = Field(description="the nine signals; null: no source")
    firing: list[FiringOut]
    thresholds: list[ThresholdOut] = Field(description="every alert rule (the same as deploy/prometheus's rules)")


class TopologyOut(BaseModel):
    cluster: str
    version: int
    created_at: float
    source: str
    gpus: int
    free: int
    nodes: list[dict[str, Any]]
    domains: list[dict[str, Any]]


class RefreshOut(BaseModel):
    version: int
    created_at: float
    source: str


class ReactionOut(BaseModel):
    """What a sidecar report changed (``sidecar.react.Reaction.to_json()``)."""

    placement: str
    status: str
    drifted_gpus: list[str]
    alerts: list[dict[str, Any]]
    proposal: dict[str, Any] | None
    reasons: list[str]


class HealthOut(BaseModel):
    status: Literal["ok"]


class ReadyOut(BaseModel):
    status: Literal["ready", "not ready"]
    detail: str | None = None


class SignalSampleOut(BaseModel):
    t: float = Field(description="unix time of the sample (seconds)")
    signals: SignalValues = Field(description="the nine signals then, as /v1/alerts gives them; null: no source")


class SignalHistoryOut(BaseModel):
    """The signals sampled by this replica over the last hour, oldest first (empty after a restart)."""

    now: float = Field(description="the replica's unix time when it answered (to place the samples on a clock)")
    step_s: float = Field(description="seconds between samples")
    window_s: float = Field(description="how far back samples are kept (seconds)")
    samples: list[SignalSampleOut]
