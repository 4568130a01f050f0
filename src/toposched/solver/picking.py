"""Choosing a group's GPUs for the scheduler (``pick_in_group``) with the locality key of
``solver/locality.py``, and the node scoring tables it uses, cached per cluster index and node shape.

Groups that span several nodes (a multi-node NVLink domain such as GB200 NVL72, or affinity level
``none``) go through ``pick_in_group``: it takes the fewest nodes with the same number of GPUs on
each (the engines' launch rule, ``layout.per_node_choices``; one node whenever one holds them all),
chooses those nodes by best fit (the fewest candidate GPUs that still hold the share, then cluster
order), and picks each node's share with the single-node key. It looks at each node's candidates
once, so a 72-GPU NVL72 group or a whole-cluster group costs a pass over the candidates plus one
small search per chosen node. None means no equal split exists among the candidates.
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Sequence

from toposched.solver.index import ClusterIndex
from toposched.solver.layout import per_node_choices
from toposched.solver.locality import NodeTopology, choose_on_node
from toposched.topology.domains import gpu_ref
from toposched.topology.model import Node

# Node topologies per cluster index, built on first use (a decision touches one or a few nodes).
_TOPOLOGIES: weakref.WeakKeyDictionary[ClusterIndex, dict[str, NodeTopology]] = weakref.WeakKeyDictionary()


# Tables by node shape: they hold GPU indices only, so the nodes of one kind in a cluster (2,048
# identical HGX nodes) share one build instead of paying ~0.7 ms each on first use.
_BY_SHAPE: dict[tuple[object, ...], NodeTopology] = {}
_BY_SHAPE_LIMIT = 1024


def _shape(node: Node) -> tuple[object, ...]:
    gpus = tuple((g.index, g.numa_node, g.cpu_affinity, g.health) for g in node.gpus)
    return (gpus, node.links)


WARM_SHAPES_LIMIT = 64
"""``warm_node_topologies`` builds tables ahead only for clusters of at most this many node shapes (a
table costs about 0.7 ms; a cluster of many different nodes builds them as decisions reach the nodes)."""


def warm_node_topologies(index: ClusterIndex) -> None:
    """Give every node its scoring tables when a scheduler builds its index, rather than on the first
    decision that reaches the node. Nodes of one shape share one table, so on a cluster of few shapes this
    is cheap (65,536 GPUs of one shape: 0.07 s of CPU) and takes the lookups off the decisions (there: p99
    0.29-0.32 -> 0.26 ms, p50 0.143-0.145 -> 0.135-0.138 ms, CPU time). Above ``WARM_SHAPES_LIMIT``
    shapes it does nothing."""
    by_shape: dict[tuple[object, ...], list[str]] = {}
    for name, node in index.nodes.items():
        by_shape.setdefault(_shape(node), []).append(name)
    if len(by_shape) > WARM_SHAPES_LIMIT:
        return
    per_node = _TOPOLOGIES.setdefault(index, {})
    for shape, names in by_shape.items():
        topo = _table(shape, index.nodes[names[0]])
        for name in names:
            per_node[name] = topo


def _table(shape: tuple[object, ...], node: Node) -> NodeTopology:
    topo = _BY_SHAPE.get(shape)
    if topo is None:
        if len(_BY_SHAPE) >= _BY_SHAPE_LIMIT:
            _BY_SHAPE.clear()
        topo = _BY_SHAPE[shape] = NodeTopology(node)
    return topo


def node_topology(index: ClusterIndex, node: str) -> NodeTopology:
    """The scoring tables of one node of ``index``'s cluster (cached for the index's lifetime)."""
    per_node = _TOPOLOGIES.setdefault(index, {})
    topo = per_node.get(node)
    if topo is None:
        topo = per_node[node] = _table(_shape(index.nodes[node]), index.nodes[node])
    return topo


_CHOICES_LIMIT = 4096
"""Most remembered answers per node shape (an 8-GPU node has at most 256 x 8; larger nodes start over)."""


def _choice(topo: NodeTopology, available: list[int], size: int) -> tuple[int, ...]:
    """``choose_on_node(topo, available, (), size).gpus``, remembered per node shape: nodes of one shape
    share ``topo`` and a busy cluster repeats the same free sets, so most decisions score nothing."""
    key = (tuple(sorted(available)), size)
    choice = topo.choices.get(key)
    if choice is None:
        if len(topo.choices) >= _CHOICES_LIMIT:
            topo.choices.clear()
        choice = topo.choices[key] = choose_on_node(topo, key[0], (), size)
    return choice.gpus


def pick_in_group(index: ClusterIndex, candidates: Sequence[str], size: int) -> list[str] | None:
    """``size`` of the free GPU refs ``candidates`` (one group) in rank order, or None if no launchable set.

    The set uses the fewest nodes with the same number ``g`` of GPUs on each (``g`` divides ``size``,
    see ``layout.per_node_choices``; the most nodes inside ``ClusterIndex.spreading``). Nodes are chosen
    by best fit: the fewest candidates that still hold ``g``, then cluster order. On each node the ``g``
    GPUs minimise ``set_key`` among that node's candidates, exactly as ``toposched allocate`` answers
    with those candidates available. The result lists the nodes in cluster order, each node's GPUs
    together in index order.
    """
    if size < 1 or len(candidates) < size:
        return None
    info = index.info
    by_node: dict[str, list[int]] = {}
    node_order: dict[str, int] = {}
    for ref in candidates:
        gpu = info[ref]
        by_node.setdefault(gpu.node, []).append(gpu.index)
        node_order[gpu.node] = gpu.order  # nodes hold contiguous blocks of the cluster order
    if len(by_node) == 1:  # a group inside one node (the usual case): that node holds every GPU
        ((node, available),) = by_node.items()
        return [gpu_ref(node, i) for i in _choice(node_topology(index, node), available, size)]
    shares = per_node_choices(size, 1, [len(v) for v in by_node.values()])
    for share in reversed(shares) if index.spread else shares:  # most GPUs per node first, unless spreading
        fits = [(len(v), node_order[n], n) for n, v in by_node.items() if len(v) >= share]
        count = size // share
        if len(fits) < count:
            continue
        chosen = sorted(heapq.nsmallest(count, fits), key=lambda f: f[1])
        picked: list[str] = []
        for _, _, node in chosen:
            picked.extend(gpu_ref(node, i) for i in _choice(node_topology(index, node), by_node[node], share))
        return picked
    return None


__all__ = ["WARM_SHAPES_LIMIT", "node_topology", "pick_in_group", "warm_node_topologies"]
