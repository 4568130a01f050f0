"""What a placement call returns (``Outcome``): the placements made and the instances left unplaced, in the
order they were decided."""

from __future__ import annotations

from dataclasses import dataclass, field

from toposched.solver.request import Placement, Unplaced


@dataclass
class Outcome:
    placements: list[Placement] = field(default_factory=list)
    unplaced: list[Unplaced] = field(default_factory=list)


__all__ = ["Outcome"]
