"""Expert-parallel (EP) placement for MoE models, with replicas of hot experts.

Seed 000 (section 5): count each expert's hit rate, copy the hottest experts to more GPUs and split
their traffic, e.g. the top-8 experts x 2 copies take the hot GPU from ~1.8x to ~1.1x of the mean
load, at the cost of extra expert weights in HBM on the ranks that hold the copies.

``place_experts`` does that in two steps, both deterministic:

1. **Which experts get copies.** Repeatedly give one more copy to the expert with the highest load
   per copy (hit rate / copies) that has fewer than ``max_replicas`` copies, up to
   ``replica_budget`` extra copies. Every prefix of that list (0, 1, ... extra copies) is placed and
   the one with the lowest imbalance is kept (fewest copies on ties), so copies that do not help
   are not spent.
2. **Where every copy goes.** Longest-processing-time-first: copies sorted by load (a copy carries
   ``rate / copies`` of its expert), each to the least-loaded rank that has a free slot and no copy
   of that expert yet. Each rank holds at least ``num_experts / ep`` experts and at most that plus
   ``ceil(extra / ep)``, so the extra copies add one slot to as many ranks as there are copies.

Loads are in the units of ``hit_rates`` (uniform 1.0 per expert when ``None``). Imbalance is
max rank load / mean rank load. ``imbalance_before`` is the engines' default layout (rank *r* holds
experts ``r * E/ep ... (r+1) * E/ep - 1``, no copies), ``imbalance_balanced`` the LPT layout without
copies, ``imbalance_after`` the chosen layout. Extra HBM per rank is ``extra_experts_per_rank`` x
bytes per expert (the caller knows the bytes).

Not done here: routing inside the engine (which copy a token uses) is assumed to split evenly;
re-placement over time (EPLB's periodic rebalancing) is the caller's loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from toposched.errors import InputError

_TIE = 1e-12


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts each EP rank holds, copies per expert, and the load that results."""

    num_experts: int
    ep: int
    experts_per_rank: tuple[tuple[int, ...], ...]
    """Expert ids held by each rank (a replicated expert appears on several ranks)."""
    copies: tuple[int, ...]
    """Copies of each expert (1 = not replicated)."""
    rank_load: tuple[float, ...]
    """Hit load per rank, in the units of ``hit_rates``; sums to the total."""
    imbalance_before: float
    """Max/mean rank load of the contiguous default layout without copies."""
    imbalance_balanced: float
    """Max/mean rank load of the LPT layout without copies."""
    imbalance_after: float
    """Max/mean rank load of this placement."""
    extra_experts_per_rank: tuple[int, ...]
    """Experts held beyond ``num_experts / ep`` per rank (x bytes per expert = extra HBM)."""

    @property
    def replicas(self) -> int:
        """Extra copies used (copies beyond the first, summed over experts)."""
        return sum(c - 1 for c in self.copies)

    @property
    def replicated_experts(self) -> tuple[int, ...]:
        return tuple(e for e, c in enumerate(self.copies) if c > 1)

    @property
    def max_experts_per_rank(self) -> int:
        """Expert slots the fullest rank needs (size its HBM by this)."""
        return max(len(held) for held in self.experts_per_rank)


