"""The fast solver: degrees from the cost model and capacity, GPUs from the topology."""

from __future__ import annotations

import pytest

from tests.solver.builders import make_request, make_scheduler
from toposched.errors import InfeasibleError, InputError, UnknownNameError
from toposched.solver.request import PlacementRequest


def _domains(s, placement):  # type: ignore[no-untyped-def]
    return {s.index.dmap.gpu_domain[ref] for ref in placement.gpu_refs}


@pytest.mark.parametrize(
    ("model", "extra", "tp"),
    [
        # Seed 000 section 6's ranges come out of capacity + the cost model, not a table:
        ("llama-3.1-8b", {}, 1),  # small model: one GPU meets a 40 ms TPOT
        ("llama-3.1-70b", {}, 4),  # 20-70B: TP=4
        ("qwen2.5-72b", {}, 4),
        ("mixtral-8x22b", {}, 8),  # 141B: TP=8
        ("llama-3.1-405b", {"weight_dtype": "fp8"}, 8),  # 400B+ in FP8 fills one 8-GPU node
    ],
)
def test_tp_follows_capacity_and_slo(model: str, extra: dict[str, str], tp: int) -> None:
    s = make_scheduler("hgx-h100")
    # the running batch is the operating point (the largest meeting the SLO), not a fixed one
    out = s.place(make_request(model, slo_tpot_ms=40, concurrent_seqs=None, **extra))
    (p,) = out.placements
    assert (p.tp, p.pp) == (tp, 1)
    assert p.fallbacks == ()
    assert all(c.held for c in p.constraints), p.constraints


def test_tighter_slo_buys_more_gpus() -> None:
    loose = make_scheduler().place(make_request("llama-3.1-8b", slo_tpot_ms=40)).placements[0]
    tight = make_scheduler().place(make_request("llama-3.1-8b", slo_tpot_ms=7)).placements[0]
    assert loose.tp == 1 and tight.tp > 1 and tight.tpot_ms <= 7


def test_model_too_big_for_a_node_uses_pp_across_nodes() -> None:
    s = make_scheduler(nodes=4)
    (p,) = s.place(make_request("llama-3.1-405b", slo_tpot_ms=60)).placements
    assert (p.tp, p.pp) == (8, 2)
    stage_nodes = [{r.node for r in p.ranks if r.stage == st} for st in range(2)]
    assert all(len(n) == 1 for n in stage_nodes) and stage_nodes[0] != stage_nodes[1]
    assert [r.rank for r in p.ranks] == list(range(16))
    assert p.level == "nvlink"  # every TP group stays in one NVLink domain


def test_best_fit_keeps_whole_domains_free() -> None:
    s = make_scheduler(nodes=2)
    first = s.place(make_request("llama-3.1-70b", id="a", slo_tpot_ms=40)).placements[0]
    second = s.place(make_request("llama-3.1-70b", id="b", slo_tpot_ms=40)).placements[0]
    # the second TP=4 goes next to the first, leaving node h100-01 whole for a TP=8
    assert {r.node for r in first.ranks} == {r.node for r in second.ranks}
    third = s.place(make_request("mixtral-8x22b", id="c", slo_tpot_ms=40)).placements[0]
    assert third.tp == 8 and {r.node for r in third.ranks} == {"h100-01"}


def test_locality_inside_the_domain_prefers_one_numa_node() -> None:
    s = make_scheduler("hgx-h100")
    (p,) = s.place(make_request("llama-3.1-70b", allowed_tp=(2,), slo_tpot_ms=80)).placements
    numas = {s.index.info[r].numa for r in p.gpu_refs}
    assert len(numas) == 1


def test_pcie_box_keeps_tp_inside_one_numa_node() -> None:
    # seed 004: on a PCIe-only box a TP group stays inside one NUMA node
    s = make_scheduler("l40s-8x-pcie")
    (p,) = s.place(make_request("llama-3.1-70b", weight_dtype="fp8", slo_tpot_ms=80)).placements
    assert p.tp == 4 and p.level == "numa"
    assert len({s.index.info[r].numa for r in p.gpu_refs}) == 1
    (q,) = s.place(make_request("llama-3.1-8b", id="small", allowed_tp=(2,))).placements
    assert q.level == "pcie-switch"


def test_nothing_fits_gives_reasons_per_node_and_changes_nothing() -> None:
    s = make_scheduler("hgx-h100", busy=[f"hgx-h100/{i}" for i in range(6)])
    before = s.ledger.accounts()
    out = s.place(make_request("llama-3.1-70b", allowed_tp=(4,)))
    assert out.placements == [] and len(out.unplaced) == 1
    reasons = out.unplaced[0].reasons
    assert any("no nvlink group with 4 free GPUs" in r for r in reasons)
    assert any("node hgx-h100: 2 free GPU(s) [6, 7]" in r for r in reasons)
    assert s.ledger.accounts() == before


