"""Kubernetes device-plugin ``GetPreferredAllocation``, answered from one node's topology.

The kubelet asks a device plugin: "of these *available* devices, which *size* should I give the
container, given that it *must include* these?" (``ContainerPreferredAllocationRequest``). The
answer here is the set that, compared lexicographically:

a. sits inside one all-pairs NVLink clique (an NVSwitch domain is one clique; on a DGX-1 hybrid
   cube mesh the quads ``0-3`` and ``4-7`` are);
b. has the most NVLink lanes summed over its pairs, then the best PCIe paths summed over its
   other pairs (``PIX`` 5 > ``PXB`` 4 > ``PHB`` 3 > ``NODE`` 2 > ``SYS`` 1, unknown 0);
c. does not fragment what is left: the most disjoint sets of the same size that stay possible
   among the remaining available GPUs inside one NVLink clique, then inside one PCIe switch, then
   inside one NUMA group (greedy packing estimates); then the most NVLink domains / NUMA groups /
   PCIe groups left untouched; then the largest all-pairs NVLink set left (best fit);
d. spans the fewest NUMA groups, then the fewest PCIe switches;
e. has the lowest indices (so the answer is deterministic).

Every combination is scored when there are at most ``EXHAUSTIVE_LIMIT`` of them; otherwise (nodes
with 16-72 GPUs) a greedy growth from every seed GPU proposes one candidate per seed and the same
key picks among those, then single swaps (one GPU out, one in) improve the winner while the key
improves. The result says which was used. Impossible requests are a value with a
``reason``, not an exception; indices that the node does not have are bad input (``InputError``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Literal

from toposched.errors import InputError
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
class AllocationResult:
    """The preferred GPUs, or an empty tuple and the reason the request cannot be met."""

    gpus: tuple[int, ...]
    method: Method
    candidates: int
    """How many candidate sets were scored."""
    score: AllocationScore | None = None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    def why(self) -> list[str]:
        """A short explanation for people, one clause per scoring level that mattered."""
        if self.score is None:
            return [self.reason or "no allocation"]
        s = self.score
        size = len(self.gpus)
        lines: list[str] = []
        if size > 1:
            if s.in_nvlink_clique:
                lines.append(f"every pair on NVLink ({s.nvlink_lanes} lanes over the pairs, weakest {s.worst_link})")
            else:
                lines.append(f"no all-NVLink set of {size} available; weakest link inside the set is {s.worst_link}")
        clique, pcie, numa = s.free_sets
        lines.append(
            f"leaves {clique} more all-NVLink set(s) of {size}"
            + (f", {numa} NUMA-local set(s)" if numa else "")
            + (f", {pcie} same-PCIe-switch set(s)" if pcie else "")
            + (f"; largest NVLink set left: {s.largest_free_clique}" if s.largest_free_clique else "")
        )
        if s.numa_span:
            lines.append(f"spans {s.numa_span} NUMA group(s)")
        lines.append(f"chosen by {self.method} search over {self.candidates} candidate set(s)")
        return lines


def check_indices(node: Node, values: Sequence[int], label: str) -> None:
    """Raise ``InputError`` naming ``label`` when ``values`` repeat or name GPUs the node lacks."""
    known = {g.index for g in node.gpus}
    unknown = sorted({v for v in values if v not in known})
    if unknown:
        raise InputError(
            f"{label} names GPU {', '.join(map(str, unknown))}, which node {node.name} does not have",
            fix=f"use indices from {_ranges(sorted(known))}",
        )
    repeated = sorted({v for v in values if list(values).count(v) > 1})
    if repeated:
        raise InputError(f"{label} lists GPU {', '.join(map(str, repeated))} more than once")


def _ranges(values: list[int]) -> str:
    if not values:
        return "(none)"
    if values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def _refusal(available: Sequence[int], must: Sequence[int], size: int) -> str | None:
    if size < 1:
        return f"size must be at least 1 (got {size})"
    missing = sorted(set(must) - set(available))
    if missing:
        return f"must-include GPU {', '.join(map(str, missing))} not in the available set"
    if len(must) > size:
        return f"must-include lists {len(must)} GPUs, more than the size {size}"
    if size > len(available):
        return f"size {size} is larger than the {len(available)} available GPU(s)"
    return None


class _Topology:
    """Per-node lookup tables for scoring: pair quality, cliques, groups (by GPU index)."""

    def __init__(self, node: Node) -> None:
        self.nv: dict[tuple[int, int], int] = {}
        self.kind: dict[tuple[int, int], LinkKind] = {}
        for link in node.links:
            self.kind[(link.a, link.b)] = link.kind
            if link.kind is LinkKind.NVLINK:
                self.nv[(link.a, link.b)] = link.nvlinks
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

    def pair(self, a: int, b: int) -> tuple[bool, int, int]:
        """(NVLink?, lanes, PCIe quality) of one pair."""
        key = (a, b) if a < b else (b, a)
        lanes = self.nv.get(key, 0)
        if lanes:
            return True, lanes, 0
        kind = self.kind.get(key)
        return False, 0, _PCIE_QUALITY.get(kind, 0) if kind is not None else 0

    def link_key(self, gpus: Sequence[int]) -> tuple[bool, int, int]:
        """(a) and (b): all pairs NVLink, lane sum, PCIe quality sum."""
        clique, lanes, quality = True, 0, 0
        for a, b in itertools.combinations(gpus, 2):
            is_nv, n, q = self.pair(a, b)
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


def _packing(groups: Sequence[frozenset[int]], remaining: frozenset[int], size: int) -> int:
    """Greedy count of disjoint ``size``-sets, each inside one group, among ``remaining``."""
    used: set[int] = set()
    count = 0
    for group in groups:
        free = sorted(group & remaining - used)
        n = len(free) // size
        used.update(free[: n * size])
        count += n
    return count


def _score(
    topo: _Topology,
    gpus: tuple[int, ...],
    available: frozenset[int],
    *,
    link: tuple[bool, int, int] | None = None,
) -> AllocationScore:
    """The full score; ``link`` is the set's ``link_key`` when the caller already has it.

    ``worst_link`` is left empty (it is only for people; the caller fills it for the winner).
    """
    chosen = frozenset(gpus)
    remaining = available - chosen
    size = len(gpus)
    clique, lanes, quality = topo.link_key(gpus) if link is None else link

    def untouched(groups: Sequence[frozenset[int]]) -> int:
        return sum(1 for g in groups if g & available and not g & chosen)

    return AllocationScore(
        in_nvlink_clique=clique,
        nvlink_lanes=lanes,
        pcie_quality=quality,
        worst_link="",
        free_sets=(
            _packing(topo.cliques, remaining, size),
            _packing(topo.pcie, remaining, size),
            _packing(topo.numa, remaining, size),
        ),
        untouched_groups=(untouched(topo.domains), untouched(topo.numa), untouched(topo.pcie)),
        largest_free_clique=max((len(c & remaining) for c in topo.cliques), default=0),
        numa_span=len({topo.numa_of[i] for i in gpus if i in topo.numa_of}),
        pcie_span=len({topo.pcie_of[i] for i in gpus if i in topo.pcie_of}),
    )


def _full_key(score: AllocationScore, gpus: tuple[int, ...]) -> tuple[object, ...]:
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


def _grow(topo: _Topology, start: tuple[int, ...], pool: Sequence[int], size: int) -> tuple[int, ...]:
    """Add GPUs one at a time, each the one that keeps the set best by (a), (b), (d), index."""
    chosen = list(start)
    clique = topo.link_key(chosen)[0]
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


def preferred_allocation(
    node: Node,
    available: Sequence[int],
    must_include: Sequence[int],
    size: int,
    *,
    exhaustive_limit: int = EXHAUSTIVE_LIMIT,
) -> AllocationResult:
    """The ``size`` GPUs of ``node`` to give, from ``available``, always including ``must_include``.

    Raises ``InputError`` when an index is not on the node or repeats; an impossible request
    (must-include not available, more must-include than ``size``, ``size`` above what is
    available, ``size`` < 1) comes back as a result with ``gpus == ()`` and a ``reason``.
    """
    check_indices(node, available, "available")
    check_indices(node, must_include, "must-include")
    reason = _refusal(available, must_include, size)
    if reason is not None:
        return AllocationResult(gpus=(), method="none", candidates=0, reason=reason)
    topo = _Topology(node)
    avail = frozenset(available)
    must = tuple(sorted(must_include))
    pool = sorted(avail - set(must))
    need = size - len(must)
    if math.comb(len(pool), need) <= exhaustive_limit:
        method: Method = "exhaustive"
        candidates = [tuple(sorted(must + extra)) for extra in itertools.combinations(pool, need)]
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
    scored = [(_score(topo, c, avail, link=best_link), c) for c in finalists]
    score, gpus = min(scored, key=lambda sc: _full_key(sc[0], sc[1]))
    evaluated = len(candidates)
    if method == "greedy":
        score, gpus, swaps = _improve(topo, score, gpus, avail, frozenset(must))
        evaluated += swaps
    score = dataclasses.replace(score, worst_link=topo.worst_link(gpus))
    return AllocationResult(gpus=gpus, method=method, candidates=evaluated, score=score)


def _improve(
    topo: _Topology,
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
    best_key = _full_key(score, gpus)
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
                trial_score = _score(topo, trial, available, link=(clique, lanes, quality))
                trial_key = _full_key(trial_score, trial)
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
