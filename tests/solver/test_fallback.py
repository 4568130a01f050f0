"""The bounded cross-domain fallback: TP groups across NVLink domains within the budget and the SLO."""

from __future__ import annotations

from typing import Any

import pytest

from tests.solver.builders import make_request, make_scheduler
from toposched.solver.index import ClusterIndex
from toposched.solver.request import SLO_CLASSES, Placement, PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.solver.stages import find_stages_across
from toposched.topology.presets import hgx_h100_cluster

# Free GPUs per node of a 4-node HGX H100 cluster: 2, 4, 6, 4 (16 in all, no node with 8).
FREE = {"h100-00": 2, "h100-01": 4, "h100-02": 6, "h100-03": 4}
BUSY = [f"{node}/{i}" for node, free in FREE.items() for i in range(8 - free)]


def fragmented(**kw: Any) -> Scheduler:
    return make_scheduler(nodes=4, busy=BUSY, **kw)


def tp8(**kw: Any) -> PlacementRequest:
    kw.setdefault("slo_class", "batch")
    return make_request("llama-3.1-70b", allowed_tp=(8,), **kw)


def check(p: Placement, name: str) -> tuple[bool, str]:
    c = next(c for c in p.constraints if c.name == name)
    return c.held, c.detail


@pytest.mark.parametrize("policy", ["slo", "latency"])
def test_tp8_on_a_fragmented_cluster_goes_across_two_nodes_only_with_the_flag(policy: str) -> None:
    s = fragmented()
    without = s.place(tp8(), policy=policy)
    assert without.placements == [] and without.unplaced[0].status == "queued"
    assert not any("cross-domain fallback" in r for r in without.unplaced[0].reasons)
    assert s.ledger.reservations() == [] and sum(s.cross_used.values()) == 0

    (p,) = s.place(tp8(allow_cross_domain=True), policy=policy).placements
    # the fewest domains: two nodes of 4, by best fit the two with exactly 4 free (the 6 stays)
    assert {r.node for r in p.ranks} == {"h100-01", "h100-03"}
    assert len({s.index.dmap.gpu_domain[ref] for ref in p.gpu_refs}) == 2
    assert p.tp == 8 and p.pp == 1 and p.fallbacks == ("cross-domain",)
    assert (p.compression, p.overlap) == ("fp8", 0.3)
    held, detail = check(p, "domain-affinity")
    assert not held and "(required nvlink)" in detail and "relaxed by the cross-domain fallback" in detail
    assert check(p, "cross-domain-budget")[0] and check(p, "slo")[0] and check(p, "capacity")[0]
    assert p.stage_domains == (None,) and p.cross_domain_gbps > 0
    assert s.cross_used["batch"] == pytest.approx(p.cross_domain_gbps, abs=1e-3)
    assert [r.id for r in s.ledger.reservations()] == [p.id]


def test_release_gives_the_budget_back() -> None:
    s = fragmented()
    free_before = set(s.index.free)
    (p,) = s.place(tp8(allow_cross_domain=True)).placements
    assert sum(s.cross_used.values()) > 0
    assert s.release(p.id) is True
    assert sum(s.cross_used.values()) == 0 and s.class_budget_left("batch") == pytest.approx(256.0 / 15)
    assert s.index.free == free_before and s.ledger.reservations() == []


def test_over_the_class_budget_it_waits_with_the_reason() -> None:
    s = fragmented(budget_gbps=1.0)
    out = s.place(tp8(allow_cross_domain=True))
    assert out.placements == [] and out.unplaced[0].status == "queued"
    (reason,) = [r for r in out.unplaced[0].reasons if r.startswith("cross-domain fallback")]
    assert "after fp8 compression is over the 0.07 GB/s left for class batch (by " in reason
    assert s.ledger.reservations() == [] and sum(s.cross_used.values()) == 0


def test_a_share_used_by_earlier_fallbacks_counts() -> None:
    # 4 free GPUs on each node; a budget of 45 GB/s gives batch (weight 1 of 15) 3 GB/s
    s = make_scheduler(nodes=4, busy=[f"h100-0{n}/{i}" for n in range(4) for i in range(4)], budget_gbps=45)
    first = s.place(tp8(id="a", allow_cross_domain=True)).placements[0]
    assert 1.5 < first.cross_domain_gbps < 3  # so a second one fits the GPUs but not the share left
    out = s.place(tp8(id="b", allow_cross_domain=True))
    assert out.placements == []
    assert any(
        f"over the {3 - first.cross_domain_gbps:.2f} GB/s left for class batch" in r for r in out.unplaced[0].reasons
    )
    s.release(first.id)
    assert s.place(tp8(id="b", allow_cross_domain=True)).placements


