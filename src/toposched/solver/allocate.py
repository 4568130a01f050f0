"""Kubernetes device-plugin ``GetPreferredAllocation``, answered from one node's topology.

The kubelet asks a device plugin: "of these *available* devices, which *size* should I give the
container, given that it *must include* these?" (``ContainerPreferredAllocationRequest``). The
answer is the set with the smallest locality key of ``solver/locality.py`` (``set_key``: one
all-pairs NVLink clique, then link quality, then what the set leaves available, then the fewest
NUMA groups and PCIe switches, then the lowest indices), found by ``locality.choose_on_node``: the
same key and search the scheduler's ``pick_in_group`` uses, so both give the same GPUs for the
same free set. Every combination is scored when there are at most ``EXHAUSTIVE_LIMIT`` of them
(any node with up to 16 available GPUs); otherwise greedy growth plus improving swaps. The result
says which was used.

This module adds the device-plugin edges: indices that the node does not have are bad input
(``InputError``); impossible requests are a value with a ``reason``, not an exception.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from toposched.errors import InputError
from toposched.solver.locality import (
    EXHAUSTIVE_LIMIT,
    AllocationScore,
    Method,
    NodeTopology,
    choose_on_node,
)
from toposched.topology.model import Node


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
    choice = choose_on_node(NodeTopology(node), available, must_include, size, exhaustive_limit=exhaustive_limit)
    return AllocationResult(gpus=choice.gpus, method=choice.method, candidates=choice.candidates, score=choice.score)


__all__ = ["EXHAUSTIVE_LIMIT", "AllocationResult", "AllocationScore", "check_indices", "preferred_allocation"]