def test_bad_requests_are_clear_errors() -> None:
    s = make_scheduler()
    with pytest.raises(UnknownNameError, match="did you mean"):
        s.place(make_request("llama-3-7b"))
    with pytest.raises(ValueError, match="powers of two"):
        PlacementRequest(model="llama-3.1-70b", allowed_tp=(3,))
    out = s.place(make_request("llama-3.1-70b", allowed_tp=(64,)))
    assert out.unplaced and "tp=64" in " ".join(out.unplaced[0].reasons)
    assert all(a.reserved_bytes == 0 for a in s.ledger.accounts().values())


def test_release_restores_the_exact_prior_state() -> None:
    s = make_scheduler(nodes=2)
    s.place(make_request("llama-3.1-70b", id="keep"))
    free_before, accounts_before = set(s.index.free), s.ledger.accounts()
    counts_before = {lv: list(ix.free_count) for lv, ix in s.index.levels.items()}
    (p,) = s.place(make_request("llama-3.1-70b", id="tmp")).placements
    assert s.release(p.id) is True
    assert s.index.free == free_before and s.ledger.accounts() == accounts_before
    assert {lv: list(ix.free_count) for lv, ix in s.index.levels.items()} == counts_before
    assert s.release(p.id) is False


def test_idempotent_by_request_id() -> None:
    s = make_scheduler()
    first = s.place(make_request("llama-3.1-8b", id="same")).placements[0]
    again = s.place(make_request("llama-3.1-8b", id="same")).placements[0]
    assert first == again and len(s.ledger.reservations()) == 1


def test_index_order_ignores_topology_and_says_so() -> None:
    # GPUs 1 and 2 busy: the lowest free indices for TP=4 are 0,3,4,5 -- across the NUMA nodes of a PCIe box.
    s = make_scheduler("l40s-8x-pcie", busy=["l40s/1", "l40s/2"])
    (p,) = s.place(make_request("llama-3.1-70b", weight_dtype="fp8", slo_tpot_ms=80), policy="index-order").placements
    assert [r.gpu for r in p.ranks] == [0, 3, 4, 5]
    affinity = next(c for c in p.constraints if c.name == "domain-affinity")
    assert not affinity.held
    assert p.cross_domain_gbps > 0
    t = make_scheduler("l40s-8x-pcie", busy=["l40s/1", "l40s/2"])
    (q,) = t.place(make_request("llama-3.1-70b", weight_dtype="fp8", slo_tpot_ms=80)).placements
    assert [r.gpu for r in q.ranks] == [4, 5, 6, 7]


def test_cross_domain_budget_queues_work_over_it() -> None:
    s = make_scheduler("l40s-8x-pcie", budget_gbps=0.001)
    out = s.place(
        make_request("llama-3.1-70b", weight_dtype="fp8", slo_class="batch", affinity="none", allowed_tp=(8,))
    )
    assert out.placements == []
    assert any("cross-domain traffic over the" in r for r in out.unplaced[0].reasons)


def test_compression_and_overlap_only_where_the_class_allows() -> None:
    batch = (
        make_scheduler("l40s-8x-pcie")
        .place(make_request("llama-3.1-70b", weight_dtype="fp8", slo_class="batch", affinity="node", allowed_tp=(8,)))
        .placements[0]
    )
    strict = (
        make_scheduler("l40s-8x-pcie")
        .place(
            make_request("llama-3.1-70b", weight_dtype="fp8", slo_class="realtime", affinity="node", allowed_tp=(8,))
        )
        .placements[0]
    )
    assert (batch.compression, batch.overlap) == ("fp8", 0.3)
    assert (strict.compression, strict.overlap) == (None, 0.0)
    # FP8 halves the bytes of each step; the faster steps come more often (traffic = bytes/step x steps/s)
    per_step = batch.cross_domain_gbps * batch.tpot_ms
    assert per_step == pytest.approx(strict.cross_domain_gbps * strict.tpot_ms * 0.5, rel=0.02)
    assert batch.tpot_ms < strict.tpot_ms


def test_spread_replicas_and_selectors() -> None:
    s = make_scheduler(nodes=4)
    out = s.place(make_request("llama-3.1-8b", replicas=3, spread_replicas=True))
    assert len({p.ranks[0].node for p in out.placements}) == 3
    t = make_scheduler(nodes=4)
    out = t.place(make_request("llama-3.1-8b", racks=("rack0",), zones=("zone0",)))
    assert out.placements[0].ranks[0].node in {"h100-00", "h100-01", "h100-02", "h100-03"}
    out = t.place(make_request("llama-3.1-8b", id="x", racks=("rack9",)))
    assert out.unplaced


