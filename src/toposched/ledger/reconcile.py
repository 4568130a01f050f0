"""Reconciliation: what the ledger says is reserved on each GPU against what is observed in use.

The observed bytes come from outside (the sidecar's NVML readings, later); this module is a pure
function over values, so the service, the sidecar and tests call it the same way. A GPU is
reported when the two differ by more than ``tolerance`` of the reserved bytes, or when one side
has bytes and the other has none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

from toposched.ledger.base import GIB, Reservation

DifferenceKind = Literal["over", "under", "untracked", "unobserved"]


class Difference(BaseModel):
    """One GPU whose observed use does not match its reservations."""

    model_config = ConfigDict(frozen=True)

    ref: str
    kind: DifferenceKind  # over/under: observed above/below reserved; untracked: use without reservation;
    # unobserved: reserved but no reading for the GPU
    reserved_bytes: int
    observed_bytes: int | None
    reservations: tuple[str, ...] = ()

    def describe(self) -> str:
        seen = "no reading" if self.observed_bytes is None else f"{self.observed_bytes / GIB:.2f} GiB in use"
        held = f" by {', '.join(self.reservations)}" if self.reservations else ""
        return f"{self.ref}: {self.kind}: {self.reserved_bytes / GIB:.2f} GiB reserved{held}, {seen}"


def reconcile(
    reservations: Iterable[Reservation], observed: Mapping[str, int], *, tolerance: float = 0.10
) -> list[Difference]:
    """Differences between reserved and observed bytes per GPU, sorted by GPU ref."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1) (got {tolerance})")
    reserved: dict[str, int] = {}
    holders: dict[str, list[str]] = {}
    for r in reservations:
        for ref, b in r.gpus.items():
            reserved[ref] = reserved.get(ref, 0) + b
            holders.setdefault(ref, []).append(r.id)
    out = []
    for ref in sorted(reserved.keys() | observed.keys()):
        held, seen = reserved.get(ref, 0), observed.get(ref)
        kind: DifferenceKind | None = None
        if seen is None:
            kind = "unobserved" if held else None
        elif held == 0:
            kind = "untracked" if seen > 0 else None
        elif seen > held * (1 + tolerance):
            kind = "over"
        elif seen < held * (1 - tolerance):
            kind = "under"
        if kind is not None:
            ids = tuple(sorted(holders.get(ref, [])))
            out.append(Difference(ref=ref, kind=kind, reserved_bytes=held, observed_bytes=seen, reservations=ids))
    return out
