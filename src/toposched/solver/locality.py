"""Choosing GPUs by locality: one key for the scheduler (``pick_in_group``, ``solver/picking.py``) and
``toposched allocate``.

On one node, the ``size`` GPUs taken from the ``available`` ones are the set with the smallest key
(``set_key``), compared lexicographically:

a. inside one all-pairs NVLink clique (an NVSwitch domain is one clique; on a DGX-1 hybrid cube
   mesh the quads ``0-3`` and ``4-7`` are);
b. the most NVLink lanes summed over its pairs, then the best PCIe paths summed over its other
   pairs (``PIX`` 5 > ``PXB`` 4 > ``PHB`` 3 > ``NODE`` 2 > ``SYS`` 1, unknown 0), so a set under
   fewer PCIe switches and NUMA nodes scores higher;
c. what it leaves available: the most disjoint sets of the same size still possible inside one
   NVLink clique, then one PCIe switch, then one NUMA group (greedy packing estimates); then the
   most NVLink domains / NUMA groups / PCIe groups left untouched; then the largest all-pairs
   NVLink set left (best fit);
d. the fewest NUMA groups, then the fewest PCIe switches;
e. the lowest indices (so the answer is deterministic).

Because (c) comes before (d), an NVSwitch node (where (a) and (b) tie) may split a set over two
NUMA groups when that keeps more NUMA-local sets free; on a PCIe box (b) already prefers the fewest
NUMA nodes and PCIe switches.

Search (``choose_on_node``): every combination is scored when there are at most
``EXHAUSTIVE_LIMIT`` of them, which covers every node or group with up to 16 candidate GPUs
(C(16, 8) = 12,870): the answer is then the minimum of the key. Sets that differ only by swapping
interchangeable GPUs (``NodeTopology.gpu_types``) have equal keys but for the indices, so only the
lowest-indexed one of each is scored (on an NVSwitch node, one set per mix of NUMA groups). Above
the limit (mid-sized requests on nodes with 19 or more free GPUs) a greedy growth from every seed
GPU proposes one set per seed, the key picks among them, and single swaps (one GPU out, one in)
improve the winner while the key improves: a sound set, not a proven minimum. The result says
which search was used.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Literal

from toposched.topology.domains import build_domain_map
from toposched.topology.model import Cluster, LinkKind, Node

EXHAUSTIVE_LIMIT = 50_000
"""Score every combination up to this many; above it, grow greedily from each seed GPU."""

MAX_SWAP_PASSES = 32
"""Greedy mode: at most this many improving swaps after the growth."""

Method = Literal["exhaustive", "greedy", "none"]

# Quality of a non-NVLink pair: better PCIe paths score higher; a pair the source did not give is 0.
_PCIE_QUALITY = {LinkKind.PIX: 5, LinkKind.PXB: 4, LinkKind.PHB: 3, LinkKind.NODE: 2, LinkKind.SYS: 1}


@dataclasses.dataclass(frozen=True)
class AllocationScore:
    """Why a set was preferred; fields in the order they are compared."""

    in_nvlink_clique: bool
    """Every pair of the set talks over NVLink (trivially true for one GPU)."""
    nvlink_lanes: int
    """NVLink lanes summed over the set's pairs."""
    pcie_quality: int
    """Sum over the set's non-NVLink pairs of PIX 5, PXB 4, PHB 3, NODE 2, SYS 1 (unknown 0)."""
    worst_link: str
    """The worst link inside the set ("NV12", "NODE", "SYS", "-" for one GPU)."""
    free_sets: tuple[int, int, int]
    """Disjoint sets of the same size still possible afterwards: in one NVLink clique, one PCIe
    switch, one NUMA group (greedy packing estimates)."""
    untouched_groups: tuple[int, int, int]
    """NVLink domains, NUMA groups, PCIe groups with available GPUs that the set leaves alone."""
    largest_free_clique: int
    """Size of the largest all-pairs NVLink set left among the remaining available GPUs."""
    numa_span: int
    """NUMA groups the set touches (GPUs without NUMA information not counted)."""
    pcie_span: int
    """PCIe-switch groups the set touches."""


@dataclasses.dataclass(frozen=True)
class NodeChoice:
    """The best set on one node, its score, and how it was found."""

    gpus: tuple[int, ...]
    score: AllocationScore
    method: Method
    candidates: int
    """How many candidate sets were scored."""


