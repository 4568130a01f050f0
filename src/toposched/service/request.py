"""What a replica is asked to place: the solver's request plus the service's lease and policy.

``ServiceRequest`` is the domain value the replica decides on (``ServiceState.place``, the admission queue,
the records it keeps in the ledger). The HTTP body (``schemas.PlaceBody``) extends it with what only the
API needs (catalog names only, how long to wait in the queue), so the domain never depends on HTTP.
"""

from __future__ import annotations

import json

from pydantic import ConfigDict, Field

from toposched.names import ID_PATTERN
from toposched.service.config import PolicyName
from toposched.solver.request import PlacementRequest

SOLVER_FIELDS = frozenset(PlacementRequest.model_fields)


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

    def request(self, rid: str) -> PlacementRequest:
        """The solver's request under id ``rid`` (the lease and the policy are the replica's business)."""
        data = self.model_dump(include=set(SOLVER_FIELDS))
        data["id"] = rid
        return PlacementRequest.model_validate(data)

    def key(self) -> str:
        """Canonical JSON of what was asked (without the id): equal keys are one request.

        Only this class's fields count, so what a subclass adds (the API's ``wait_s``) never changes a key.
        ``allow_cross_domain`` is left out while false, so the keys of requests that do not ask for the
        fallback are those booked before the field existed (and the admission queue's fallback retry,
        which sets it on the solver's request only, keeps the key the client sent).
        """
        fields = set(ServiceRequest.model_fields) - {"id"}
        if not self.allow_cross_domain:
            fields.discard("allow_cross_domain")
        return json.dumps(self.model_dump(mode="json", include=fields), sort_keys=True)
