"""Prefill/decode disaggregation (solver/pd.py): rack pairing, KV NICs on the GPU's NUMA node, stores."""

from __future__ import annotations

from typing import Any

import pytest

from tests.solver.builders import make_request
from toposched.errors import InputError
from toposched.solver.pd import Disaggregation, PdOutcome, kv_nics, place_pd, role_ids
from toposched.solver.request import Placement
from toposched.solver.scheduler import Scheduler
from toposched.topology.domains import build_domain_map, gpu_ref
from toposched.topology.model import Cluster, LinkKind, NicLink, Node
from toposched.topology.presets import hgx_h100_cluster, load_preset


def _pd(cluster: Cluster, *, busy: tuple[str, ...] = (), model: str = "llama-3.1-70b", **kw: Any) -> PdOutcome:
    """A disaggregated plan with a store; ``kw`` holds ``Disaggregation`` fields and request fields."""
    spec = {k: kw.pop(k) for k in list(kw) if k in Disaggregation.model_fields}
    spec.setdefault("kv_store", "mooncake")
    kw.setdefault("slo_ttft_ms", 600)
    base = make_request(model, id="plan", slo_tpot_ms=40, concurrent_seqs=8, **kw)
    return place_pd(Scheduler(cluster, busy=busy), base, Disaggregation(**spec))


def _role(out: PdOutcome, role: str) -> list[Placement]:
    return [p for p in out.outcome.placements if p.role == role]


def _racks(p: Placement, nodes: dict[str, Node]) -> set[str | None]:
    return {nodes[r.node].rack for r in p.ranks}


def test_every_decode_shares_a_rack_with_its_prefill_and_a_store_on_the_256_gpu_preset() -> None:
    cluster = load_preset("cluster-32x-hgx-h100")
    nodes = {n.name: n for n in cluster.nodes}
    # the first instances fill rack0, so later decode instances must follow their prefill elsewhere
    busy = tuple(f"h100-0{n}/{g}" for n in (1, 2, 3) for g in range(8))
    # a TTFT of 150 ms needs TP=8 prefill instances (``test_prefill_is_sized_by_ttft_and_decode_by_tpot``), so
    # the roles fill whole nodes
    out = _pd(cluster, busy=busy, prefill=3, decode=6, slo_ttft_ms=150)
    prefills, decodes = _role(out, "prefill"), _role(out, "decode")
    assert out.outcome.unplaced == [] and len(prefills) == 3 and len(decodes) == 6
    assert {p.tp for p in prefills} == {8}
    assert [p.id for p in prefills] == role_ids("plan", "prefill", 3)
    assert {p.request_id for p in prefills} == {"plan-prefill"} and {p.request_id for p in decodes} == {"plan-decode"}
    assert out.layout is not None and set(out.layout.pairs) == {p.id for p in decodes}
    by_id = {p.id: p for p in prefills}
    store_racks = {s.rack for s in out.stores}
    for d in decodes:
        prefill = by_id[out.layout.pairs[d.id]]
        assert _racks(d, nodes) <= _racks(prefill, nodes), (d.id, prefill.id)
        assert _racks(d, nodes) <= store_racks
        assert d.check("near").held
    assert len(_racks_of(decodes, nodes)) > 1  # the busy rack0 really pushed pairs into other racks
    assert len(out.stores) == len(store_racks) == len(_racks_of(decodes, nodes))  # one store per decode rack


def _racks_of(placements: list[Placement], nodes: dict[str, Node]) -> set[str | None]:
    return {rack for p in placements for rack in _racks(p, nodes)}