def test_near_required_keeps_roles_in_one_rack() -> None:
    s = make_scheduler(nodes=8)  # racks of 4 nodes
    s.place(make_request("llama-3.1-70b", id="kv-store", racks=("rack1",)))
    (p,) = s.place(make_request("llama-3.1-8b", id="decode", near="kv-store", near_required=True)).placements
    assert s.index.nodes[p.ranks[0].node].rack == "rack1"
    (q,) = s.place(make_request("llama-3.1-8b", id="pref", near="kv-store")).placements  # preferred, room there
    assert s.index.nodes[q.ranks[0].node].rack == "rack1"
    for n in range(4, 8):  # fill rack1 completely
        s.index.take([f"h100-0{n}/{i}" for i in range(8) if f"h100-0{n}/{i}" in s.index.free])
    (r,) = s.place(make_request("llama-3.1-8b", id="pref2", near="kv-store")).placements
    assert s.index.nodes[r.ranks[0].node].rack == "rack0"  # preference yields when the rack is full
    assert s.place(make_request("llama-3.1-8b", id="req2", near="kv-store", near_required=True)).unplaced


def test_gpu_type_must_be_known() -> None:
    from tests.conftest import FIXTURES
    from toposched.solver.scheduler import Scheduler
    from toposched.topology.model import Cluster
    from toposched.topology.smi import parse_topo_matrix

    node = parse_topo_matrix((FIXTURES / "topo/04_8x-h100-nv18-no-gpunumaid.txt").read_text()).node
    with pytest.raises(InputError, match="does not say which GPU") as info:
        Scheduler(Cluster(nodes=(node,)))
    assert info.value.fix is not None and "H100-SXM" in info.value.fix
    s = Scheduler(Cluster(nodes=(node,)), gpu="H100-SXM")
    assert s.place(make_request("llama-3.1-70b", slo_tpot_ms=40)).placements[0].tp == 4


def test_exact_needs_a_small_cluster() -> None:
    from toposched.solver.exact import place_exact

    with pytest.raises(InfeasibleError, match="at most 128 GPUs"):
        place_exact(make_scheduler(nodes=32), [make_request()])


def test_expert_parallel_placement_reports_hot_expert_copies_and_their_bytes() -> None:
    rates = (0.4, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05)
    plain = make_scheduler("hgx-h200").place(make_request("mixtral-8x7b", allowed_tp=(4,), ep=4)).placements[0]
    hot = (
        make_scheduler("hgx-h200")
        .place(make_request("mixtral-8x7b", allowed_tp=(4,), ep=4, expert_hit_rates=rates, expert_replicas=2))
        .placements[0]
    )
    assert plain.experts is not None and plain.experts.replicas == 0 and plain.experts.extra_bytes_per_gpu == 0
    e = hot.experts
    assert e is not None and e.replicas >= 1
    assert e.imbalance_after < e.imbalance_before
    # one extra expert on a GPU: its 3 x 4096 x 14336 weights in all 32 MoE layers, bf16, tp // ep = 1
    assert e.extra_bytes_per_gpu == 3 * 4096 * 14336 * 32 * 2
    assert hot.hbm_per_gpu.weights == plain.hbm_per_gpu.weights + e.extra_bytes_per_gpu
    assert hot.hbm_per_gpu.total == plain.hbm_per_gpu.total  # the KV cache gives the room
    with pytest.raises(InputError):
        make_scheduler("hgx-h200").place(make_request("mixtral-8x7b", allowed_tp=(4,), ep=4, expert_hit_rates=(1.0,)))


@pytest.mark.parametrize("policy", ["slo", "latency", "index-order", "random", "exact"])
def test_requests_with_equal_fields_keep_their_own_ids(policy: str) -> None:
    # issue 12: candidates are cached by the request's fields without its id; the id must not leak
    s = make_scheduler()
    first = s.place(make_request("llama-3.1-8b", id="first", allowed_tp=(2,)), policy=policy).placements
    second = s.place(make_request("llama-3.1-8b", id="second", allowed_tp=(2,)), policy=policy).placements
    assert [(p.id, p.request_id) for p in first] == [("first", "first")]
    assert [(p.id, p.request_id) for p in second] == [("second", "second")]
    assert {r.id: r.meta.get("placement", "") for r in s.ledger.reservations()}.keys() == {"first", "second"}
    assert '"request_id":"second"' in s.ledger.get("second").meta["placement"]  # type: ignore[union-attr]
