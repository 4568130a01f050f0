"""The decision hot path's shortcuts give the answers of the long way round.

Each shortcut (``ClusterIndex`` moving one GPU without counting, ``pick_in_group`` inside one node,
``group_filter`` when nothing can filter, the options cache key, the shared ranks and checks) is
checked against what it stands for, including after the free GPUs change.
"""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from tests.solver.builders import make_request, make_scheduler
from toposched.solver.candidates import options_key
from toposched.solver.constraints import first_failure
from toposched.solver.index import LEVELS, ClusterIndex, LevelIndex
from toposched.solver.layout import layout_problem
from toposched.solver.locality import choose_on_node
from toposched.solver.picking import node_topology, pick_in_group
from toposched.solver.request import ConstraintCheck, PlacementRequest, Rank, ValueCache
from toposched.solver.stages import _R, _layout_problem
from toposched.topology.presets import hgx_h100_cluster, load_preset


def _state(index: ClusterIndex) -> object:
    """Everything best fit reads, bucket order included."""
    return {
        name: (
            list(lv.free_count),
            [list(b) for b in lv.buckets],
            [list(b) for b in lv.whole],
            lv.counts and lv.counts.tree,
        )
        for name, lv in index.levels.items()
    }


def _reference_shift(index: ClusterIndex, refs: list[str], delta: int) -> None:
    """``take``/``give`` the long way: on every level, count the GPUs per group touched, then move each
    group once (``LevelIndex.shift``'s general path)."""
    if delta < 0:
        index.free.difference_update(refs)
    else:
        index.free.update(refs)
    level: LevelIndex
    for level in index.levels.values():
        counts: dict[int, int] = {}
        for ref in refs:
            for g in level.of_gpu.get(ref, ()):
                counts[g] = counts.get(g, 0) + 1
        for g, n in counts.items():
            level._move(g, delta * n)


def _pick(rng: random.Random, pool: list[str], index: ClusterIndex) -> list[str]:
    """One GPU (most often), a few from anywhere, or a TP-like group of 2-8 from one node."""
    roll = rng.random()
    if roll < 0.5:
        return rng.sample(pool, 1)
    if roll < 0.7:
        return rng.sample(pool, min(len(pool), 3))
    node = index.info[rng.choice(pool)].node
    mine = [r for r in pool if index.info[r].node == node]
    return rng.sample(mine, min(len(mine), rng.choice([2, 4, 8])))


@pytest.mark.parametrize("preset", ["cluster-32x-hgx-h100", "dgx1-v100", "gb200-nvl72", "l40s-8x-pcie"])
def test_take_and_give_move_the_groups_as_counting_does(preset: str) -> None:
    # dgx1-v100: a GPU sits in two NVLink cliques (the general path); elsewhere in one group per level, and
    # GPUs of one node share their node's group (the shortcut) but not always their NUMA or PCIe group
    cluster = load_preset(preset)
    fast, slow = ClusterIndex(cluster), ClusterIndex(cluster)
    rng = random.Random(7)
    refs = sorted(fast.info)
    for _ in range(400):
        free = sorted(fast.free)
        taken = sorted(set(refs) - fast.free)
        if taken and (not free or rng.random() < 0.4):
            chosen = _pick(rng, taken, fast)
            fast.give(chosen)
            _reference_shift(slow, chosen, +1)
        else:
            chosen = _pick(rng, free, fast)
            fast.take(chosen)
            _reference_shift(slow, chosen, -1)
        assert fast.free == slow.free
        assert _state(fast) == _state(slow)
    fast.take([])  # nothing to move
    assert _state(fast) == _state(slow)


def test_pick_in_group_on_one_node_is_the_node_key() -> None:
    index = ClusterIndex(hgx_h100_cluster(nodes=2))
    node = "h100-00"
    topo = node_topology(index, node)
    rng = random.Random(3)
    for _ in range(100):
        free = sorted(rng.sample(range(8), rng.randint(1, 8)))
        size = rng.randint(1, len(free))
        picked = pick_in_group(index, [f"{node}/{i}" for i in free], size)
        assert picked == [f"{node}/{i}" for i in choose_on_node(topo, free, (), size).gpus]


def test_layout_problem_on_one_node_agrees_with_the_rule() -> None:
    index = ClusterIndex(hgx_h100_cluster(nodes=2))
    one_node = [["h100-00/3", "h100-00/1"], ["h100-00/0", "h100-00/7"]]
    refs = [r for stage in one_node for r in stage]
    ranks = [_R(n, index.info[r].node, index.info[r].index) for n, r in enumerate(refs)]
    assert _layout_problem(index, one_node, 2) is None is layout_problem(ranks, 2)
    # two nodes with unequal shares: still refused (the shortcut is for one node only)
    uneven = [["h100-00/0", "h100-00/1", "h100-00/2", "h100-01/0"]]
    assert _layout_problem(index, uneven, 4) is not None


def test_group_filter_without_filters_accepts_what_the_filters_accept() -> None:
    s = make_scheduler(nodes=4)
    request = make_request("llama-3.1-8b")
    nodes = frozenset(s.index.nodes)
    ctx = s.filter_context(request, nodes, set())
    accept = s.group_filter(request, nodes, set())
    for level in s.index.levels.values():
        for group in level.groups:
            assert accept(group) is all(first_failure(s.node_filters, ctx, s.index.nodes[n]).ok for n in group.nodes)
    # with a filter that can fail, the filters run: spreading refuses the nodes of earlier replicas
    spread = make_request("llama-3.1-8b", spread_replicas=True)
    held = {"h100-00"}
    refuse = s.group_filter(spread, nodes, held)
    assert [g.id for g in s.index.levels["node"].groups if not refuse(g)] == ["h100-00"]