def test_kv_nics_are_nearest_nics_of_each_gpu_on_its_numa_node() -> None:
    cluster = load_preset("cluster-32x-hgx-h100")
    nodes = {n.name: n for n in cluster.nodes}
    dmap = build_domain_map(cluster)
    out = _pd(cluster, prefill=2, decode=3, model="llama-3.1-8b")
    placements = out.outcome.placements
    assert len(placements) == 5
    for p in placements:
        assert len(p.kv_nics) == len(p.ranks) == len(p.host_numa)
        for r, device, numa in zip(p.ranks, p.kv_nics, p.host_numa, strict=True):
            node = nodes[r.node]
            nic = next(n for n in node.nics if n.device == device)
            assert nic.name in dmap.nearest_nics[gpu_ref(r.node, r.gpu)]
            (kind,) = [nl.kind for nl in node.nic_links if nl.gpu == r.gpu and nl.nic == nic.name]
            assert kind is not LinkKind.SYS  # not across NUMA nodes
            assert numa == node.gpu(r.gpu).numa_node is not None


def test_a_tp8_instance_spreads_its_kv_over_both_numa_nodes_nics() -> None:
    cluster = hgx_h100_cluster(nodes=4)
    out = _pd(cluster, prefill=1, decode=1, model="llama-3.1-405b", weight_dtype="fp8")
    for p in out.outcome.placements:
        assert p.tp == 8
        assert list(p.kv_nics) == [f"mlx5_{r.gpu}" for r in p.ranks]  # HGX: one NIC per GPU, on its switch
        assert set(p.host_numa) == {0, 1}


def _racks_of_four_with_four_free(nodes: int = 8) -> tuple[Cluster, tuple[str, ...]]:
    """Racks of four HGX nodes with four free GPUs each (h100-00/0-3, h100-04/0-3): room for one TP4
    instance per rack, so no rack holds a prefill instance and its decode instance together."""
    cluster = hgx_h100_cluster(nodes=nodes, nodes_per_rack=4)
    free = {f"h100-0{n}/{g}" for n in (0, 4) for g in range(4)}
    busy = tuple(f"{n.name}/{g.index}" for n in cluster.nodes for g in n.gpus if f"{n.name}/{g.index}" not in free)
    return cluster, busy


def test_a_decode_without_room_in_its_prefills_rack_goes_elsewhere_and_says_so() -> None:
    cluster, busy = _racks_of_four_with_four_free()
    nodes = {n.name: n for n in cluster.nodes}
    out = _pd(cluster, busy=busy, prefill=1, decode=1, allowed_tp=(4,))
    (prefill,), (decode,) = _role(out, "prefill"), _role(out, "decode")
    assert _racks(prefill, nodes) != _racks(decode, nodes)
    near = decode.check("near")
    assert not near.held and "not in the rack of prefill plan-prefill" in near.detail
    assert [s.rack for s in out.stores] == list(_racks(decode, nodes))  # the store follows the decode instance


def test_with_same_rack_required_that_decode_is_not_placed_and_nothing_is_left_booked() -> None:
    cluster, busy = _racks_of_four_with_four_free()
    scheduler = Scheduler(cluster, busy=busy)
    base = make_request(id="plan", allowed_tp=(4,))
    out = place_pd(scheduler, base, Disaggregation(prefill=1, decode=1, kv_store="mooncake", same_rack_required=True))
    (prefill,) = _role(out, "prefill")
    assert _role(out, "decode") == [] and out.stores == []
    (unplaced,) = out.outcome.unplaced
    assert unplaced.request_id == "plan-decode" and unplaced.replica == 0
    assert any("not in the same rack as placement plan-prefill" in reason for reason in unplaced.reasons)
    # the rack-by-rack trials released what they booked: only the prefill instance holds GPUs
    assert set(scheduler.placements) == {"plan-prefill"}
    assert len(scheduler.index.free) == 8 - len(prefill.ranks)
    held = {ref for ref, a in scheduler.ledger.accounts().items() if a.reserved_bytes > 0}
    assert held == set(prefill.gpu_refs)


