"""What a replica is asked to place: the solver's request plus the service's lease and policy.

``ServiceRequest`` is the domain value the replica decides on (``ServiceState.place``, the admission queue,
the records it keeps in the ledger). The HTTP body (``schemas.PlaceBody``) extends it with what only the
API needs (catalog names only, how long to wait in the queue), so the domain never depends on HTTP.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, model_validator

from toposched.names import ID_PATTERN
from toposched.service.config import PolicyName
from toposched.solver.pd import (
    Disaggregation,
    KvStoreKind,
    decode_request,
    prefill_request,
    role_ids,
    role_request_id,
)
from toposched.solver.request import PlacementRequest, instance_ids

SOLVER_FIELDS = frozenset(PlacementRequest.model_fields)


class PdSpec(BaseModel):
    """A disaggregated request's roles: how many prefill and decode instances, and the KV-cache store.

    The same choices as ``toposched plan --pd-prefill N --pd-decode M [--kv-store K] [--pd-same-rack-required]``
    (``solver/pd.py`` places them; the request's model, lengths and SLOs apply to both roles).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill: int = Field(ge=1, le=1024, description="prefill instances (sized by the TTFT SLO)")
    decode: int = Field(ge=1, le=1024, description="decode instances (sized by the TPOT SLO and KV capacity)")
    kv_store: KvStoreKind | None = Field(default=None, description="a KV-cache store in each rack decode uses")
    same_rack_required: bool = Field(
        default=False, description="refuse the request when a decode instance cannot share a prefill rack"
    )

    def layout(self) -> Disaggregation:
        """The solver's value for these choices (its ``pairs`` are filled by ``place_pd``)."""
        return Disaggregation.model_validate(self.model_dump())


def slot_ids(rid: str, replicas: int, pd: PdSpec | None) -> list[str]:
    """The instance ids request ``rid`` books: ``instance_ids`` of its replicas, or, disaggregated, its
    prefill then its decode instances (``ID-prefill``/``ID-prefill-N``, ``ID-decode``/``ID-decode-N``)."""
    if pd is None:
        return instance_ids(rid, replicas)
    return [*role_ids(rid, "prefill", pd.prefill), *role_ids(rid, "decode", pd.decode)]


class ServiceRequest(PlacementRequest):
    """A placement request as a replica takes it: all or none over ``replicas``, leased, idempotent by ``id``.

    ``id`` is the idempotency key (empty: the replica generates one): the same id with the same request
    answers the existing placement; with another request, a conflict.
    """

    model_config = ConfigDict(allow_inf_nan=False, frozen=True, extra="forbid")

    id: str = Field(default="", pattern=r"^$|" + ID_PATTERN, description="idempotency key; empty: generated")
    output_len: int = Field(default=256, ge=1, le=10_000_000, description="typical output length, for predictions")
    replicas: int = Field(default=1, ge=1, le=10_000, description="instances to place (all or none)")
    ttl_s: float | None = Field(default=None, gt=0, le=30 * 24 * 3600, description="lease; renew before it ends")
    policy: PolicyName | None = Field(default=None, description="placement policy (default: the service's)")
    pd: PdSpec | None = Field(
        default=None, description="prefill/decode disaggregation: book every prefill and decode instance, or none"
    )
    slo_required: bool = Field(
        default=True,
        description="an instance whose predicted per-request TTFT or TPOT misses the SLO is not placed (the "
        "answer gives the changes that would meet it); false: place the best option anyway",
    )
    request_rate: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        description="requests/s to serve at input_len/output_len: the service books the fewest GPUs that serve it "
        "within the SLO (replicas, tp and pp are chosen; replicas must be left at 1)",
    )

    @model_validator(mode="after")
    def _pd_alone(self) -> ServiceRequest:
        """A disaggregated request counts its instances in ``pd`` and pairs decode near prefill itself;
        a request rate chooses the replicas itself."""
        if self.serving_role is not None:
            raise ValueError("serving_role is set by the service for the roles of pd: leave it out")
        if self.request_rate is not None and (self.replicas != 1 or self.pd is not None):
            raise ValueError("request_rate chooses the replicas: leave replicas at 1 and pd out")
        if self.pd is not None and self.replicas != 1:
            raise ValueError(f"replicas goes without pd (got {self.replicas}): give pd.prefill and pd.decode")
        if self.pd is not None and self.near is not None:
            raise ValueError("near goes without pd: decode instances are placed near their prefill instances")
        return self

    def slot_ids(self, rid: str) -> list[str]:
        """The instance ids this request books under id ``rid`` (all or none)."""
        return slot_ids(rid, self.replicas, self.pd)

    def request(self, rid: str) -> PlacementRequest:
        """The solver's request under id ``rid`` (the lease and the policy are the replica's business)."""
        data = self.model_dump(include=set(SOLVER_FIELDS))
        data["id"] = rid
        return PlacementRequest.model_validate(data)

    def roles(self, rid: str) -> list[tuple[PlacementRequest, int]]:
        """The solver's requests for this request's instances and how many of each: its own request and
        ``replicas``, or, disaggregated, its prefill (sized by TTFT) and decode (sized by TPOT) requests
        and their counts. What the admission queue costs it at, and what a defrag plan makes room for."""
        request = self.request(rid)
        if self.pd is None:
            return [(request, self.replicas)]
        prefill_id, decode_id = role_request_id(rid, "prefill"), role_request_id(rid, "decode")
        return [
            (prefill_request(request, 1), self.pd.prefill),
            (decode_request(request, decode_id, prefill_id, required=False), self.pd.decode),
        ]

    def key(self) -> str:
        """Canonical JSON of what was asked (without the id): equal keys are one request.

        Only this class's fields count, so what a subclass adds (the API's ``wait_s``) never changes a key.
        ``allow_cross_domain`` is left out while false, so the keys of requests that do not ask for the
        fallback are those booked before the field existed (and the admission queue's fallback retry,
        which sets it on the solver's request only, keeps the key the client sent); ``pd`` is left out
        while absent, for the same reason; ``engine`` while it is the default ``vllm``, ``engine_version``
        while absent.
        """
        fields = set(ServiceRequest.model_fields) - {"id"}
        if not self.allow_cross_domain:
            fields.discard("allow_cross_domain")
        if self.pd is None:
            fields.discard("pd")
        if self.slo_required:  # the default, and what every request booked before the field was
            fields.discard("slo_required")
        if self.request_rate is None:
            fields.discard("request_rate")
        if self.engine == "vllm":  # the default, and the engine of every request booked before the field
            fields.discard("engine")
        if self.engine_version is None:  # likewise
            fields.discard("engine_version")
        fields.discard("serving_role")  # always None here (the roles of pd are the service's own requests)
        return json.dumps(self.model_dump(mode="json", include=fields), sort_keys=True)
