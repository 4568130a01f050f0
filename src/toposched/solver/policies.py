"""The placement policies of the scheduler (registry ``POLICIES``): each decides one instance of a
request on the scheduler's index, without booking it.

    slo          default: the fewest GPUs that meet the SLO, then best fit, then locality
    latency      largest feasible TP first (seed 000's ``select_tp``), then best fit
    index-order  what engines do today: the degrees ``slo`` would pick, on the lowest free indices
    random       the same degrees on random free GPUs (seeded)
    exact        CP-SAT over the same objective (``solver/exact.py``)

``index-order`` and ``random`` ignore topology on purpose (they are the baselines the simulator
compares against); the placement reports the affinity constraint as broken when it is.

With ``PlacementRequest.allow_cross_domain`` the ``slo`` and ``latency`` policies fall back to TP
groups across NVLink domains when no option meets the request at its affinity level, within the
class's budget share and the SLO (``_cross_domain``). The caller owns the wait before it sets the
flag (``SloClassConfig.cross_domain_after_s``); ``exact`` and the blind policies ignore the flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from toposched.registry import Registry
from toposched.solver.candidates import Candidate
from toposched.solver.index import Group
from toposched.solver.place import Assessment, assess
from toposched.solver.request import PlacementRequest, Unplaced
from toposched.solver.stages import breaks_reserve, find_stages, find_stages_across, fit_cost

if TYPE_CHECKING:  # the scheduler looks its policies up here: no import circle at run time
    from toposched.solver.scheduler import Scheduler

HEADROOM_REASON = "keep_whole_domains"
"""How an ``Unplaced`` reason refusing an option for the request's headroom starts (callers that queue on it)."""


def _search(
    s: Scheduler,
    request: PlacementRequest,
    pid: str,
    replica_nodes: set[str],
    order: Callable[[list[Candidate]], list[Candidate]],
    policy: str,
    *,
    stop_at_first_placeable: bool,
) -> Assessment | Unplaced:
    cands, dropped = s.candidates(request)
    reasons = list(dropped)
    best_violating: Assessment | None = None
    budget_left = s.class_budget_left(request.slo_class)
    winner: tuple[Assessment, tuple[int, int], tuple[Any, ...]] | None = None
    for cand in order(cands):
        option = cand.option
        if winner is not None and winner[2] != (option.tp, option.pp, option.fallbacks):
            break
        level = s.index.resolve_level(request.affinity, option.tp)
        found = None
        if request.near and not request.near_required:  # preferred role affinity: try near first
            near = s.group_filter(request, cand.nodes, replica_nodes, near_strict=True)
            found = find_stages(s.index, option.tp, option.pp, level, near, lambda _r: True)
        if found is None:
            accept = s.group_filter(request, cand.nodes, replica_nodes)
            found = find_stages(s.index, option.tp, option.pp, level, accept, lambda _r: True)
        if found is None:
            reasons.append(
                f"tp={option.tp} pp={option.pp} on {cand.options.gpu.name}: no {level} group with "
                f"{option.tp} free GPUs for each of {option.pp} stage(s)"
            )
            continue
        stages, _ = found
        held = _headroom_refusal(s, request, stages)
        if held:
            reasons.append(f"tp={option.tp} pp={option.pp}: {held}")
            continue
        result = assess(
            s.index, cand.options, option, stages, placement_id=pid, request_id=request.id, policy=policy,
            required_level=level, budget_left_gbps=budget_left,
        )  # fmt: skip
        capacity = result.placement.check("capacity")
        if not capacity.held:
            reasons.append(f"tp={option.tp} pp={option.pp}: {capacity.detail}: not enough KV left")
            continue
        if result.cross_gbps > budget_left + 1e-9:
            reasons.append(
                f"tp={option.tp} pp={option.pp}: {result.cross_gbps:.1f} GB/s cross-domain traffic over the "
                f"{budget_left:.1f} GB/s left in the budget"
            )
            continue
        if result.meets_slo or stop_at_first_placeable:
            # the same degrees on another GPU type may fit better: keep the one breaking the fewest
            # whole NVLink groups, then the tightest (candidates of equal degrees are adjacent)
            cost = fit_cost(s.index, stages)
            if winner is None or cost < winner[1]:
                winner = (result, cost, (option.tp, option.pp, option.fallbacks))
            continue
        if best_violating is None or result.placement.tpot_ms < best_violating.placement.tpot_ms:
            best_violating = result
        reasons.append(f"tp={option.tp} pp={option.pp}: {result.placement.check('slo').detail}")
    if winner is not None:
        return winner[0]
    if request.allow_cross_domain:
        # Nothing meets the request at its affinity level (slo: nothing placeable meets the SLO;
        # latency: nothing placeable). A cross-domain placement that meets the SLO is preferred to
        # an in-domain SLO miss, as the objective ranks SLO misses above everything but unplaced.
        fallback = _cross_domain(s, request, pid, replica_nodes, order(cands), policy, budget_left, reasons)
        if fallback is not None:
            return fallback
    if best_violating is not None:
        return best_violating
    if not cands:
        reasons.append(f"{request.model} fits no degree within the limits (max pp {request.max_pp})")
    else:
        first = cands[0]
        level = s.index.resolve_level(request.affinity, first.option.tp)
        reasons.extend(s.why_not(first.option.tp, request, first.nodes, level))
    return Unplaced(request_id=request.id, replica=0, status="queued" if cands else "rejected", reasons=tuple(reasons))


