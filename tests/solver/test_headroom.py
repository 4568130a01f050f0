"""``keep_whole_domains``: small instances leave the last wholly free NVLink domains to the large ones."""

from __future__ import annotations

import pytest

from tests.solver.builders import make_request, make_scheduler

# node 0 full, node 1 with 4 free, nodes 2 and 3 wholly free
BUSY = [f"h100-00/{i}" for i in range(8)] + [f"h100-01/{i}" for i in range(4)]


@pytest.mark.parametrize("policy", ["slo", "latency"])
def test_a_small_instance_takes_partly_used_room_and_never_the_last_whole_domain(policy: str) -> None:
    s = make_scheduler(nodes=4, busy=BUSY)
    # room in a partly used domain: the headroom changes nothing
    (p,) = s.place(make_request("llama-3.1-8b", id="a", allowed_tp=(4,), keep_whole_domains=1), policy).placements
    assert {r.node for r in p.ranks} == {"h100-01"}
    # two whole domains left, one kept: the next may break one of them
    (q,) = s.place(make_request("llama-3.1-8b", id="b", allowed_tp=(4,), keep_whole_domains=1), policy).placements
    assert len({r.node for r in q.ranks}) == 1 and q.ranks[0].node in {"h100-02", "h100-03"}
    # q's node has 4 free now; fill it, then only one whole domain is left
    (r,) = s.place(make_request("llama-3.1-8b", id="c", allowed_tp=(4,), keep_whole_domains=1), policy).placements
    assert r.ranks[0].node == q.ranks[0].node
    held = s.place(make_request("llama-3.1-8b", id="d", allowed_tp=(1,), keep_whole_domains=1), policy)
    assert held.placements == [] and held.unplaced[0].status == "queued"
    assert any("keep_whole_domains 1" in reason for reason in held.unplaced[0].reasons)
    assert len(s.ledger.reservations()) == 3  # nothing booked for the refused request
    # without the headroom it breaks the last whole domain; a TP8 could have had it
    (t,) = s.place(make_request("llama-3.1-8b", id="e", allowed_tp=(1,)), policy).placements
    assert len(t.ranks) == 1
    big = s.place(make_request("llama-3.1-70b", id="f", allowed_tp=(8,)), policy)
    assert big.placements == []


def test_the_headroom_does_not_hold_back_an_instance_that_needs_a_whole_domain() -> None:
    s = make_scheduler(nodes=2, busy=[f"h100-00/{i}" for i in range(8)])
    (p,) = s.place(make_request("llama-3.1-70b", allowed_tp=(8,), keep_whole_domains=1)).placements
    # it takes the last whole domain: that is what the headroom keeps it for (a TP8 breaks no
    # domain it does not fill; callers set the field for smaller instances only)
    assert {r.node for r in p.ranks} == {"h100-01"}


def test_keep_whole_domains_is_bounded() -> None:
    with pytest.raises(ValueError, match="keep_whole_domains"):
        make_request("llama-3.1-8b", keep_whole_domains=-1)


def test_a_sized_headroom_counts_places_for_that_many_gpus_in_domains_of_any_size() -> None:
    """``Scheduler.headroom_size`` (a mixed cluster: an 8-GPU HGX domain beside a 16-GPU domain of four GB200 trays):
    the headroom keeps places for 8 GPUs (``free // 8`` per domain), not wholly free domains of the largest
    size, which an 8-GPU instance does not need."""
    from toposched.solver.scheduler import Scheduler
    from toposched.solver.stages import breaks_reserve
    from toposched.topology.model import Cluster, NVLinkClique
    from toposched.topology.presets import gb200_nvl72, hgx

    rack = gb200_nvl72("g")
    trays = rack.nodes[:4]
    clique = NVLinkClique(id="g/clique0", nodes=tuple(t.name for t in trays), bandwidth_gbps=900.0)
    cluster = Cluster(name="mix", nodes=(hgx("h0", "NVIDIA H100 80GB HBM3", 79.65), *trays), fabric=rack.fabric,
                      cliques=(clique,))  # fmt: skip
    hgx_pair, gb_pair = [["h0/0", "h0/1"]], [["g-tray00/0", "g-tray00/1"]]
    # 16 GB200 GPUs free: two places for 8 there and the HGX domain a third; a TP2 anywhere leaves two
    idle = Scheduler(cluster).index
    assert not breaks_reserve(idle, hgx_pair, 2, 8) and not breaks_reserve(idle, gb_pair, 2, 8)
    assert breaks_reserve(idle, hgx_pair, 3, 8) and breaks_reserve(idle, gb_pair, 3, 8)
    # nine GB200 GPUs busy (seven free: no place for 8): the HGX domain is the last place, a TP2 in the
    # GB200 domain takes none
    busy = [f"g-tray0{t}/{i}" for t in range(2) for i in range(4)] + ["g-tray02/0"]
    index = Scheduler(cluster, busy=busy).index
    assert breaks_reserve(index, hgx_pair, 1, 8) and not breaks_reserve(index, [["g-tray02/1", "g-tray02/2"]], 1, 8)
    # unsized, the reserve is wholly free domains of the largest size (the GB200 one): the HGX is not kept
    assert not breaks_reserve(index, hgx_pair, 1)
    # the scheduler's policies ask it with Scheduler.headroom_size. 14 GB200 GPUs free (one place for 8, two
    # GPUs to spare) and the whole HGX: best fit puts a TP2 on the HGX (8 free before 14), which takes a
    # place; keeping two places, it goes to the GB200 trays' spare room instead
    two = [f"g-tray00/{i}" for i in range(2)]
    for size, where in ((None, {"h0"}), (8, {t.name for t in trays})):
        s = Scheduler(cluster, busy=two)
        s.headroom_size = size
        (p,) = s.place(make_request("llama-3.1-8b", id="two", allowed_tp=(2,), keep_whole_domains=2)).placements
        assert {r.node for r in p.ranks} <= where