def test_a_prefill_and_its_decodes_go_to_the_tightest_rack_that_holds_them_all() -> None:
    cluster = hgx_h100_cluster(nodes=8, nodes_per_rack=4)
    nodes = {n.name: n for n in cluster.nodes}
    # rack0 has 8 free GPUs (too few for a TP4 prefill and two TP4 decodes), rack1 has 16
    free = {f"h100-00/{g}" for g in range(8)} | {f"h100-0{n}/{g}" for n in (4, 5) for g in range(8)}
    busy = tuple(f"{n.name}/{g.index}" for n in cluster.nodes for g in n.gpus if f"{n.name}/{g.index}" not in free)
    out = _pd(cluster, busy=busy, prefill=1, decode=2, allowed_tp=(4,), same_rack_required=True)
    assert out.outcome.unplaced == []
    assert {rack for p in out.outcome.placements for rack in _racks(p, nodes)} == {"rack1"}


def test_prefill_is_sized_by_ttft_and_decode_by_tpot() -> None:
    """A TTFT that only TP8 meets sizes the prefill instance; the decode instance meets its TPOT with fewer.

    A prefill instance's TTFT is half a pass of wait and its pass (``perf/serving.py prefill_point``): with
    one 1,024-token prompt per pass, 123 ms at TP8 and about 190 ms at TP4."""
    cluster = hgx_h100_cluster(nodes=4)
    base = make_request("llama-3.1-70b", id="plan", slo_ttft_ms=150, slo_tpot_ms=40, concurrent_seqs=8)
    out = place_pd(Scheduler(cluster), base, Disaggregation(prefill=1, decode=1))
    (prefill,), (decode,) = _role(out, "prefill"), _role(out, "decode")
    assert prefill.check("slo").held and prefill.ttft_ms <= 150 and prefill.tp == 8 and prefill.max_num_seqs == 1
    assert decode.check("slo").held and decode.tpot_ms <= 40 and decode.tp < prefill.tp
    assert out.stores == []  # no --kv-store, no stores


def _kv_of_gpu0(node: Node) -> tuple[str, ...]:
    cluster = Cluster(name="one", nodes=(node,))
    placed = Scheduler(cluster).place(make_request("llama-3.1-8b", allowed_tp=(1,)))
    (p,) = placed.placements
    at_gpu0 = p.model_copy(update={"ranks": (p.ranks[0].model_copy(update={"gpu": 0}),)})
    return kv_nics(at_gpu0, {node.name: node}, build_domain_map(cluster))


def test_a_gpu_without_a_nearest_rdma_nic_on_its_numa_node_is_an_input_error() -> None:
    node = load_preset("hgx-h100").nodes[0]
    assert _kv_of_gpu0(node) == ("mlx5_0",)
    # GPU 0's only NIC is across the NUMA boundary
    links = (*(nl for nl in node.nic_links if nl.gpu != 0), NicLink(gpu=0, nic="NIC4", kind=LinkKind.SYS))
    with pytest.raises(InputError, match=r"GPU hgx-h100/0 of req has no nearest NIC with an RDMA device on its NUMA"):
        _kv_of_gpu0(node.model_copy(update={"nic_links": links}))
    # the NICs are known by name only (no RDMA device)
    bare = tuple(n.model_copy(update={"device": None}) for n in node.nics)
    with pytest.raises(InputError, match=r"nearest: NIC0\)"):
        _kv_of_gpu0(node.model_copy(update={"nics": bare}))


def test_ties_between_nearest_nics_spread_the_ranks() -> None:
    """Two GPUs behind one switch with two NICs: each rank gets its own NIC."""
    node = load_preset("hgx-h100").nodes[0]
    links = tuple(nl for nl in node.nic_links if nl.gpu not in (0, 1))
    links += tuple(NicLink(gpu=g, nic=f"NIC{n}", kind=LinkKind.PIX) for g in (0, 1) for n in (0, 1))
    cluster = Cluster(name="one", nodes=(node.model_copy(update={"nic_links": links}),))
    placed = Scheduler(cluster).place(make_request("llama-3.1-8b", allowed_tp=(2,)))
    (p,) = placed.placements
    pair = p.model_copy(update={"ranks": tuple(r.model_copy(update={"gpu": r.rank}) for r in p.ranks)})
    by_name = {n.name: n for n in cluster.nodes}
    assert sorted(kv_nics(pair, by_name, build_domain_map(cluster))) == ["mlx5_0", "mlx5_1"]
