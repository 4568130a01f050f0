"""Indexes over the cluster's GPU groups, so a decision never scans the whole cluster.

For each affinity level there is a set of groups a TP group must fit inside:

    nvlink       the all-pairs NVLink cliques of each NVLink domain (a whole NVSwitch island or
                 multi-node NVLink rack; the quads and cross pairs of a DGX-1 mesh)
    pcie-switch  GPUs under one PCIe switch
    numa         GPUs of one NUMA node
    node         one machine
    none         the whole cluster

GPUs that no group of a level covers get a group of their own (so a TP=1 instance can go anywhere).
Each group's count of free GPUs is kept in buckets (free count -> groups), so "the tightest group
with at least k free GPUs" (best fit) is a walk over at most max-group-size buckets. A GPU is free
when it is healthy and holds no reservation: this version places at most one instance per GPU, as
engines that claim a fixed fraction of HBM do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from toposched.solver.request import Affinity
from toposched.topology.domains import DomainMap, NVLinkDomain, build_domain_map, gpu_ref
from toposched.topology.model import GPU, Cluster, Health, Node

LEVELS: tuple[str, ...] = ("nvlink", "pcie-switch", "numa", "node", "none")


@dataclass(frozen=True)
class Group:
    id: str
    level: str
    gpus: tuple[str, ...]
    nodes: frozenset[str]
    domain: str | None  # the NVLink domain id, for nvlink-level groups


@dataclass(frozen=True)
class GpuInfo:
    ref: str
    node: str
    index: int
    numa: int | None
    pcie: str | None
    order: int  # position in cluster order (node order, then index)


class FreeCounts:
    """A Fenwick tree over groups' free-GPU counts (group order): the group that holds the k-th free GPU in
    O(log groups), so the blind policies pick GPUs without a scan of every node (issue 17)."""

    def __init__(self, counts: list[int]) -> None:
        n = len(counts)
        tree = [0, *counts]
        for i in range(1, n + 1):
            parent = i + (i & -i)
            if parent <= n:
                tree[parent] += tree[i]
        self.tree = tree
        self.total = sum(counts)
        self.top = 1 << max(n.bit_length() - 1, 0) if n else 0

    def add(self, group: int, delta: int) -> None:
        self.total += delta
        tree, i, n = self.tree, group + 1, len(self.tree) - 1
        while i <= n:
            tree[i] += delta
            i += i & -i

    def find(self, k: int) -> int:
        """The group holding the ``k``-th free GPU (1-based, in group order); ``1 <= k <= total``."""
        tree, pos, step, n = self.tree, 0, self.top, len(self.tree) - 1
        while step:
            nxt = pos + step
            if nxt <= n and tree[nxt] < k:
                pos = nxt
                k -= tree[nxt]
            step >>= 1
        return pos  # 0-based: the group after the prefix ``pos``


class LevelIndex:
    """Groups of one affinity level with free-GPU counts in buckets."""

    def __init__(self, level: str, groups: list[Group], free: set[str]) -> None:
        self.level = level
        self.groups = groups
        self.of_gpu: dict[str, list[int]] = {}
        for i, g in enumerate(groups):
            for ref in g.gpus:
                self.of_gpu.setdefault(ref, []).append(i)
        self.free_count = [len(free.intersection(g.gpus)) for g in groups]  # (refs are distinct in a group)
        self.size = [len(g.gpus) for g in groups]
        self.max_size = max(self.size, default=0)
        self.keep_whole = False
        """Prefer partly used groups over wholly free ones before best fit (see ``best_fit``)."""
        self.spans_nodes = any(len(g.nodes) > 1 for g in groups)
        """Some group holds GPUs of several nodes (a multi-node NVLink domain, or level none)."""
        # free count -> groups; partly used and wholly free groups apart, so best fit can prefer the
        # partly used ones (keep whole groups whole for the large instances that need them)
        self.buckets: list[dict[int, None]] = [{} for _ in range(self.max_size + 1)]
        self.whole: list[dict[int, None]] = [{} for _ in range(self.max_size + 1)]
        for i in range(len(groups)):
            self._bucket(i)[i] = None
        self.counts: FreeCounts | None = FreeCounts(self.free_count) if level == "node" else None
        """The node level's free counts in cluster order, for ``index-order`` and ``random``."""

    def _bucket(self, group: int) -> dict[int, None]:
        count = self.free_count[group]
        return (self.whole if count == self.size[group] else self.buckets)[count]

    def _move(self, group: int, delta: int) -> None:
        # ``_bucket`` inlined: this runs once per level and group on every take and give
        count, size = self.free_count[group], self.size[group]
        del (self.whole if count == size else self.buckets)[count][group]
        count += delta
        self.free_count[group] = count
        (self.whole if count == size else self.buckets)[count][group] = None
        if self.counts is not None:
            self.counts.add(group, delta)

    def take(self, ref: str) -> None:
        for g in self.of_gpu.get(ref, ()):
            self._move(g, -1)

    def give(self, ref: str) -> None:
        for g in self.of_gpu.get(ref, ()):
            self._move(g, +1)

    def shift(self, refs: Sequence[str], delta: int) -> None:
        """Take (``delta`` -1) or give (+1) each of ``refs``: one bucket move per group touched, not per
        GPU (a TP8 placement moves its node's group once per level instead of eight times). GPUs that all
        sit in one and the same group, and nowhere else at this level (a one-GPU instance, the most common;
        a TP group inside one node or NVSwitch domain), move that group without counting first."""
        if not refs:
            return
        of_gpu = self.of_gpu
        groups = of_gpu.get(refs[0], ())
        if len(groups) == 1:
            for ref in refs:  # all in that one group (a TP group inside a node or an NVSwitch domain)?
                if of_gpu.get(ref) != groups:
                    break
            else:
                self._move(groups[0], delta * len(refs))
                return
        counts: dict[int, int] = {}
        for ref in refs:
            for g in of_gpu.get(ref, ()):
                counts[g] = counts.get(g, 0) + 1
        for g, n in counts.items():
            self._move(g, delta * n)

    def best_fit(self, size: int) -> Iterator[int]:
        """Groups with at least ``size`` free GPUs, tightest first; at equal room, partly used first.

        Best fit keeps large free blocks whole; the tie-break makes a small instance take room in a
        partly used group before it breaks a wholly free one of the same room. With ``keep_whole``
        every partly used group comes before every wholly free one (``Scheduler.place_batch`` tries
        both orders on a batch and keeps the better outcome).

        The buckets are iterated in place (a copy of each was O(groups) per decision, the part of a
        decision that grew with the cluster, issue 17): callers take or give no GPU while iterating.
        """
        if self.keep_whole:
            for count in range(max(size, 1), self.max_size + 1):
                yield from self.buckets[count]
            for count in range(max(size, 1), self.max_size + 1):
                yield from self.whole[count]
            return
        for count in range(max(size, 1), self.max_size + 1):
            yield from self.buckets[count]
            yield from self.whole[count]

    def largest_group(self) -> int:
        return self.max_size

    def with_free(self) -> list[int]:
        """Ids of the groups with at least one free GPU, in cluster order (from the buckets: no scan
        of the groups without room, which on a busy cluster are most of them)."""
        return sorted(g for count in range(1, self.max_size + 1) for g in (*self.buckets[count], *self.whole[count]))


