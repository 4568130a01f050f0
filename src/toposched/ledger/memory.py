"""In-process ledger: the solver's and simulator's default, and the reference the others match.

Reserved bytes per GPU are kept as running sums, so ``accounts()`` and ``reserve()`` cost O(GPUs
touched) plus the expiry of due leases (a heap keyed by expiry time), never a scan of all
reservations.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import ClassVar

from toposched.ledger.base import (
    BACKENDS,
    AuditAction,
    AuditEntry,
    Clock,
    Feature,
    GpuAccount,
    Reservation,
    ReserveResult,
    judge,
    validate_request,
    wall_clock,
)


class MemoryLedger:
    """A ledger in this process's memory."""

    UNSUPPORTED: ClassVar[Mapping[Feature, str]] = {
        Feature.MULTI_PROCESS: "state lives in one process's memory",
        Feature.MULTI_HOST: "state lives in one process's memory",
        Feature.WATCH: "nothing else can see it",
    }

    def __init__(self, capacities: Mapping[str, int] | None = None, *, clock: Clock = wall_clock) -> None:
        self._clock = clock
        self._capacity: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        self._by_id: dict[str, Reservation] = {}
        self._expiry: list[tuple[float, str]] = []
        self._audit: list[AuditEntry] = []
        if capacities:
            self.set_capacity(capacities)

    def _expire(self) -> None:
        now = self._clock()
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, rid = heapq.heappop(self._expiry)
            held = self._by_id.get(rid)
            if held is not None and held.expires_at == expires_at:
                self._drop(held)
                self._log("expire", held, at=expires_at)

    def _log(self, action: AuditAction, held: Reservation, *, at: float | None = None) -> None:
        self._audit.append(
            AuditEntry(
                seq=len(self._audit) + 1,
                at=self._clock() if at is None else at,
                action=action,
                id=held.id,
                owner=held.owner,
                gpus=held.gpus,
                expires_at=held.expires_at,
            )
        )

    def _drop(self, held: Reservation) -> None:
        del self._by_id[held.id]
        for ref, b in held.gpus.items():
            self._reserved[ref] -= b

    def set_capacity(self, capacities: Mapping[str, int]) -> None:
        for ref, cap in capacities.items():
            if cap < 0:
                raise ValueError(f"capacity of {ref} must be >= 0 (got {cap})")
            self._capacity[ref] = cap
            self._reserved.setdefault(ref, 0)

    def accounts(self) -> dict[str, GpuAccount]:
        self._expire()
        return {
            ref: GpuAccount(ref=ref, capacity_bytes=cap, reserved_bytes=self._reserved[ref])
            for ref, cap in self._capacity.items()
        }

    def free_bytes(self, ref: str) -> int:
        """Free bytes of one GPU (cheaper than a full snapshot)."""
        self._expire()
        return self._capacity[ref] - self._reserved[ref]

    def reserve(
        self,
        rid: str,
        gpus: Mapping[str, int],
        *,
        ttl_s: float | None = None,
        owner: str = "",
        meta: Mapping[str, str] | None = None,
    ) -> ReserveResult:
        problem = validate_request(gpus, ttl_s)
        if problem:
            return ReserveResult(status="invalid", reasons={"request": problem})
        self._expire()
        held, cap, used = self._by_id.get(rid), self._capacity, self._reserved
        if held is not None or any(ref not in cap or b > cap[ref] - used[ref] for ref, b in gpus.items()):
            # only a refusal needs the accounts (``judge`` words it as every backend does); a booking that
            # fits skips building them (a scheduler books on every decision: issue 17)
            touched = {
                ref: GpuAccount(ref=ref, capacity_bytes=cap[ref], reserved_bytes=used[ref])
                for ref in gpus
                if ref in cap
            }
            refusal = judge(rid, gpus, held, touched)
            if refusal is not None:
                return refusal
        now = self._clock()
        reservation = Reservation(
            id=rid,
            gpus=dict(gpus),
            owner=owner,
            created_at=now,
            expires_at=None if ttl_s is None else now + ttl_s,
            meta=dict(meta or {}),
        )
        self._by_id[rid] = reservation
        for ref, b in gpus.items():
            self._reserved[ref] += b
        if reservation.expires_at is not None:
            heapq.heappush(self._expiry, (reservation.expires_at, rid))
        self._log("reserve", reservation)
        return ReserveResult(status="reserved", reservation=reservation)

    def renew(self, rid: str, ttl_s: float) -> Reservation | None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive (got {ttl_s})")
        self._expire()
        held = self._by_id.get(rid)
        if held is None:
            return None
        renewed = held.model_copy(update={"expires_at": self._clock() + ttl_s})
        self._by_id[rid] = renewed
        heapq.heappush(self._expiry, (renewed.expires_at or 0.0, rid))
        self._log("renew", renewed)
        return renewed

    def release(self, rid: str) -> bool:
        self._expire()
        held = self._by_id.get(rid)
        if held is None:
            return False
        self._drop(held)
        self._log("release", held)
        return True

    def get(self, rid: str) -> Reservation | None:
        self._expire()
        return self._by_id.get(rid)

    def reservations(self) -> list[Reservation]:
        self._expire()
        return list(self._by_id.values())

    def audit(self, *, since: int = 0, limit: int | None = None) -> list[AuditEntry]:
        self._expire()
        entries = self._audit[max(since, 0) :]
        return entries if limit is None else entries[:limit]

    def close(self) -> None:
        """Nothing to let go of."""


BACKENDS.register("memory", lambda _arg, clock: MemoryLedger(clock=clock))