def test_a_placement_that_would_miss_the_slo_is_not_made() -> None:
    # an SLO 1 % over the in-domain TPOT is met in one NVLink domain, not over InfiniBand even with
    # compression and overlap (a two-level all-reduce still adds its inter-node steps). One sequence: its
    # TPOT is the decode step alone (with more, the prompts riding along are compressed too and the gap
    # between the two narrows to 0.3 %)
    inside = make_scheduler(nodes=4).place(tp8(concurrent_seqs=1)).placements[0].tpot_p95_ms
    assert inside is not None
    slo = round(inside * 1.01, 2)
    s = fragmented()
    out = s.place(tp8(slo_tpot_ms=slo, allow_cross_domain=True, concurrent_seqs=1))
    assert out.placements == []
    (reason,) = [r for r in out.unplaced[0].reasons if r.startswith("cross-domain fallback")]
    assert f"SLO {slo:g})" in reason and "misses the SLO (with fp8 compression and 30% overlap)" in reason
    assert s.ledger.reservations() == []
    # a looser SLO the fallback meets
    (p,) = s.place(tp8(id="loose", slo_tpot_ms=40, allow_cross_domain=True)).placements
    assert p.tpot_ms <= 40 and "cross-domain" in p.fallbacks


def test_a_cross_domain_placement_meeting_the_slo_beats_an_in_domain_miss() -> None:
    request = make_request("llama-3.1-70b", allowed_tp=(2, 8), slo_tpot_ms=25, slo_class="batch")
    (miss,) = fragmented().place(request).placements  # TP2 x PP2 in one node, over the SLO
    assert (miss.tp, miss.pp, miss.fallbacks) == (2, 2, ()) and miss.tpot_ms > 25 and not check(miss, "slo")[0]
    (p,) = fragmented().place(request.model_copy(update={"allow_cross_domain": True})).placements
    assert (p.tp, p.fallbacks) == (8, ("cross-domain",)) and p.tpot_ms <= 25 and check(p, "slo")[0]


def test_no_free_gpus_for_the_fallback_is_a_reason() -> None:
    s = make_scheduler(nodes=2, busy=[f"h100-0{n}/{i}" for n in range(2) for i in range(5)])  # 3 + 3 free
    out = s.place(tp8(allow_cross_domain=True))
    assert out.placements == []
    assert any("cross-domain fallback" in r and "no free GPUs for it (6 free" in r for r in out.unplaced[0].reasons)


def test_realtime_keeps_full_precision_and_no_overlap() -> None:
    batch = fragmented().place(tp8(allow_cross_domain=True)).placements[0]
    realtime = fragmented().place(tp8(slo_class="realtime", allow_cross_domain=True)).placements[0]
    assert (realtime.compression, realtime.overlap) == (None, 0.0)
    assert "cross-domain" in realtime.fallbacks
    assert realtime.tpot_ms > batch.tpot_ms
    assert realtime.cross_domain_gbps > batch.cross_domain_gbps  # no FP8 on the wire


@pytest.mark.parametrize("policy", ["slo", "latency", "index-order", "random"])
def test_the_flag_changes_nothing_while_one_domain_has_room(policy: str) -> None:
    mix = [
        make_request("llama-3.1-8b", id="a", allowed_tp=(2,)),
        make_request("llama-3.1-70b", id="b", slo_tpot_ms=40),
        make_request("mixtral-8x22b", id="c", slo_tpot_ms=40),
        make_request("llama-3.1-8b", id="d", slo_tpot_ms=7),
        make_request("llama-3.1-70b", id="e", allowed_tp=(8,), slo_class="batch"),
    ]
    off, on = make_scheduler(nodes=6, seed=3), make_scheduler(nodes=6, seed=3)
    for request in mix:
        a = off.place(request, policy=policy)
        b = on.place(request.model_copy(update={"allow_cross_domain": True}), policy=policy)
        assert a.placements == b.placements and a.unplaced == b.unplaced
        assert a.placements and not any("cross-domain" in p.fallbacks for p in b.placements)
    assert off.cross_used == on.cross_used and off.index.free == on.index.free
    # the flag does not change the degree options, so a request without it shares their cache entry
    on.candidates(mix[0])
    assert len(on._options) == len(off._options)


def test_the_fallback_keeps_to_the_nodes_the_request_may_use() -> None:
    s = make_scheduler(nodes=8, busy=[f"h100-0{n}/{i}" for n in range(8) for i in range(4)])  # 4 free each
    (p,) = s.place(tp8(racks=("rack1",), allow_cross_domain=True)).placements
    assert {s.index.nodes[r.node].rack for r in p.ranks} == {"rack1"} and len({r.node for r in p.ranks}) == 2
    assert s.place(tp8(id="x", zones=("zone9",), allow_cross_domain=True)).placements == []


def test_pipeline_stages_across_nodes_keep_a_launchable_layout() -> None:
    index = ClusterIndex(hgx_h100_cluster(nodes=6), busy=[f"h100-0{n}/{i}" for n in range(6) for i in range(4)])
    stages = find_stages_across(index, 8, 2, lambda _g: True, lambda _r: True)
    assert stages is not None and [len(s) for s in stages] == [8, 8]
    nodes = [[index.info[r].node for r in stage] for stage in stages]
    assert all(len(set(n)) == 2 for n in nodes) and not set(nodes[0]) & set(nodes[1])  # 4 + 4, no node shared
    assert find_stages_across(index, 8, 4, lambda _g: True, lambda _r: True) is None  # 16 free, 32 needed


def test_class_waits_never_shorter_for_stricter_classes() -> None:
    waits = [SLO_CLASSES[c].cross_domain_after_s for c in ("realtime", "interactive", "standard", "batch")]
    assert waits == [60, 5, 0, 0]  # interactive measured on churn-128, standard on churn-tiny (docs/simulator.md)
    assert waits == sorted(waits, reverse=True)
