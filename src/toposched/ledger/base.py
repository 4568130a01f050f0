"""The HBM ledger: per-GPU accounts and reservations, behind one small interface.

Every backend (memory here; SQLite and etcd in their own modules) keeps the same promises:

* capacity per GPU is registered once (``set_capacity``); free = capacity - sum of live reservations;
* ``reserve`` is atomic across all GPUs of an instance: all of it is booked, or none;
* ``reserve`` is idempotent by reservation id: the same id with the same GPUs and bytes returns the
  existing reservation (status ``already_held``); the same id with different contents is a
  ``conflict`` and changes nothing;
* a reservation may hold a lease (``ttl_s``); once it expires the bytes are free again, whether or
  not anyone calls ``release``; ``renew`` extends a live lease;
* a refusal is a value (``ReserveResult`` with per-GPU reasons), not an exception;
* every change (reserve, release, renew, expire) is appended to an audit log, read with ``audit()``.

GPUs are named by ``node/index`` refs (``toposched.topology.domains.gpu_ref``). Times come from a
clock the caller can replace (the simulator's fake clock; tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from toposched.registry import Registry
from toposched.topology.domains import gpu_ref
from toposched.topology.model import Cluster

GIB = 1024**3
Clock = Callable[[], float]


class Feature(StrEnum):
    LEASES = "leases"
    MULTI_PROCESS = "multi-process"  # several processes on one host share it
    MULTI_HOST = "multi-host"  # several scheduler replicas on different hosts share it
    WATCH = "watch"  # changes reach other holders without polling
    CLOCK = "clock"  # leases expire by the clock given to open_ledger (a fake clock in tests, the simulator)


class Reservation(BaseModel):
    """HBM held on a set of GPUs for one instance."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(min_length=1, description="reservation / request id (idempotency key)")
    gpus: dict[str, int] = Field(description="GPU ref -> bytes reserved on it")
    owner: str = ""
    created_at: float
    expires_at: float | None = None
    meta: dict[str, str] = Field(default_factory=dict)

    def live(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at

    def same_booking(self, gpus: Mapping[str, int]) -> bool:
        return dict(gpus) == self.gpus


class GpuAccount(BaseModel):
    model_config = ConfigDict(frozen=True)

    ref: str
    capacity_bytes: int
    reserved_bytes: int

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.reserved_bytes


ReserveStatus = Literal["reserved", "already_held", "insufficient", "unknown_gpu", "conflict", "invalid"]


class ReserveResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    status: ReserveStatus
    reservation: Reservation | None = None
    reasons: dict[str, str] = Field(default_factory=dict, description="per GPU ref (or 'request'), why not")

    @property
    def ok(self) -> bool:
        return self.status in ("reserved", "already_held")


AuditAction = Literal["reserve", "release", "renew", "expire"]


class AuditEntry(BaseModel):
    """One change to the ledger, in commit order (``seq`` grows with every change)."""

    model_config = ConfigDict(frozen=True)

    seq: int
    at: float = Field(description="when it happened (for 'expire': when the lease ran out)")
    action: AuditAction
    id: str
    owner: str = ""
    gpus: dict[str, int] = Field(default_factory=dict)
    expires_at: float | None = None


class Ledger(Protocol):
    """What the solver, the service and the simulator may do with HBM accounts."""

    UNSUPPORTED: ClassVar[Mapping[Feature, str]]

    def set_capacity(self, capacities: Mapping[str, int]) -> None:
        """Register (or update) the capacity of GPUs; GPUs not named keep theirs."""
        ...

    def accounts(self) -> dict[str, GpuAccount]:
        """A consistent snapshot of every GPU's capacity and live reserved bytes."""
        ...

    def reserve(
        self,
        rid: str,
        gpus: Mapping[str, int],
        *,
        ttl_s: float | None = None,
        owner: str = "",
        meta: Mapping[str, str] | None = None,
    ) -> ReserveResult:
        """Book ``gpus`` (ref -> bytes) all or nothing; idempotent by ``rid``."""
        ...

    def renew(self, rid: str, ttl_s: float) -> Reservation | None:
        """Extend a live reservation's lease to now + ttl_s; None when it is gone."""
        ...

    def release(self, rid: str) -> bool:
        """Drop a reservation; False when there was none (already released or expired)."""
        ...

    def get(self, rid: str) -> Reservation | None:
        """A live reservation by id."""
        ...

    def reservations(self) -> list[Reservation]:
        """Every live reservation."""
        ...

    def audit(self, *, since: int = 0, limit: int | None = None) -> list[AuditEntry]:
        """Changes with ``seq > since``, oldest first (at most ``limit`` of them)."""
        ...

    def close(self) -> None:
        """Let go of connections and files; the ledger object is not used afterwards."""
        ...


def supports(ledger: Ledger, feature: Feature) -> bool:
    """Callers check features, never the backend's class."""
    return feature not in ledger.UNSUPPORTED


def capacities_from_cluster(cluster: Cluster, *, default_gib: float | None = None) -> dict[str, int]:
    """GPU ref -> HBM bytes from a cluster snapshot (``default_gib`` where the source gave none)."""
    out: dict[str, int] = {}
    for node in cluster.nodes:
        for gpu in node.gpus:
            gib = gpu.hbm_gib if gpu.hbm_gib is not None else default_gib
            if gib is None:
                raise ValueError(f"GPU {gpu_ref(node.name, gpu.index)} has no HBM size; give the GPU type")
            out[gpu_ref(node.name, gpu.index)] = round(gib * GIB)
    return out


def validate_request(gpus: Mapping[str, int], ttl_s: float | None) -> str | None:
    """The reason a reserve request is malformed, or None."""
    if not gpus:
        return "a reservation needs at least one GPU"
    bad = [ref for ref, b in gpus.items() if not isinstance(b, int) or b <= 0]
    if bad:
        return f"bytes must be a positive integer on every GPU (not on {', '.join(sorted(bad))})"
    if ttl_s is not None and not ttl_s > 0:
        return f"ttl_s must be positive (got {ttl_s})"
    return None


def check_fit(accounts: Mapping[str, GpuAccount], gpus: Mapping[str, int]) -> tuple[ReserveStatus, dict[str, str]]:
    """Whether ``gpus`` fits in ``accounts``: ('reserved', {}) or a refusal with per-GPU reasons."""
    unknown = {ref: "no such GPU in the ledger" for ref in gpus if ref not in accounts}
    if unknown:
        return "unknown_gpu", unknown
    short = {
        ref: f"needs {b / GIB:.2f} GiB, {accounts[ref].free_bytes / GIB:.2f} GiB free"
        for ref, b in gpus.items()
        if b > accounts[ref].free_bytes
    }
    return ("insufficient", short) if short else ("reserved", {})


def judge(
    rid: str, gpus: Mapping[str, int], held: Reservation | None, touched: Mapping[str, GpuAccount]
) -> ReserveResult | None:
    """Every backend's verdict on a valid request: the answer when the booking cannot go ahead
    (the id already holds these GPUs, holds other GPUs, or the GPUs lack room), None when it can."""
    if held is not None:
        if held.same_booking(gpus):
            return ReserveResult(status="already_held", reservation=held)
        return ReserveResult(status="conflict", reservation=held, reasons={"request": f"id {rid} holds other GPUs"})
    status, reasons = check_fit(touched, gpus)
    return None if status == "reserved" else ReserveResult(status=status, reasons=reasons)


def wall_clock() -> float:
    return time.time()


# Backends by scheme: "memory", "sqlite:PATH", "etcd:http://HOST:PORT". Each backend module registers
# itself; ``toposched.ledger`` imports them all.
BACKENDS: Registry[Callable[[str, Clock], Ledger]] = Registry("ledger backend")


def open_ledger(url: str, *, clock: Clock = wall_clock) -> Ledger:
    """Open a ledger from ``scheme[:argument]`` (no I/O until the first call for remote backends)."""
    scheme, _, arg = url.partition(":")
    return BACKENDS.get(scheme)(arg, clock)