def _headroom_refusal(s: Scheduler, request: PlacementRequest, stages: Sequence[Sequence[str]]) -> str | None:
    """Why ``stages`` break the request's ``keep_whole_domains`` headroom, or None when they do not."""
    keep = request.keep_whole_domains
    if not keep or not breaks_reserve(s.index, stages, keep, s.headroom_size):
        return None
    return (
        f"{HEADROOM_REASON} {keep}: it would break one of the last {keep} wholly free NVLink domain(s) kept "
        "for instances that need a whole one"
    )


def _cross_domain(
    s: Scheduler,
    request: PlacementRequest,
    pid: str,
    replica_nodes: set[str],
    cands: list[Candidate],
    policy: str,
    budget_left: float,
    reasons: list[str],
) -> Assessment | None:
    """The bounded cross-domain fallback: the options again, with TP groups allowed across domains.

    GPUs from ``find_stages_across`` (the fewest domains). A choice is kept only when its
    cross-domain traffic, after the compression the class allows, fits the class's budget left and
    its predicted TPOT/TTFT, with the compression and overlap the class allows, meet the request's
    SLO: the fallback never returns an SLO miss. Options are tried in the policy's order; among the
    same degrees on several GPU types, the fewest domains spanned, then the least traffic. Each
    refusal is added to ``reasons`` (they reach ``Unplaced.reasons`` when nothing is placed).
    """
    best: tuple[Assessment, tuple[int, float], tuple[Any, ...]] | None = None
    for cand in cands:
        option = cand.option
        degrees = (option.tp, option.pp, option.fallbacks)
        if best is not None and best[2] != degrees:
            break
        level = s.index.resolve_level(request.affinity, option.tp)
        if option.tp == 1 or level == "none":
            continue  # nothing to relax: one GPU is in one domain; level none was searched already
        where = f"cross-domain fallback, tp={option.tp} pp={option.pp} on {cand.options.gpu.name}"
        accept = s.group_filter(request, cand.nodes, replica_nodes)
        stages = find_stages_across(s.index, option.tp, option.pp, accept, lambda _r: True)
        if stages is None:
            reasons.append(
                f"{where}: no free GPUs for it ({len(s.index.free)} free in the cluster; needs {option.gpus} "
                "on nodes the request may use, in equal shares per node)"
            )
            continue
        held = _headroom_refusal(s, request, stages)
        if held:
            reasons.append(f"{where}: {held}")
            continue
        result = assess(
            s.index, cand.options, option, stages, placement_id=pid, request_id=request.id, policy=policy,
            required_level=level, budget_left_gbps=budget_left,
        )  # fmt: skip
        checks = {c.name: c for c in result.placement.constraints}
        if checks["domain-affinity"].held:
            continue  # these GPUs sit in one group of the level after all: the main pass judged them
        if not checks["capacity"].held:
            reasons.append(f"{where}: {checks['capacity'].detail}: not enough KV left")
            continue
        if result.cross_gbps > budget_left + 1e-9:
            compressed = " after fp8 compression" if result.placement.compression else ""
            reasons.append(
                f"{where}: {result.cross_gbps:.2f} GB/s cross-domain traffic{compressed} is over the "
                f"{budget_left:.2f} GB/s left for class {request.slo_class} (by {result.cross_gbps - budget_left:.2f})"
            )
            continue
        if not result.meets_slo:
            applied = [f"{result.placement.compression} compression"] if result.placement.compression else []
            applied += [f"{result.placement.overlap:.0%} overlap"] if result.placement.overlap else []
            reasons.append(
                f"{where}: predicted {checks['slo'].detail} misses the SLO "
                f"(with {' and '.join(applied) or f'no compression or overlap: class {request.slo_class}'})"
            )
            continue
        refs = result.placement.gpu_refs
        spanned = len({s.index.dmap.gpu_domain.get(r) or r for r in refs})
        key = (spanned, result.cross_gbps)
        if best is None or key < best[1]:
            best = (result, key, degrees)
    if best is None:
        return None
    # Recorded on the placement: the fallback's name, and the affinity check broken on purpose.
    placement = best[0].placement
    relaxed = tuple(
        c.model_copy(update={"detail": f"{c.detail}; relaxed by the cross-domain fallback"})
        if c.name == "domain-affinity"
        else c
        for c in placement.constraints
    )
    placement = placement.model_copy(
        update={"constraints": relaxed, "fallbacks": (*placement.fallbacks, "cross-domain")}
    )
    return dataclasses.replace(best[0], placement=placement)


