"""The placement objective's weights, shared by the exact baseline (``solver/cpsat.py``, ``exact.objective``) and
the fast batch placer's trial score (``Scheduler.place_batch``): one objective for both (issue 35), in a
module without OR-Tools so the fast path does not import CP-SAT."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from toposched.solver.request import PlacementRequest

if TYPE_CHECKING:
    from toposched.solver.place import Assessment

# the weights, largest first (the table in ``solver/exact.py``)
W_UNPLACED = 10**9
W_SLO = 10**8
W_FALLBACK = 5 * 10**7
W_STAGE = 2 * 10**7
W_GPU = 10**6
W_STAGE_SLO = 10**5
W_BREAK = 10**4
W_FIT = 10
W_NUMA = 1


def layout_cost(request: PlacementRequest, fallbacks: int, pp: int) -> int:
    """The fast policies' option order (``candidates.layout_key``) as objective terms (issue 35: one objective,
    so a gap against exact measures the solver, not a rule only one side follows): ``W_FALLBACK`` per
    capacity fallback (options that fit as asked first); per pipeline stage beyond the first ``W_STAGE``
    without a latency SLO (the default layout rule: PP=1 with the smallest TP that fits before fewer GPUs)
    and ``W_STAGE_SLO`` with one (among equal GPUs, the larger TP first)."""
    has_slo = request.slo_tpot_ms is not None or request.slo_ttft_ms is not None
    return W_FALLBACK * fallbacks + (W_STAGE_SLO if has_slo else W_STAGE) * (pp - 1)


def flagged(chosen: Sequence[tuple[object, Assessment]]) -> int:
    """Capacity fallbacks and SLO misses among a batch trial's choices (``Scheduler.place_batch`` retries
    other orders when there are any)."""
    return sum(len([f for f in a.placement.fallbacks if f != "cross-domain"]) + (not a.meets_slo) for _, a in chosen)


__all__ = [
    "W_BREAK",
    "W_FALLBACK",
    "W_FIT",
    "W_GPU",
    "W_NUMA",
    "W_SLO",
    "W_STAGE",
    "W_STAGE_SLO",
    "W_UNPLACED",
    "flagged",
    "layout_cost",
]