class NodeTopology:
    """Per-node lookup tables for scoring: pair quality, cliques, groups (by GPU index).

    Groups are also kept as bit masks (bit ``pos[i]`` for GPU index ``i``, positions in index
    order), so scoring a set is a few integer operations per group.
    """

    def __init__(self, node: Node) -> None:
        self.nv: dict[tuple[int, int], int] = {}
        self.kind: dict[tuple[int, int], LinkKind] = {}
        for link in node.links:
            self.kind[(link.a, link.b)] = link.kind
            if link.kind is LinkKind.NVLINK:
                self.nv[(link.a, link.b)] = link.nvlinks
        indices = sorted(g.index for g in node.gpus)
        self.pos = {i: p for p, i in enumerate(indices)}
        self.pairs: dict[tuple[int, int], tuple[bool, int, int]] = {}
        for key in itertools.combinations(indices, 2):
            lanes = self.nv.get(key, 0)
            kind = self.kind.get(key)
            quality = _PCIE_QUALITY.get(kind, 0) if kind is not None and not lanes else 0
            self.pairs[key] = (bool(lanes), lanes, quality)
        dmap = build_domain_map(Cluster(name=node.name, nodes=(node,)))

        def idx(refs: Iterable[str]) -> frozenset[int]:
            return frozenset(int(r.rsplit("/", 1)[1]) for r in refs)

        self.domains = [idx(d.gpus) for d in dmap.domains]
        self.cliques = [idx(c) for d in dmap.domains for c in d.cliques]  # largest first per domain
        self.cliques.sort(key=lambda c: (-len(c), sorted(c)))
        self.numa = [idx(g.gpus) for g in dmap.numa_groups]
        self.pcie = [idx(g.gpus) for g in dmap.pcie_groups]
        self.numa_of = {i: n for n, grp in enumerate(self.numa) for i in grp}
        self.pcie_of = {i: n for n, grp in enumerate(self.pcie) for i in grp}
        self.domain_masks = [self.mask(g) for g in self.domains]
        self.clique_masks = [self.mask(g) for g in self.cliques]
        self.numa_masks = [self.mask(g) for g in self.numa]
        self.pcie_masks = [self.mask(g) for g in self.pcie]
        self.choices: dict[tuple[tuple[int, ...], int], NodeChoice] = {}
        """``pick_in_group``'s answers by (free GPUs, size): ``choose_on_node`` is a pure function of them."""
        self.disjoint = (_disjoint(self.clique_masks), _disjoint(self.pcie_masks), _disjoint(self.numa_masks))
        self._types: dict[int, int] | None = None

    def mask(self, gpus: Iterable[int]) -> int:
        """The bit mask of a set of GPU indices."""
        bits = 0
        for i in gpus:
            bits |= 1 << self.pos[i]
        return bits

    def gpu_types(self) -> dict[int, int]:
        """GPU index -> type. GPUs of one type have the same pair to every other GPU and sit in the
        same groups, so swapping them leaves ``set_key`` unchanged except for the indices: an exact
        search needs only the lowest-indexed GPUs of each type. When a family of groups overlaps
        (DGX-1 mesh cliques) the packing estimate is not symmetric, and every GPU is its own type.
        """
        if self._types is None:
            indices = sorted(self.pos)
            if not all(self.disjoint):
                self._types = {i: n for n, i in enumerate(indices)}
                return self._types
            families = (self.domain_masks, self.clique_masks, self.numa_masks, self.pcie_masks)
            reps: list[tuple[int, tuple[tuple[int, ...], ...]]] = []
            types: dict[int, int] = {}
            for i in indices:
                bit = 1 << self.pos[i]
                member = tuple(tuple(k for k, m in enumerate(fam) if m & bit) for fam in families)
                for t, (rep, rep_member) in enumerate(reps):
                    if rep_member == member and all(
                        self.pair(i, x) == self.pair(rep, x) for x in indices if x not in (i, rep)
                    ):
                        types[i] = t
                        break
                else:
                    types[i] = len(reps)
                    reps.append((i, member))
            self._types = types
        return self._types

    def pair(self, a: int, b: int) -> tuple[bool, int, int]:
        """(NVLink?, lanes, PCIe quality) of one pair."""
        return self.pairs.get((a, b) if a < b else (b, a), (False, 0, 0))

    def link_key(self, gpus: Sequence[int]) -> tuple[bool, int, int]:
        """(a) and (b): all pairs NVLink, lane sum, PCIe quality sum (``gpus`` in ascending order)."""
        pairs = self.pairs
        clique, lanes, quality = True, 0, 0
        for key in itertools.combinations(gpus, 2):
            is_nv, n, q = pairs.get(key, (False, 0, 0))
            clique = clique and is_nv
            lanes += n
            quality += q
        return clique, lanes, quality

    def worst_link(self, gpus: Sequence[int]) -> str:
        worst: tuple[int, int, str] | None = None
        for a, b in itertools.combinations(gpus, 2):
            key = (a, b) if a < b else (b, a)
            kind = self.kind.get(key)
            if kind is None:
                label, rank, lanes = "unknown", 99, 0
            else:
                lanes = self.nv.get(key, 0)
                label, rank = (f"NV{lanes}" if lanes else kind.value), kind.rank
            if worst is None or (rank, -lanes) > (worst[0], -worst[1]):
                worst = (rank, lanes, label)
        return worst[2] if worst else "-"