def _slo(s: Scheduler, request: PlacementRequest, pid: str, replica_nodes: set[str]) -> Assessment | Unplaced:
    return _search(s, request, pid, replica_nodes, lambda c: c, "slo", stop_at_first_placeable=False)


def _latency(s: Scheduler, request: PlacementRequest, pid: str, replica_nodes: set[str]) -> Assessment | Unplaced:
    def largest_tp_first(cands: list[Candidate]) -> list[Candidate]:
        return sorted(cands, key=lambda c: (-c.option.tp, c.option.pp, c.options.gpu.name))

    return _search(s, request, pid, replica_nodes, largest_tp_first, "latency", stop_at_first_placeable=True)


def _blind(
    s: Scheduler,
    request: PlacementRequest,
    pid: str,
    replica_nodes: set[str],
    pick: Callable[[list[tuple[Group, int]], int], list[str]],
    pick_any: Callable[[int], list[str]],
    policy: str,
) -> Assessment | Unplaced:
    """Topology-blind baselines: the degrees slo would choose on an empty machine, any free GPUs.

    ``pick`` gets the nodes that may be used, in cluster order, with their free-GPU counts (from the
    node-level index, so no scan of every GPU) and returns the GPUs in rank order. When every node may
    be used, ``pick_any`` chooses among all free GPUs through the node level's ``FreeCounts`` instead,
    in O(log nodes) per GPU: no list of the nodes with room (issue 17: the blind policies within 1.5x of
    ``slo`` at any size).
    """
    cands, dropped = s.candidates(request)
    nodes = s.index.levels["node"]
    for cand in cands:
        option = cand.option
        est = cand.options.latency(option, cand.options.gpu.native_link)
        if not cand.options.meets_slo(est) and cand is not cands[-1]:
            continue
        if s.filters_nothing(request, cand.nodes) and nodes.counts is not None:
            if nodes.counts.total < option.gpus:
                continue
            chosen = pick_any(option.gpus)
        else:
            accept = s.group_filter(request, cand.nodes, replica_nodes)
            usable = [(nodes.groups[i], nodes.free_count[i]) for i in nodes.with_free() if accept(nodes.groups[i])]
            if sum(count for _, count in usable) < option.gpus:
                continue
            chosen = pick(usable, option.gpus)
        stages = [chosen[i * option.tp : (i + 1) * option.tp] for i in range(option.pp)]
        return assess(
            s.index, cand.options, option, stages, placement_id=pid, request_id=request.id, policy=policy,
            required_level=s.index.resolve_level(request.affinity, option.tp), budget_left_gbps=float("inf"),
        )  # fmt: skip
    return Unplaced(request_id=request.id, replica=0, status="queued", reasons=(*dropped, "not enough free GPUs"))