class ClusterIndex:
    """Free GPUs and groups of every level for one cluster snapshot."""

    def __init__(self, cluster: Cluster, domain_map: DomainMap | None = None, *, busy: Iterable[str] = ()) -> None:
        self.cluster = cluster
        self.dmap = domain_map or build_domain_map(cluster)
        self.spread = False
        """A group over several nodes takes the most nodes its launch rule allows, not the fewest
        (``picking.pick_in_group``; ``spreading``)."""
        self.domains: dict[str, NVLinkDomain] = {d.id: d for d in self.dmap.domains}
        """NVLink domains by id (``tp_link`` looks one up per decision; a scan of every domain was
        60 % of decision time at 65,536 GPUs, issue 17)."""
        self.nodes: dict[str, Node] = {n.name: n for n in cluster.nodes}
        self.info: dict[str, GpuInfo] = {}
        pcie_of = {ref: g.id for g in self.dmap.pcie_groups for ref in g.gpus}
        order = 0
        for node in cluster.nodes:
            for gpu in node.gpus:
                ref = gpu_ref(node.name, gpu.index)
                self.info[ref] = GpuInfo(ref, node.name, gpu.index, gpu.numa_node, pcie_of.get(ref), order)
                order += 1
        unhealthy = {gpu_ref(n.name, g.index) for n in cluster.nodes for g in n.gpus if g.health is Health.UNAVAILABLE}
        self.free: set[str] = set(self.info) - unhealthy - set(busy)
        self.levels: dict[str, LevelIndex] = {
            level: LevelIndex(level, self._groups(level), self.free) for level in LEVELS
        }

    def _groups(self, level: str) -> list[Group]:
        groups: list[Group] = []
        if level == "nvlink":
            for d in self.dmap.domains:
                for n, clique in enumerate(d.cliques):
                    nodes = frozenset(self.info[r].node for r in clique)
                    groups.append(Group(f"{d.id}#{n}" if len(d.cliques) > 1 else d.id, level, clique, nodes, d.id))
        elif level == "pcie-switch":
            groups = [Group(g.id, level, g.gpus, frozenset({g.node}), None) for g in self.dmap.pcie_groups]
        elif level == "numa":
            groups = [Group(g.id, level, g.gpus, frozenset({g.node}), None) for g in self.dmap.numa_groups]
        elif level == "node":
            groups = [
                Group(n.name, level, tuple(gpu_ref(n.name, g.index) for g in n.gpus), frozenset({n.name}), None)
                for n in self.cluster.nodes
            ]
        else:
            groups = [Group("cluster", level, tuple(self.info), frozenset(self.nodes), None)]
        covered = {ref for g in groups for ref in g.gpus}
        groups.extend(
            Group(f"{ref}@{level}", level, (ref,), frozenset({self.info[ref].node}), None)
            for ref in self.info
            if ref not in covered
        )
        return groups

    @contextmanager
    def keeping_whole(self, on: bool) -> Iterator[None]:
        """Within the block, every level's best fit prefers partly used groups (``LevelIndex.keep_whole``)."""
        before = {name: level.keep_whole for name, level in self.levels.items()}
        for level in self.levels.values():
            level.keep_whole = on
        try:
            yield
        finally:
            for name, level in self.levels.items():
                level.keep_whole = before[name]

    @contextmanager
    def spreading(self, on: bool) -> Iterator[None]:
        """Within the block, a TP group over several nodes of one NVLink domain takes the smallest equal
        share per node (the most trays), leaving larger shares for the instances after it."""
        before, self.spread = self.spread, on
        try:
            yield
        finally:
            self.spread = before

    def gpu(self, ref: str) -> GPU:
        info = self.info[ref]
        return self.nodes[info.node].gpu(info.index)

    def resolve_level(self, affinity: Affinity, tp: int) -> str:
        """``auto``: the tightest level whose largest group (ignoring occupancy) holds ``tp`` GPUs."""
        if affinity != "auto":
            return affinity
        if tp == 1:
            return "nvlink"
        for level in LEVELS:
            if self.levels[level].largest_group() >= tp:
                return level
        return "none"

    def tightest_level(self, refs: Iterable[str]) -> str:
        """The tightest level at which all ``refs`` share one group."""
        refs = list(refs)
        for level in LEVELS:
            of_gpu = self.levels[level].of_gpu
            first = of_gpu.get(refs[0], ())
            if len(first) == 1:  # the usual case: the first GPU is in one group here; is every GPU in it?
                group = first[0]
                if all(group in of_gpu.get(ref, ()) for ref in refs):
                    return level
                continue
            common = set(first)
            for ref in refs[1:]:
                common &= set(of_gpu.get(ref, ()))
                if not common:
                    break
            if common:
                return level
        return "none"

    def domain_of(self, refs: Iterable[str]) -> str | None:
        """The NVLink domain holding all ``refs``, or None."""
        gpu_domain = self.dmap.gpu_domain
        refs = list(refs)
        first = gpu_domain.get(refs[0]) if refs else None
        return first if all(gpu_domain.get(r) == first for r in refs) else None

    def take(self, refs: Iterable[str]) -> None:
        """Mark ``refs`` busy, all or none (checked first: a GPU that is not free, or named twice, raises)."""
        refs = list(refs)
        free = self.free
        if len(set(refs)) != len(refs) or not all(ref in free for ref in refs):
            bad = next((r for r in refs if r not in free), None) or next(r for r in refs if refs.count(r) > 1)
            raise ValueError(f"GPU {bad} is not free")
        free.difference_update(refs)
        for index in self.levels.values():
            index.shift(refs, -1)

    def give(self, refs: Iterable[str]) -> None:
        """Mark ``refs`` free, all or none (a GPU free already, unknown, or named twice raises)."""
        refs = list(refs)
        free, info = self.free, self.info
        if len(set(refs)) != len(refs) or any(ref in free or ref not in info for ref in refs):
            bad = next((r for r in refs if r in free or r not in info), None) or next(
                r for r in refs if refs.count(r) > 1
            )
            raise ValueError(f"GPU {bad} is free already or unknown")
        free.update(refs)
        for index in self.levels.values():
            index.shift(refs, +1)
