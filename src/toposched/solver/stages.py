"""Turning a degree option into concrete GPUs, and what a choice of GPUs costs the free blocks.

* ``find_stages`` picks ``pp`` TP groups of ``tp`` GPUs that each sit inside one group of the
  affinity level, in a layout the engines can launch (``solver/layout.py``): best fit (the group
  with the fewest free GPUs that still has room, so large free blocks stay whole), all stages on
  one node when one has room, else whole stages spread evenly over nodes. ``find_stages_across``
  lets TP groups span NVLink domains (the scheduler's bounded cross-domain fallback).
* ``pick_in_group`` (``solver/picking.py``) chooses the GPUs inside a group with the scoring that
  ``allocate`` uses; in a group spanning nodes, equal shares of the fewest nodes.
* ``fragmentation``, ``breaks_reserve`` and ``fit_cost`` say which whole NVLink groups a choice
  breaks and how tightly it fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from toposched.solver.index import ClusterIndex, Group, LevelIndex
from toposched.solver.layout import layout_problem, per_node_choices
from toposched.solver.picking import pick_in_group
from toposched.topology.domains import gpu_ref

GroupFilter = Callable[[Group], bool]


def _fit_key(level_index: LevelIndex, g: int, room: int) -> tuple[int, int]:
    """Best-fit order of a group: the least room that suffices, then partly used before wholly free
    (the other way round under ``keep_whole``)."""
    whole = int(level_index.free_count[g] == level_index.size[g])
    return (whole, room) if level_index.keep_whole else (room, whole)


def _one_stage(
    index: ClusterIndex, tp: int, level: str, accept: GroupFilter, ok: Callable[[str], bool]
) -> tuple[list[str], Group] | None:
    """One TP group of ``tp`` GPUs inside one accepted group of ``level`` (best fit), or None."""
    level_index = index.levels[level]
    for g in level_index.best_fit(tp):
        group = level_index.groups[g]
        if not accept(group):
            continue
        room = [r for r in group.gpus if r in index.free and ok(r)]
        if len(room) < tp:
            continue
        picked = pick_in_group(index, room, tp)
        if picked is not None:
            return list(picked), group
    return None


def _stages_on_node(
    index: ClusterIndex, node: str, tp: int, count: int, level: str, accept: GroupFilter, ok: Callable[[str], bool]
) -> tuple[list[list[str]], list[Group]] | None:
    """``count`` disjoint TP groups on one node, each inside one accepted group of ``level``."""
    level_index = index.levels[level]
    refs = [gpu_ref(node, g.index) for g in index.nodes[node].gpus]
    usable = [r for r in refs if r in index.free and ok(r)]
    if len(usable) < tp * count:
        return None
    ids = sorted({g for r in usable for g in level_index.of_gpu.get(r, ())})
    taken: set[str] = set()
    stages: list[list[str]] = []
    groups: list[Group] = []
    for _ in range(count):
        best: tuple[tuple[int, int, int], Group, list[str]] | None = None
        for g in ids:
            group = level_index.groups[g]
            if not accept(group):
                continue
            room = [r for r in group.gpus if r in usable and r not in taken]
            if len(room) < tp:
                continue
            # the previous stage's group first (consecutive stages stay together), then best fit
            key = (0 if groups and group is groups[-1] else 1, *_fit_key(level_index, g, len(room)))
            if best is None or key < best[0]:
                best = (key, group, room)
        if best is None:
            return None
        picked = pick_in_group(index, best[2], tp)
        if picked is None:
            return None
        taken.update(picked)
        stages.append(list(picked))
        groups.append(best[1])
    return stages, groups


def find_stages(
    index: ClusterIndex, tp: int, pp: int, level: str, accept: GroupFilter, allowed: Callable[[str], bool]
) -> tuple[list[list[str]], list[Group]] | None:
    """``pp`` disjoint TP groups of ``tp`` GPUs, each inside one group of ``level``, in a layout the
    engines can launch (``solver/layout.py``); None if impossible.

    Tried in this order, the first that fits wins:

    1. one stage: best fit over the level's groups (a TP group may span nodes only where the group
       does, e.g. a multi-node NVLink domain; ``pick_in_group`` then takes equal shares of the fewest
       nodes);
    2. every stage on one node (best-fit node);
    3. ``k`` whole stages on each of ``pp / k`` nodes, the most stages per node first (so pipeline
       stages align with nodes and every node runs the same number of GPUs);
    4. stages that each span nodes (TP over a multi-node NVLink domain), no node shared by two stages.
    """
    if pp == 1:
        one = _one_stage(index, tp, level, accept, allowed)
        if one is None or _layout_problem(index, [one[0]], tp):
            return None
        return [one[0]], [one[1]]
    node_index = index.levels["node"]
    largest_node = node_index.max_size
    for per_node in (k for k in range(pp, 0, -1) if pp % k == 0 and k * tp <= largest_node):
        stages: list[list[str]] = []
        groups: list[Group] = []
        for g in node_index.best_fit(per_node * tp):
            node_group = node_index.groups[g]
            if not accept(node_group):
                continue
            (node,) = node_group.nodes
            hosted = _stages_on_node(index, node, tp, per_node, level, accept, allowed)
            if hosted is None:
                continue
            stages.extend(hosted[0])
            groups.extend(hosted[1])
            if len(stages) == pp:
                return stages, groups
    if not index.levels[level].spans_nodes:
        return None
    used_nodes: set[str] = set()
    stages, groups = [], []
    for _ in range(pp):
        one = _one_stage(index, tp, level, accept, lambda r: allowed(r) and index.info[r].node not in used_nodes)
        if one is None:
            return None
        stages.append(one[0])
        groups.append(one[1])
        used_nodes.update(index.info[r].node for r in one[0])
    if _layout_problem(index, stages, tp):
        return None
    return stages, groups


def find_stages_across(
    index: ClusterIndex, tp: int, pp: int, accept: GroupFilter, allowed: Callable[[str], bool]
) -> list[list[str]] | None:
    """``pp`` TP groups of ``tp`` GPUs that may span NVLink domains (the cross-domain fallback), in a
    layout the engines can launch; None if the free GPUs cannot hold them.

    The fewest domains first, which on machines with one NVLink domain per node means the fewest
    nodes:

    1. every TP group inside one node (``find_stages`` at level ``node``): on a node with several
       domains (NVLink pairs or quads, PCIe boxes) the group crosses them over PCIe, not the network;
    2. each TP group in equal shares of the fewest nodes (``layout.py``: a node holds an equal share
       of one TP group), the largest share first; no node shared by two stages. The nodes are taken
       by best fit (the fewest free GPUs that still hold the share, partly used before wholly free),
       not largest first: at equal span that leaves the large free blocks whole for the in-domain
       placements that need them.

    ``accept`` is asked about single nodes only (a group of level ``none`` is the whole cluster,
    which a selector or rack filter would refuse as a whole).
    """
    found = find_stages(index, tp, pp, "node", accept, allowed)
    if found is not None:
        return found[0]
    node_index = index.levels["node"]
    for share in per_node_choices(tp, 1, [node_index.max_size]):
        if share == tp:
            continue  # one node holding the whole group: step 1
        needed = pp * (tp // share)
        picks: list[list[str]] = []
        for g in node_index.best_fit(share):
            group = node_index.groups[g]
            if not accept(group):
                continue
            room = [r for r in group.gpus if r in index.free and allowed(r)]
            picked = pick_in_group(index, room, share) if len(room) >= share else None
            if picked is None:
                continue
            picks.append(list(picked))
            if len(picks) == needed:
                break
        if len(picks) < needed:
            continue
        # ranks in cluster order: each stage's nodes together, each node's GPUs one block
        picks.sort(key=lambda refs: index.info[refs[0]].order)
        per_stage = tp // share
        stages = [[r for refs in picks[s * per_stage : (s + 1) * per_stage] for r in refs] for s in range(pp)]
        if _layout_problem(index, stages, tp) is None:
            return stages
    return None


def fragmentation(index: ClusterIndex, stages: Sequence[Sequence[str]]) -> tuple[int, int]:
    """(whole NVLink groups the stages would break, free GPUs in the NVLink groups they use)."""
    level = index.levels["nvlink"]
    refs = [r for stage in stages for r in stage]
    touched = {g for r in refs for g in level.of_gpu.get(r, ())}
    broken = sum(1 for g in touched if level.size[g] > 1 and level.free_count[g] == level.size[g])
    return broken, sum(level.free_count[g] for g in touched)


def breaks_reserve(index: ClusterIndex, stages: Sequence[Sequence[str]], keep: int, size: int | None = None) -> bool:
    """Whether the stages leave a wholly free NVLink domain of the cluster's largest size partly used
    while fewer than ``keep`` others would stay wholly free (a group that fills a domain breaks none).

    ``size`` (``Scheduler.headroom_size``): count places for ``size`` GPUs instead, ``free //
    size`` in each domain of at least that size; the stages break the reserve when they take one of them
    and fewer than ``keep`` would be left."""
    level = index.levels["nvlink"]
    used: dict[int, int] = {}
    for stage in stages:
        for ref in stage:
            for g in level.of_gpu.get(ref, ()):
                used[g] = used.get(g, 0) + 1
    if size is not None:
        free = level.free_count
        lost = sum(free[g] // size - (free[g] - n) // size for g, n in used.items() if level.size[g] >= size)
        if not lost:
            return False
        # a group with c >= size free GPUs is at least that large: the places, from the free-count buckets
        top = level.max_size + 1
        slots = sum((c // size) * (len(level.buckets[c]) + len(level.whole[c])) for c in range(size, top))
        return slots - lost < keep
    whole = [g for g in used if level.size[g] == level.max_size and level.free_count[g] == level.size[g]]
    broken = sum(1 for g in whole if used[g] < level.size[g])
    return broken > 0 and len(level.whole[level.max_size]) - len(whole) < keep


def fit_cost(index: ClusterIndex, stages: Sequence[Sequence[str]]) -> tuple[int, int]:
    """Lower is better: best fit, then the tie-break of ``LevelIndex.best_fit`` (both the other way
    round under ``keep_whole``), for choosing between equally good degree options (the same TP and
    PP on two GPU types)."""
    broken, free = fragmentation(index, stages)
    return (broken, free) if index.levels["nvlink"].keep_whole else (free, broken)


def _layout_problem(index: ClusterIndex, stages: list[list[str]], tp: int) -> str | None:
    refs = [r for stage in stages for r in stage]
    info = index.info
    if len({info[r].node for r in refs}) <= 1:
        return None  # one node holds one block of ranks: always launchable (what layout_problem answers)
    return layout_problem([_R(n, info[r].node, info[r].index) for n, r in enumerate(refs)], tp)


@dataclass(frozen=True)
class _R:
    rank: int
    node: str
    gpu: int


__all__ = ["GroupFilter", "breaks_reserve", "find_stages", "find_stages_across", "fit_cost", "fragmentation"]