def _lowest_indices(s: Scheduler, usable: list[tuple[Group, int]], n: int) -> list[str]:
    chosen: list[str] = []
    for group, _ in usable:
        chosen.extend(r for r in group.gpus if r in s.index.free)
        if len(chosen) >= n:
            break
    return chosen[:n]


def _random_gpus(s: Scheduler, usable: list[tuple[Group, int]], n: int) -> list[str]:
    """n distinct free GPUs, each uniformly at random among those left (seeded)."""
    groups = [g for g, _ in usable]
    counts = [c for _, c in usable]
    taken: set[str] = set()
    chosen: list[str] = []
    for _ in range(n):
        (k,) = s.rng.choices(range(len(groups)), weights=counts)
        free_here = [r for r in groups[k].gpus if r in s.index.free and r not in taken]
        ref = s.rng.choice(free_here)
        taken.add(ref)
        chosen.append(ref)
        counts[k] -= 1
    return chosen


def _lowest_free(s: Scheduler, n: int) -> list[str]:
    """``_lowest_indices`` over every node: the nodes holding the first ``n`` free GPUs, found by count."""
    nodes = s.index.levels["node"]
    counts, free = nodes.counts, s.index.free
    assert counts is not None
    chosen: list[str] = []
    while len(chosen) < n:
        group = counts.find(len(chosen) + 1)
        chosen.extend(r for r in nodes.groups[group].gpus if r in free)
    return chosen[:n]


def _random_free(s: Scheduler, n: int) -> list[str]:
    """``_random_gpus`` over every node: each GPU uniformly at random among the free ones left (seeded)."""
    nodes = s.index.levels["node"]
    counts, free = nodes.counts, s.index.free
    assert counts is not None
    chosen: list[str] = []
    taken: list[int] = []
    try:
        for _ in range(n):
            group = counts.find(s.rng.randrange(counts.total) + 1)
            ref = s.rng.choice([r for r in nodes.groups[group].gpus if r in free and r not in chosen])
            counts.add(group, -1)  # not offered again in this pick
            taken.append(group)
            chosen.append(ref)
    finally:
        for group in taken:
            counts.add(group, +1)
    return chosen


def _index_order(s: Scheduler, request: PlacementRequest, pid: str, replica_nodes: set[str]) -> Assessment | Unplaced:
    return _blind(
        s, request, pid, replica_nodes, lambda usable, n: _lowest_indices(s, usable, n),
        lambda n: _lowest_free(s, n), "index-order",
    )  # fmt: skip


def _random(s: Scheduler, request: PlacementRequest, pid: str, replica_nodes: set[str]) -> Assessment | Unplaced:
    return _blind(
        s, request, pid, replica_nodes, lambda usable, n: _random_gpus(s, usable, n),
        lambda n: _random_free(s, n), "random",
    )  # fmt: skip


def _exact(s: Scheduler, request: PlacementRequest, pid: str, replica_nodes: set[str]) -> Assessment | Unplaced:
    from toposched.solver.exact import choose  # CP-SAT is imported only when this policy is used

    return choose(s, request, pid, replica_nodes)


Policy = Callable[["Scheduler", PlacementRequest, str, set[str]], Assessment | Unplaced]
POLICIES: Registry[Policy] = Registry("placement policy")
for _name, _fn in (
    ("slo", _slo),
    ("latency", _latency),
    ("index-order", _index_order),
    ("random", _random),
    ("exact", _exact),
):
    POLICIES.register(_name, _fn)


__all__ = ["HEADROOM_REASON", "POLICIES", "Policy"]
