"""Constraints as plugins: node filters with a reason per node, checks read by name, why_not over every node."""

from __future__ import annotations

import pytest

from tests.solver.builders import make_request, make_scheduler
from toposched.solver.constraints import CHECKS, FilterContext, first_failure


def test_every_placement_carries_every_check_by_name() -> None:
    s = make_scheduler(nodes=1)
    (p,) = s.place(make_request("llama-3.1-8b")).placements
    assert [c.name for c in p.constraints] == ["domain-affinity", "cross-domain-budget", "capacity", "slo"]
    assert len(CHECKS) == len(p.constraints)
    assert p.check("capacity").held and "GiB per GPU" in p.check("capacity").detail
    with pytest.raises(KeyError, match="no constraint check 'selector'"):
        p.check("selector")


def test_a_node_filter_names_the_plugin_and_the_reason() -> None:
    s = make_scheduler(nodes=2)
    request = make_request("llama-3.1-8b", node_selector={"pool": "gold"}, racks=("r9",))
    ctx = FilterContext(request, frozenset(s.index.nodes), set(), None, False)
    status = first_failure(s.node_filters, ctx, s.index.nodes["h100-00"])
    assert not status.ok and status.plugin == "node-selector" and "pool=gold" in status.reason
    other = FilterContext(make_request("llama-3.1-8b"), frozenset({"h100-01"}), set(), None, False)
    assert first_failure(s.node_filters, other, s.index.nodes["h100-00"]).plugin == "gpu-type"
    assert first_failure(s.node_filters, other, s.index.nodes["h100-01"]).ok


def test_why_not_accounts_for_every_node_not_the_first_few() -> None:
    # 40 nodes: node i has (i % 8) + 1 GPUs busy, so none has 8 free
    busy = [f"h100-{i:02d}/{j}" for i in range(40) for j in range(i % 8 + 1)]
    s = make_scheduler(nodes=40, busy=busy)
    (unplaced,) = s.place(make_request("llama-3.1-70b", allowed_tp=(8,))).unplaced
    text = "\n".join(unplaced.reasons)
    assert "0/40 nodes have 8 free GPUs in one nvlink group" in text
    counted = [r for r in unplaced.reasons if r.startswith("  ") and "node(s)" in r]
    assert sum(int(r.split()[0]) for r in counted) == 40  # every node has one verdict
    assert "  5 node(s) with at most 7 free GPU(s) in one nvlink group" in counted
    assert "  5 node(s) with at most 0 free GPU(s) in one nvlink group" in counted
    # the closest nodes are listed first
    details = [r for r in unplaced.reasons if r.startswith("node ")]
    assert details[0].startswith("node h100-00: 7 free GPU(s)") and len(details) == 8

    (excluded,) = s.place(make_request("llama-3.1-70b", id="b", allowed_tp=(8,), node_selector={"pool": "x"})).unplaced
    assert "  40 node(s) excluded by node-selector (e.g. h100-00: labels lack pool=x)" in excluded.reasons