def test_options_key_ignores_only_the_fields_that_do_not_change_options() -> None:
    base = PlacementRequest(model="llama-3.1-8b")
    same = PlacementRequest(model="llama-3.1-8b", id="other", replicas=3, priority=5, allow_cross_domain=True)
    assert options_key(base) == options_key(same)
    for change in (
        {"max_model_len": 4096},
        {"kv_dtype": "fp8"},
        {"slo_tpot_ms": 5.0},
        {"allowed_tp": (2,)},
        {"node_selector": {"a": "b"}},
        {"model": "llama-3.1-70b"},
    ):
        assert options_key(PlacementRequest(**{"model": "llama-3.1-8b", **change})) != options_key(base), change


def test_options_cache_answers_each_request_for_itself() -> None:
    s = make_scheduler(nodes=2)
    short = make_request("llama-3.1-70b", max_model_len=4096, concurrent_seqs=1)
    long = make_request("llama-3.1-70b", max_model_len=131072, concurrent_seqs=64)
    first = [(c.option.tp, c.option.pp) for c in s.candidates(short)[0]]
    second = [(c.option.tp, c.option.pp) for c in s.candidates(long)[0]]
    assert first != second
    assert [(c.option.tp, c.option.pp) for c in s.candidates(short)[0]] == first


def test_value_cache_shares_equal_values_and_never_keeps_a_failure() -> None:
    made: list[tuple[object, ...]] = []

    def make(name: str, held: bool, detail: str) -> ConstraintCheck:
        made.append((name, held, detail))
        return ConstraintCheck(name=name, held=held, detail=detail)  # type: ignore[arg-type]

    cache = ValueCache(make, limit=2)
    a = cache("slo", True, "x")
    assert cache("slo", True, "x") is a
    assert cache("slo", False, "x") == ConstraintCheck(name="slo", held=False, detail="x")
    assert len(made) == 2
    for _ in range(2):
        with pytest.raises(ValidationError):
            cache("no-such-check", True, "x")
    assert len(made) == 4  # tried again: a failure is not stored
    cache("capacity", True, "y")  # over the limit: starts over
    assert cache("slo", True, "x") is not a
    assert cache("slo", True, "x") == a


def test_placements_after_the_free_gpus_change_carry_their_own_ranks_and_checks() -> None:
    # ranks and checks are shared values: the second decision lands elsewhere, and must say so
    s = make_scheduler(nodes=2)
    first = s.place(make_request("llama-3.1-8b", id="a")).placements[0]
    second = s.place(make_request("llama-3.1-8b", id="b")).placements[0]
    assert first.gpu_refs != second.gpu_refs
    assert second.ranks == tuple(
        Rank(rank=r.rank, node=r.node, gpu=r.gpu, stage=r.stage, tp_rank=r.tp_rank) for r in second.ranks
    )
    assert s.release("a")
    again = s.place(make_request("llama-3.1-8b", id="c")).placements[0]
    assert again.gpu_refs == first.gpu_refs
    assert again.ranks == first.ranks and again.constraints == first.constraints
    # a tighter budget changes the cross-domain check's detail only where traffic crosses: none here
    assert again.check("cross-domain-budget").detail == "no traffic between NVLink domains"


def _reference_tightest(index: ClusterIndex, refs: list[str]) -> str:
    for level in LEVELS:
        of_gpu = index.levels[level].of_gpu
        common = set(of_gpu.get(refs[0], ()))
        for ref in refs[1:]:
            common &= set(of_gpu.get(ref, ()))
        if common:
            return level
    return "none"


@pytest.mark.parametrize("preset", ["cluster-32x-hgx-h100", "dgx1-v100", "gb200-nvl72", "l40s-8x-pcie"])
def test_tightest_level_and_domain_of_answer_as_the_set_computations(preset: str) -> None:
    # dgx1-v100: GPUs in two NVLink cliques (quads and cross pairs), so one GPU's group list has two entries
    index = ClusterIndex(load_preset(preset))
    rng = random.Random(11)
    refs = sorted(index.info)
    for _ in range(500):
        chosen = _pick(rng, refs, index)
        assert index.tightest_level(chosen) == _reference_tightest(index, chosen), chosen
        domains = {index.dmap.gpu_domain.get(r) for r in chosen}
        assert index.domain_of(chosen) == (domains.pop() if len(domains) == 1 else None), chosen
    assert index.domain_of([]) is None


def test_tightest_level_when_one_gpu_is_in_two_cliques_and_the_other_in_one() -> None:
    """A path of NVLinks 0-1-2: cliques {0,1} and {1,2}; GPU 0 is in one, GPU 1 in both. (0, 1) share a
    clique whichever GPU comes first."""
    from toposched.topology.model import GPU, Cluster, Link, LinkKind, Node

    links = tuple(
        Link(a=a, b=b, kind=LinkKind.NVLINK, nvlinks=4, bandwidth_gbps=100.0, latency_us=1.0)
        for a, b in ((0, 1), (1, 2))
    )
    node = Node(name="path", gpus=tuple(GPU(index=i, numa_node=0) for i in range(3)), links=links)
    index = ClusterIndex(Cluster(name="c", nodes=(node,)))
    assert len(index.levels["nvlink"].of_gpu["path/1"]) == 2
    for refs in (["path/0", "path/1"], ["path/1", "path/0"], ["path/1", "path/2"]):
        assert index.tightest_level(refs) == _reference_tightest(index, refs) == "nvlink", refs
    assert index.tightest_level(["path/0", "path/2"]) == _reference_tightest(index, ["path/0", "path/2"])
