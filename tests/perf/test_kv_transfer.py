"""KV transfer time between a prefill and a decode placement (perf/kv_transfer.py)."""

from __future__ import annotations

import itertools

import pytest

from toposched.errors import InputError
from toposched.perf.hardware import get_gpu
from toposched.perf.kv_transfer import (
    KvLane,
    kv_bytes_per_token,
    kv_links,
    kv_route,
    rank_kv_bytes_per_token,
)
from toposched.perf.links import get_link
from toposched.solver.pd import Disaggregation, cluster_kv_links, place_pd, placement_lanes, rank_kv_needs
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.presets import load_preset
from toposched.workload.catalog import resolve_model

H100 = get_gpu("H100")
SPEC = resolve_model("llama-3.1-70b")  # 80 layers, 8 KV heads of 128: 320 KiB per token in BF16


def gpus(node: str, rack: str | None, count: int, *, first: int = 0, shared_nic: bool = False) -> list[KvLane]:
    """``count`` ranks on GPUs ``first..`` of ``node``, each on its own NIC (or all on ``mlx5_0``)."""
    return [
        KvLane(node=node, rack=rack, nic="mlx5_0" if shared_nic else f"mlx5_{first + i}", gpu=first + i)
        for i in range(count)
    ]


def shard(tp: int) -> list[float]:
    return [rank_kv_bytes_per_token(SPEC, tp, SPEC.num_layers)] * tp


LINKS = kv_links(H100, "ib-ndr", {"r0": 32, "r1": 32})


def test_kv_bytes_follow_the_memory_model_and_the_kv_dtype() -> None:
    assert kv_bytes_per_token(SPEC) == 80 * 8 * 2 * 128 * 2  # layers x KV heads x (K, V) x head dim x BF16
    assert kv_bytes_per_token(SPEC, "fp8") == kv_bytes_per_token(SPEC) // 2
    # TP shards the KV heads; past the 8 KV heads they are replicated, not split further
    assert rank_kv_bytes_per_token(SPEC, 4, 80) == kv_bytes_per_token(SPEC) / 4
    assert rank_kv_bytes_per_token(SPEC, 16, 80) == rank_kv_bytes_per_token(SPEC, 8, 80)
    assert rank_kv_bytes_per_token(SPEC, 4, 40) == rank_kv_bytes_per_token(SPEC, 4, 80) / 2  # a PP stage's layers


def test_nvlink_beats_one_leaf_which_beats_crossing_the_spine() -> None:
    prefill = gpus("a", "r0", 4)
    same_node = kv_route(prefill, gpus("a", "r0", 4, first=4), shard(4), LINKS)
    same_rack = kv_route(prefill, gpus("b", "r0", 4), shard(4), LINKS)
    cross = kv_route(prefill, gpus("c", "r1", 4), shard(4), LINKS)
    assert (same_node.scope, same_rack.scope, cross.scope) == ("same-node", "same-rack", "cross-rack")
    for tokens in (1, 1024, 32_768):
        assert same_node.ms(tokens) < same_rack.ms(tokens) < cross.ms(tokens)
    # a 1,024-token prompt: 320 MiB over 4 NICs of 36 GB/s (Vidur's measured NDR send/recv), plus 17 us
    nic = get_link("ib-ndr")
    expected = nic.p2p_alpha_us / 1000 + kv_bytes_per_token(SPEC) * 1024 / 4 / (nic.p2p_bandwidth_gbps * 1e6)
    assert same_rack.ms(1024) == pytest.approx(expected)
    # crossing a non-blocking spine adds its latency only
    assert cross.ms(1024) - same_rack.ms(1024) == pytest.approx(LINKS.spine_latency_us / 1000)


def test_time_grows_with_the_prompt() -> None:
    route = kv_route(gpus("a", "r0", 2), gpus("b", "r1", 2), shard(2), LINKS)
    times = [route.ms(n) for n in (0, 1, 16, 256, 4096, 65_536)]
    assert times[0] == 0.0
    assert all(a < b for a, b in itertools.pairwise(times))