def _packing(groups: Sequence[int], remaining: int, size: int, *, disjoint: bool) -> int:
    """Greedy count of disjoint ``size``-sets, each inside one group (a bit mask), among ``remaining``.

    Each group in turn gives its lowest free GPUs to as many sets as they fill; when the groups do
    not overlap (NUMA groups, PCIe switches, one NVSwitch clique) that is just a count per group.
    """
    if disjoint:
        return sum((g & remaining).bit_count() // size for g in groups)
    used = 0
    count = 0
    for group in groups:
        free = group & remaining & ~used
        n = free.bit_count() // size
        count += n
        for _ in range(n * size):
            low = free & -free
            used |= low
            free ^= low
    return count


def _disjoint(masks: Sequence[int]) -> bool:
    seen = 0
    for m in masks:
        if seen & m:
            return False
        seen |= m
    return True


def score_set(
    topo: NodeTopology,
    gpus: tuple[int, ...],
    available: frozenset[int],
    *,
    link: tuple[bool, int, int] | None = None,
    available_mask: int | None = None,
) -> AllocationScore:
    """The full score; ``link`` is the set's ``link_key`` and ``available_mask`` the mask of
    ``available`` when the caller already has them.

    ``worst_link`` is left empty (it is only for people; the caller fills it for the winner).
    """
    avail = topo.mask(available) if available_mask is None else available_mask
    chosen = topo.mask(gpus)
    remaining = avail & ~chosen
    size = len(gpus)
    clique, lanes, quality = topo.link_key(gpus) if link is None else link

    def untouched(groups: Sequence[int]) -> int:
        return sum(1 for g in groups if g & avail and not g & chosen)

    def touched(groups: Sequence[int]) -> int:
        return sum(1 for g in groups if g & chosen)

    return AllocationScore(
        in_nvlink_clique=clique,
        nvlink_lanes=lanes,
        pcie_quality=quality,
        worst_link="",
        free_sets=(
            _packing(topo.clique_masks, remaining, size, disjoint=topo.disjoint[0]),
            _packing(topo.pcie_masks, remaining, size, disjoint=topo.disjoint[1]),
            _packing(topo.numa_masks, remaining, size, disjoint=topo.disjoint[2]),
        ),
        untouched_groups=(untouched(topo.domain_masks), untouched(topo.numa_masks), untouched(topo.pcie_masks)),
        largest_free_clique=max(((c & remaining).bit_count() for c in topo.clique_masks), default=0),
        numa_span=touched(topo.numa_masks),
        pcie_span=touched(topo.pcie_masks),
    )


def set_key(score: AllocationScore, gpus: tuple[int, ...]) -> tuple[object, ...]:
    """Smaller is better: the lexicographic order (a)-(e) of the module docstring."""
    return (
        not score.in_nvlink_clique,
        -score.nvlink_lanes,
        -score.pcie_quality,
        tuple(-n for n in score.free_sets),
        tuple(-n for n in score.untouched_groups),
        -score.largest_free_clique,
        score.numa_span,
        score.pcie_span,
        gpus,
    )


def choose_on_node(
    topo: NodeTopology,
    available: Iterable[int],
    must_include: Sequence[int],
    size: int,
    *,
    exhaustive_limit: int = EXHAUSTIVE_LIMIT,
) -> NodeChoice:
    """The ``size`` GPUs of ``available`` (always with ``must_include``) with the smallest ``set_key``.

    The caller checks the request: ``1 <= size <= len(available)``, ``must_include`` inside
    ``available`` and no longer than ``size``.
    """
    avail = frozenset(available)
    must = tuple(sorted(must_include))
    pool = sorted(avail - set(must))
    need = size - len(must)
    if math.comb(len(pool), need) <= exhaustive_limit:
        # Every combination, less those that differ only by swapping interchangeable GPUs.
        method: Method = "exhaustive"
        types = topo.gpu_types()
        by_type: dict[int, list[int]] = {}
        for i in pool:
            by_type.setdefault(types[i], []).append(i)
        candidates = [tuple(sorted(must + extra)) for extra in _distinct_sets(list(by_type.values()), need)]
    else:
        method = "greedy"
        # One start per seed GPU; with must-include GPUs, also grow from those alone.
        starts = [must] if must else []
        starts += [(*must, seed) for seed in pool] if need else []
        candidates = sorted({_grow(topo, start, sorted(avail), size) for start in starts})
    # (a) and (b) are cheap; only the sets tied on them get the full score.
    link_keys = {c: topo.link_key(c) for c in candidates}
    best_link = max(link_keys.values())
    finalists = [c for c in candidates if link_keys[c] == best_link]
    avail_mask = topo.mask(avail)
    scored = [(score_set(topo, c, avail, link=best_link, available_mask=avail_mask), c) for c in finalists]
    score, gpus = min(scored, key=lambda sc: set_key(sc[0], sc[1]))
    evaluated = len(candidates)
    if method == "greedy":
        score, gpus, swaps = _improve(topo, score, gpus, avail, frozenset(must))
        evaluated += swaps
    score = dataclasses.replace(score, worst_link=topo.worst_link(gpus))
    return NodeChoice(gpus=gpus, score=score, method=method, candidates=evaluated)


def _distinct_sets(members: Sequence[Sequence[int]], need: int) -> list[tuple[int, ...]]:
    """One set per way of taking ``need`` GPUs by type counts: the lowest indices of each type."""
    room = [0] * (len(members) + 1)
    for k in range(len(members) - 1, -1, -1):
        room[k] = room[k + 1] + len(members[k])
    found: list[tuple[int, ...]] = []

    def take(k: int, left: int, acc: tuple[int, ...]) -> None:
        if k == len(members):
            found.append(acc)
            return
        for c in range(max(0, left - room[k + 1]), min(left, len(members[k])) + 1):
            take(k + 1, left - c, acc + tuple(members[k][:c]))

    take(0, need, ())
    return found


def _grow(topo: NodeTopology, start: tuple[int, ...], pool: Sequence[int], size: int) -> tuple[int, ...]:
    """Add GPUs one at a time, each the one that keeps the set best by (a), (b), (d), index."""
    chosen = list(start)
    clique = topo.link_key(sorted(chosen))[0]
    all_nv = {c: True for c in pool}
    lanes = dict.fromkeys(pool, 0)
    quality = dict.fromkeys(pool, 0)
    numas = {topo.numa_of[i] for i in chosen if i in topo.numa_of}

    def account(g: int) -> None:
        for c in pool:
            is_nv, n, q = topo.pair(g, c) if c != g else (True, 0, 0)
            all_nv[c] = all_nv[c] and is_nv
            lanes[c] += n
            quality[c] += q

    for g in chosen:
        account(g)
    left = [c for c in pool if c not in chosen]
    while len(chosen) < size:
        best = min(
            left,
            key=lambda c: (
                not (clique and all_nv[c]),
                -lanes[c],
                -quality[c],
                c in topo.numa_of and topo.numa_of[c] not in numas,
                c,
            ),
        )
        clique = clique and all_nv[best]
        chosen.append(best)
        left.remove(best)
        if best in topo.numa_of:
            numas.add(topo.numa_of[best])
        account(best)
    return tuple(sorted(chosen))


def _improve(
    topo: NodeTopology,
    score: AllocationScore,
    gpus: tuple[int, ...],
    available: frozenset[int],
    fixed: frozenset[int],
) -> tuple[AllocationScore, tuple[int, ...], int]:
    """Hill-climb by swapping one GPU in for one out while the full key improves.

    Greedy growth sees locality but not what it leaves behind (e.g. taking one GPU from each of two
    NUMA groups with odd free counts keeps more NUMA-local pairs free); swaps repair that. A swap's
    link key is updated in O(size); only swaps that do not worsen it get the full score.
    """
    best_key = set_key(score, gpus)
    avail_mask = topo.mask(available)
    link = (score.in_nvlink_clique, score.nvlink_lanes, score.pcie_quality)
    tried = 0
    for _ in range(MAX_SWAP_PASSES):
        improved = False
        for out in [g for g in gpus if g not in fixed]:
            others = [g for g in gpus if g != out]
            lost = [topo.pair(out, g) for g in others]
            for into in sorted(available - set(gpus)):
                gained = [topo.pair(into, g) for g in others]
                lanes = link[1] - sum(p[1] for p in lost) + sum(p[1] for p in gained)
                quality = link[2] - sum(p[2] for p in lost) + sum(p[2] for p in gained)
                clique = all(p[0] for p in gained) and (
                    link[0] or all(topo.pair(a, b)[0] for a, b in itertools.combinations(others, 2))
                )
                if (clique, lanes, quality) < link:
                    continue
                trial = tuple(sorted([*others, into]))
                tried += 1
                trial_score = score_set(
                    topo, trial, available, link=(clique, lanes, quality), available_mask=avail_mask
                )
                trial_key = set_key(trial_score, trial)
                if trial_key < best_key:
                    score, gpus, best_key, link, improved = (
                        trial_score,
                        trial,
                        trial_key,
                        (clique, lanes, quality),
                        True,
                    )
                    break
            if improved:
                break
        if not improved:
            break
    return score, gpus, tried


__all__ = [
    "EXHAUSTIVE_LIMIT",
    "AllocationScore",
    "NodeChoice",
    "NodeTopology",
    "choose_on_node",
    "score_set",
    "set_key",
]