def _imbalance(loads: Sequence[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def _lpt(
    rates: Sequence[float], copies: Sequence[int], ep: int, base: int, capacity: int
) -> tuple[list[list[int]], list[float]]:
    """Place every copy: heaviest first, on the least-loaded rank with a free slot and no copy yet.

    Every rank ends with at least ``base`` and at most ``capacity`` experts when that is possible:
    once the copies left are just enough to fill the ranks still under ``base``, only those take more.
    """
    units = sorted(
        ((rates[e] / copies[e], e) for e in range(len(rates)) for _ in range(copies[e])),
        key=lambda u: (-u[0], u[1]),
    )
    held: list[list[int]] = [[] for _ in range(ep)]
    loads = [0.0] * ep
    remaining = len(units)
    for load, expert in units:
        deficit = sum(max(0, base - len(h)) for h in held)
        fits = [r for r in range(ep) if len(held[r]) < capacity and expert not in held[r]]
        if remaining - 1 < deficit:
            fits = [r for r in fits if len(held[r]) < base] or fits
        if not fits:  # every rank with room already has this expert: overflow the lightest other rank
            fits = [r for r in range(ep) if expert not in held[r]]
        rank = min(fits, key=lambda r: (loads[r], len(held[r]), r))
        held[rank].append(expert)
        loads[rank] += load
        remaining -= 1
    return [sorted(h) for h in held], loads


def _validate(
    num_experts: int, ep: int, hit_rates: Sequence[float] | None, replica_budget: int, max_replicas: int
) -> list[float]:
    if num_experts < 1:
        raise InputError(f"num_experts must be at least 1 (got {num_experts})")
    if ep < 1:
        raise InputError(f"ep must be at least 1 (got {ep})")
    if num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise InputError(
            f"ep={ep} does not divide num_experts={num_experts}: every EP rank holds the same number of experts",
            fix="use ep in " + ", ".join(map(str, divisors)),
        )
    if replica_budget < 0:
        raise InputError(f"replica_budget must be >= 0 (got {replica_budget})")
    if not 1 <= max_replicas <= ep:
        raise InputError(f"max_replicas must be within [1, ep={ep}] (got {max_replicas}): copies sit on distinct ranks")
    if hit_rates is None:
        return [1.0] * num_experts
    rates = [float(r) for r in hit_rates]
    if len(rates) != num_experts:
        raise InputError(f"hit_rates has {len(rates)} values; num_experts is {num_experts}")
    bad = next((n for n, r in enumerate(rates) if not math.isfinite(r) or r < 0), None)
    if bad is not None:
        raise InputError(f"hit_rates[{bad}] = {rates[bad]!r}; hit rates must be finite and non-negative")
    if sum(rates) <= 0:
        raise InputError("hit_rates are all zero; pass None for uniform rates")
    return rates


def place_experts(
    num_experts: int,
    ep: int,
    hit_rates: Sequence[float] | None,
    *,
    replica_budget: int,
    max_replicas: int = 2,
) -> ExpertPlacement:
    """Place ``num_experts`` experts on ``ep`` ranks, copying hot ones within ``replica_budget``."""
    rates = _validate(num_experts, ep, hit_rates, replica_budget, max_replicas)
    base = num_experts // ep
    before = [sum(rates[r * base : (r + 1) * base]) for r in range(ep)]

    # 1. the order in which copies would be added
    copies = [1] * num_experts
    order: list[int] = []
    for _ in range(replica_budget):
        open_experts = [e for e in range(num_experts) if copies[e] < max_replicas and rates[e] > 0]
        if not open_experts:
            break
        pick = max(open_experts, key=lambda e: (rates[e] / copies[e], -e))
        copies[pick] += 1
        order.append(pick)

    # 2. place each prefix; keep the least imbalanced (fewest copies on ties)
    trial = [1] * num_experts
    held, loads = _lpt(rates, trial, ep, base, base)
    balanced = _imbalance(loads)
    best = (balanced, list(trial), held, loads)
    for used, expert in enumerate(order, start=1):
        trial[expert] += 1
        held, loads = _lpt(rates, trial, ep, base, base + math.ceil(used / ep))
        imbalance = _imbalance(loads)
        if imbalance < best[0] - _TIE:
            best = (imbalance, list(trial), held, loads)
    imbalance, chosen, held, loads = best
    return ExpertPlacement(
        num_experts=num_experts,
        ep=ep,
        experts_per_rank=tuple(tuple(h) for h in held),
        copies=tuple(chosen),
        rank_load=tuple(loads),
        imbalance_before=_imbalance(before),
        imbalance_balanced=balanced,
        imbalance_after=imbalance,
        extra_experts_per_rank=tuple(max(0, len(h) - base) for h in held),
    )
