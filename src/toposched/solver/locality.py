"""Choosing GPUs inside one group by locality (shared by ``plan``/the scheduler and ``allocate``)."""

from __future__ import annotations

from collections.abc import Sequence

from toposched.solver.index import ClusterIndex


def pick_in_group(index: ClusterIndex, candidates: Sequence[str], size: int) -> list[str]:
    """``size`` GPUs of ``candidates`` with the best locality (deterministic)."""
    info = index.info
    ordered = sorted(
        candidates, key=lambda r: (info[r].numa if info[r].numa is not None else -1, info[r].pcie or "", info[r].order)
    )
    if len(ordered) == size:
        return ordered
    best: tuple[int, int, int, int] | None = None
    best_window: list[str] = []
    for start in range(len(ordered) - size + 1):
        window = ordered[start : start + size]
        numas = len({info[r].numa for r in window})
        switches = len({info[r].pcie for r in window})
        span = info[window[-1]].order - info[window[0]].order
        key = (numas, switches, span, info[window[0]].order)
        if best is None or key < best:
            best, best_window = key, window
    return best_window