def test_tp_ranks_send_in_parallel_and_a_shared_nic_is_the_bottleneck() -> None:
    one = kv_route(gpus("a", "r0", 1), gpus("b", "r0", 1), shard(1), LINKS)
    four = kv_route(gpus("a", "r0", 4), gpus("b", "r0", 4), shard(4), LINKS)
    crowded = kv_route(gpus("a", "r0", 4, shared_nic=True), gpus("b", "r0", 4), shard(4), LINKS)
    big = 8192
    assert four.ms(big) < one.ms(big) / 3.5  # four NICs carry a quarter each
    assert crowded.ms(big) == pytest.approx(one.ms(big))  # all four shards through mlx5_0
    # a TP re-shard (TP 4 -> TP 2) moves the same bytes; the two receiving NICs decide
    reshard = kv_route(gpus("a", "r0", 4), gpus("b", "r0", 2), shard(2), LINKS)
    assert reshard.bytes_per_token == pytest.approx(kv_bytes_per_token(SPEC))
    assert reshard.ms(big) == pytest.approx(kv_route(gpus("a", "r0", 2), gpus("b", "r0", 2), shard(2), LINKS).ms(big))


def test_an_oversubscribed_spine_slows_only_what_crosses_it() -> None:
    tight = kv_links(H100, "ib-ndr", {"r0": 2, "r1": 2}, oversubscription=4)  # uplinks of half a NIC
    prefill = gpus("a", "r0", 4)
    cross = kv_route(prefill, gpus("c", "r1", 4), shard(4), tight)
    local = kv_route(prefill, gpus("b", "r0", 4), shard(4), tight)
    assert local.ms(4096) == pytest.approx(kv_route(prefill, gpus("b", "r0", 4), shard(4), LINKS).ms(4096))
    uplink = 2 * get_link("ib-ndr").p2p_bandwidth_gbps / 4
    assert cross.bandwidth_gbps[("uplink", "r0")] == pytest.approx(uplink)
    assert cross.ms(4096) > 7 * local.ms(4096)  # the whole prompt through one half-NIC uplink vs 4 NICs
    with pytest.raises(InputError, match="oversubscription"):
        kv_links(H100, "ib-ndr", {"r0": 8}, oversubscription=0.5)


def test_a_store_on_the_same_node_is_reached_over_pcie() -> None:
    store = [KvLane(node="a", rack="r0", nic=f"mlx5_{i}") for i in range(8)]
    whole = kv_bytes_per_token(SPEC)
    route = kv_route(gpus("a", "r0", 4), store, [whole / 8] * 8, LINKS)
    assert route.scope == "same-node"
    assert set(route.bandwidth_gbps.values()) == {get_link("pcie5").p2p_bandwidth_gbps}


def test_a_pd_plan_gives_the_lanes_and_needs_of_its_placements() -> None:
    cluster = load_preset("cluster-32x-hgx-h100")
    scheduler = Scheduler(cluster)
    base = PlacementRequest(id="plan", model="llama-3.1-70b", max_model_len=4096, input_len=1024, allowed_tp=(4,))
    out = place_pd(scheduler, base, Disaggregation(prefill=1, decode=1))
    prefill, decode = out.outcome.placements
    nodes = {n.name: n for n in cluster.nodes}
    src, dst = placement_lanes(prefill, nodes), placement_lanes(decode, nodes)
    assert [lane.nic for lane in src] == list(prefill.kv_nics) and len(dst) == 4
    need = rank_kv_needs(SPEC, decode)
    assert sum(need) == pytest.approx(kv_bytes_per_token(SPEC))
    links = cluster_kv_links(cluster, H100)
    assert links.net.name == "ib-ndr" and links.rack_uplink_gbps["rack0"] == pytest.approx(32 * 36.0)
    route = kv_route(src, dst, need, links)
    assert route.scope in ("same-node", "same-rack")  # the planner keeps a pair in one rack
