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
