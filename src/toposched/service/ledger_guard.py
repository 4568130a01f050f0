"""The service's view of the ledger: whole-GPU bookings, placement records, and its own changes.

The scheduler hands out whole GPUs (its index marks a GPU busy once anything is reserved on it), but the
ledger counts bytes: two replicas that both pick GPU 3 for small models could both fit their bytes on it.
``GuardedLedger`` closes that gap for the service: every booking takes the GPU's *whole capacity*, so the
ledger's atomic compare-and-swap refuses the second replica, which then resyncs and retries. The HBM the
plan needs is kept in the reservation's ``meta`` (``hbm_bytes``), next to the placement record the
scheduler attaches (``placement``) that lets any replica rebuild its state from the ledger alone.

It keeps the last write's failure (``write_problem``: a full disk, a read-only or damaged file) until a write
works again, which ``/readyz`` reports (issue 37: every write answered 503 while /readyz said 200).

It also remembers which audit entries it caused itself, so a replica following the audit log can tell
its own changes from other replicas' (``foreign``). Each record goes once its entry has been read: the
replica reads every entry of the log, by ``follow`` or by ``resync``, so the record stays small.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from toposched.errors import StateError
from toposched.ledger.base import AuditEntry, Feature, GpuAccount, Ledger, Reservation, ReserveResult

WRITE_PROBLEM_CHARS = 300
T = TypeVar("T")


class GuardedLedger:
    """A ``Ledger`` that books whole GPUs and attaches the pending placement record to each booking."""

    UNSUPPORTED: ClassVar[Mapping[Feature, str]] = {}

    def __init__(self, inner: Ledger, capacities: Mapping[str, int]) -> None:
        self.inner = inner
        self.capacities = dict(capacities)
        self.booked: dict[str, Reservation] = {}
        self._mine: Counter[tuple[str, str]] = Counter()
        self.write_problem: str | None = None
        """Why the last write to the ledger failed (None once one works): /readyz answers 503 with it."""

    def _wrote(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a write; keep its failure for /readyz (cleared by the next write that works)."""
        try:
            out = call(*args, **kwargs)
        except StateError as exc:
            self.write_problem = f"the last write to the state failed: {exc.message}"[:WRITE_PROBLEM_CHARS]
            raise
        self.write_problem = None
        return out

    # ------------------------------------------------------------------ own changes

    def foreign(self, entries: list[AuditEntry]) -> bool:
        """Whether any of ``entries`` (read from the audit log) came from someone else; marks own ones seen."""
        other = False
        for entry in entries:
            key = (entry.action, entry.id)
            if self._mine[key] > 0:
                self._mine[key] -= 1
                if not self._mine[key]:
                    del self._mine[key]
            else:
                other = True
        return other

    # ------------------------------------------------------------------ the Ledger interface

    def set_capacity(self, capacities: Mapping[str, int]) -> None:
        self._wrote(self.inner.set_capacity, capacities)
        self.capacities.update(capacities)

    def accounts(self) -> dict[str, GpuAccount]:
        return self.inner.accounts()

    def reserve(
        self,
        rid: str,
        gpus: Mapping[str, int],
        *,
        ttl_s: float | None = None,
        owner: str = "",
        meta: Mapping[str, str] | None = None,
    ) -> ReserveResult:
        planned = set(gpus.values())
        whole = {ref: self.capacities.get(ref, b) for ref, b in gpus.items()}
        record = dict(meta or {})
        record["hbm_bytes"] = str(max(planned)) if planned else "0"
        result: ReserveResult = self._wrote(self.inner.reserve, rid, whole, ttl_s=ttl_s, owner=owner, meta=record)
        held = result.reservation
        if result.status == "already_held" and held is not None and _request_of(held.meta) != _request_of(record):
            # the id holds these GPUs for another request (the same id with another body, booked at the same
            # moment by another replica): not ours, whatever the GPUs say
            reason = f"id {rid} is held by another request"
            return ReserveResult(status="conflict", reservation=held, reasons={"request": reason})
        if result.status == "reserved":
            self._mine[("reserve", rid)] += 1
        if result.ok and result.reservation is not None:
            self.booked[rid] = result.reservation
        return result

    def renew(self, rid: str, ttl_s: float) -> Reservation | None:
        renewed: Reservation | None = self._wrote(self.inner.renew, rid, ttl_s)
        if renewed is not None:
            self._mine[("renew", rid)] += 1
        return renewed

    def release(self, rid: str) -> bool:
        released: bool = self._wrote(self.inner.release, rid)
        if released:
            self._mine[("release", rid)] += 1
        return released

    def get(self, rid: str) -> Reservation | None:
        return self.inner.get(rid)

    def reservations(self) -> list[Reservation]:
        return self.inner.reservations()

    def audit(self, *, since: int = 0, limit: int | None = None) -> list[AuditEntry]:
        return self.inner.audit(since=since, limit=limit)

    def close(self) -> None:
        self.inner.close()


def _request_of(meta: Mapping[str, str]) -> tuple[str | None, str | None]:
    """What a booking is for: its request id and body (the service's records; None for other bookings)."""
    return meta.get("request_id"), meta.get("request")
