"""Which rank layouts the engines can launch: one rule, used by the solver, the exact baseline and ``launch``.

vLLM (``--nnodes``/``--node-rank``, mp backend) and SGLang (``--nnodes``/``--node-rank``) start the same
number of local workers on every node and give node ``k`` the global ranks
``[k * g, (k + 1) * g)``, where ``g = tp * pp / nnodes``; global rank ``r`` is stage ``r // tp``,
TP rank ``r % tp``. So a placement is launchable when:

* every node holds one contiguous block of ranks, and every block has the same size ``g``;
* a node's block is either whole pipeline stages (``g`` is a multiple of ``tp``) or an equal share of
  one TP group (``tp`` is a multiple of ``g``: a TP group that spans nodes, which keeps its traffic on
  NVLink only inside a multi-node NVLink domain such as GB200 NVL72).

Anything else (a node with stage 0 and half of stage 1, 8 GPUs on one node and 4 on another) makes
an engine start the wrong ranks on the wrong nodes, so the solver never emits it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _RankLike(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def node(self) -> str: ...

    @property
    def gpu(self) -> int: ...


def node_blocks(ranks: Sequence[_RankLike]) -> list[tuple[str, list[int]]]:
    """Nodes in rank order with their GPUs in rank order (a node that appears twice is kept twice)."""
    blocks: list[tuple[str, list[int]]] = []
    for r in sorted(ranks, key=lambda r: r.rank):
        if blocks and blocks[-1][0] == r.node:
            blocks[-1][1].append(r.gpu)
        else:
            blocks.append((r.node, [r.gpu]))
    return blocks


def layout_problem(ranks: Sequence[_RankLike], tp: int) -> str | None:
    """Why the engines cannot launch this rank layout, or None when they can."""
    blocks = node_blocks(ranks)
    seen: set[str] = set()
    for node, _ in blocks:
        if node in seen:
            return f"the ranks on node {node} are not contiguous; engines need one block of ranks per node"
        seen.add(node)
    if len(blocks) <= 1:
        return None
    sizes = {len(g) for _, g in blocks}
    if len(sizes) > 1:
        listed = ", ".join(f"{n} has {len(g)}" for n, g in blocks)
        return f"{listed} GPUs; multi-node engines need the same number of GPUs on every node"
    (size,) = sizes
    if size % tp and tp % size:
        return (
            f"{size} GPUs per node with tp={tp}: a node must hold whole pipeline stages "
            f"or an equal share of one TP group"
        )
    return None


def per_node_choices(tp: int, pp: int, node_sizes: Sequence[int]) -> list[int]:
    """GPUs per node (``g``) that can launch ``tp x pp`` on nodes of these sizes, most per node first.

    ``g`` divides ``tp * pp`` and is either a multiple of ``tp`` (whole stages per node) or divides
    ``tp`` (a TP group spread over ``tp / g`` nodes).
    """
    total = tp * pp
    largest = max(node_sizes, default=0)
    found = []
    for g in range(min(total, largest), 0, -1):
        if total % g:
            continue
        if g % tp == 0 or tp % g == 0:
            found.append(g)
    return found


__all__ = ["layout_problem", "node_blocks", "per_node_choices"]
