"""``pick_in_group``: one locality key shared with ``toposched allocate``, equal shares across nodes."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toposched.solver.allocate import preferred_allocation
from toposched.solver.index import ClusterIndex
from toposched.solver.layout import layout_problem
from toposched.solver.locality import score_set, set_key
from toposched.solver.picking import node_topology, pick_in_group
from toposched.topology.presets import hgx_h100_cluster, load_preset

SINGLE_NODE = ("hgx-h100", "l40s-8x-pcie", "dgx1-v100")


@dataclass(frozen=True)
class _Rank:
    rank: int
    node: str
    gpu: int


@cache
def preset_index(preset: str) -> ClusterIndex:
    """A fresh index with every GPU free (callers pass their own candidates, so it is never mutated)."""
    return ClusterIndex(load_preset(preset))


def refs(node: str, indices: tuple[int, ...] | list[int]) -> list[str]:
    return [f"{node}/{i}" for i in indices]


def indices(picked: list[str]) -> list[int]:
    return [int(r.rsplit("/", 1)[1]) for r in picked]


def per_node(picked: list[str]) -> Counter[str]:
    return Counter(r.rsplit("/", 1)[0] for r in picked)


def launchable(picked: list[str], tp: int) -> str | None:
    """``layout_problem`` of the picked GPUs as ranks 0..tp-1 in the returned order."""
    ranks = []
    for k, ref in enumerate(picked):
        node, gpu = ref.rsplit("/", 1)
        ranks.append(_Rank(k, node, int(gpu)))
    return layout_problem(ranks, tp)


def brute_force_best(preset: str, free: tuple[int, ...], size: int) -> tuple[object, ...]:
    """The smallest shared key over every ``size``-subset of ``free``."""
    index = preset_index(preset)
    node = index.cluster.nodes[0].name
    topo = node_topology(index, node)
    available = frozenset(free)
    return min(set_key(score_set(topo, s, available), s) for s in itertools.combinations(sorted(free), size))


# ---------------------------------------------------------------------------------- single node


def test_l40s_takes_two_whole_pcie_switches_not_a_window_over_three() -> None:
    # GPUs 0 and 5 busy: the old sorted-window pick was 1,2,3,4 (switches pcie0, pcie1, pcie2)
    index = preset_index("l40s-8x-pcie")
    free = (1, 2, 3, 4, 6, 7)
    picked = pick_in_group(index, refs("l40s", free), 4)
    assert picked == refs("l40s", [2, 3, 6, 7])
    assert len({index.info[r].pcie for r in picked}) == 2


@st.composite
def single_node_cases(draw: st.DrawFn) -> tuple[str, tuple[int, ...], int]:
    preset = draw(st.sampled_from(SINGLE_NODE))
    free = tuple(sorted(draw(st.sets(st.integers(0, 7), min_size=1))))
    size = draw(st.integers(1, len(free)))
    return preset, free, size


@settings(max_examples=200, deadline=None)
@given(single_node_cases(), st.randoms(use_true_random=False))
def test_pick_is_the_allocate_answer_and_the_minimum_of_the_shared_key(
    case: tuple[str, tuple[int, ...], int], rnd: object
) -> None:
    # Same set, not just an equal key: both call choose_on_node with the same available GPUs and the
    # key ends in the indices, so there are no ties left for them to break differently.
    preset, free, size = case
    index = preset_index(preset)
    node = index.cluster.nodes[0]
    candidates = refs(node.name, free)
    rnd.shuffle(candidates)  # type: ignore[attr-defined]
    picked = pick_in_group(index, candidates, size)
    assert picked is not None
    assert indices(picked) == sorted(indices(picked))  # rank order: index order on one node
    allocated = preferred_allocation(node, free, (), size)
    assert tuple(indices(picked)) == allocated.gpus
    assert allocated.score is not None
    chosen = tuple(indices(picked))
    topo = node_topology(index, node.name)
    assert set_key(score_set(topo, chosen, frozenset(free)), chosen) == brute_force_best(preset, free, size)


def test_pcie_box_pick_spans_the_fewest_numa_nodes_then_pcie_switches() -> None:
    # On a PCIe box the link-quality term of the key is the locality: check every free set and size.
    index = preset_index("l40s-8x-pcie")
    topo = node_topology(index, "l40s")

    def span(gpus: tuple[int, ...] | list[int]) -> tuple[int, int]:
        return len({topo.numa_of[i] for i in gpus}), len({topo.pcie_of[i] for i in gpus})

    for count in range(1, 9):
        for free in itertools.combinations(range(8), count):
            for size in range(1, count + 1):
                picked = pick_in_group(index, refs("l40s", free), size)
                assert picked is not None
                assert span(indices(picked)) == min(span(s) for s in itertools.combinations(free, size)), (free, size)


@pytest.mark.parametrize("size", [2, 4, 6, 8])
def test_dgx2_exhaustive_search_is_the_minimum_over_every_combination(size: int) -> None:
    # The exact search skips sets that differ only by interchangeable GPUs; check it against all of them.
    free = tuple(i for i in range(16) if i not in (1, 9, 10))
    index = preset_index("dgx2")
    picked = pick_in_group(index, refs("dgx2", free), size)
    assert picked is not None
    chosen = tuple(indices(picked))
    topo = node_topology(index, "dgx2")
    assert set_key(score_set(topo, chosen, frozenset(free)), chosen) == brute_force_best("dgx2", free, size)
    result = preferred_allocation(index.cluster.nodes[0], free, (), size)
    assert result.method == "exhaustive" and result.gpus == chosen


def test_too_few_candidates_is_none() -> None:
    assert pick_in_group(preset_index("hgx-h100"), refs("hgx-h100", [0, 1]), 3) is None


# ----------------------------------------------------------------------------------- multi node


def nvl72_free(busy: Collection[str] = ()) -> list[str]:
    """The free GPUs of the rack's one NVLink group, in cluster order."""
    index = preset_index("gb200-nvl72")
    return [r for r in index.levels["nvlink"].groups[0].gpus if r not in busy]


def tray(t: int, *gpus: int) -> list[str]:
    return refs(f"nvl72-tray{t:02d}", gpus)


def test_nvl72_tp8_takes_two_whole_trays() -> None:
    picked = pick_in_group(preset_index("gb200-nvl72"), nvl72_free(), 8)
    assert picked == tray(0, 0, 1, 2, 3) + tray(1, 0, 1, 2, 3)
    assert launchable(picked, 8) is None


def test_nvl72_tp16_takes_four_whole_trays() -> None:
    picked = pick_in_group(preset_index("gb200-nvl72"), nvl72_free(), 16)
    assert picked is not None
    assert per_node(picked) == {f"nvl72-tray{t:02d}": 4 for t in range(4)}
    assert launchable(picked, 16) is None


def test_nvl72_skips_trays_without_a_whole_share() -> None:
    busy = {*tray(0, 0), *tray(1, 3)}
    picked = pick_in_group(preset_index("gb200-nvl72"), nvl72_free(busy), 8)
    assert picked == tray(2, 0, 1, 2, 3) + tray(3, 0, 1, 2, 3)


def test_nvl72_smaller_shares_when_no_tray_is_whole() -> None:
    # Every tray has 3 free: 4 per tray is impossible, so 2 per tray on 4 trays
    busy = {r for t in range(18) for r in tray(t, 0)}
    picked = pick_in_group(preset_index("gb200-nvl72"), nvl72_free(busy), 8)
    assert picked is not None
    assert per_node(picked) == {f"nvl72-tray{t:02d}": 2 for t in range(4)}
    assert launchable(picked, 8) is None


def test_nvl72_best_fit_tray_and_cluster_order_in_the_result() -> None:
    # Free: tray 1 has 4, tray 3 has 3, the rest 2. tp 6 -> 3 per tray on trays 1 and 3, tray 1 first.
    busy = {r for t in range(18) if t not in (1, 3) for r in tray(t, 0, 1)} | set(tray(3, 0))
    index = preset_index("gb200-nvl72")
    picked = pick_in_group(index, nvl72_free(busy), 6)
    assert picked is not None
    assert list(per_node(picked)) == ["nvl72-tray01", "nvl72-tray03"]
    assert per_node(picked) == {"nvl72-tray01": 3, "nvl72-tray03": 3}
    # tp 2 fits in one tray: the tightest (2 free) wins over the trays with more room
    assert pick_in_group(index, nvl72_free(busy), 2) == tray(0, 2, 3)


def test_nvl72_no_equal_split_is_none() -> None:
    # 3 GPUs on tray 0 and 1 on tray 1: tp 4 needs 4+0, 2+2 or 1+1+1+1
    assert pick_in_group(preset_index("gb200-nvl72"), tray(0, 0, 1, 2) + tray(1, 0), 4) is None


@settings(max_examples=120, deadline=None)
@given(st.sets(st.sampled_from(nvl72_free()), max_size=60), st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
def test_nvl72_pick_is_equal_shares_on_the_fewest_trays_or_none(busy: set[str], tp: int) -> None:
    free = nvl72_free(busy)
    counts = Counter(r.rsplit("/", 1)[0] for r in free)
    feasible = [g for g in range(min(tp, 4), 0, -1) if tp % g == 0 and sum(c >= g for c in counts.values()) >= tp // g]
    picked = pick_in_group(preset_index("gb200-nvl72"), free, tp)
    if not feasible:
        assert picked is None
        return
    assert picked is not None
    assert len(set(picked)) == tp and set(picked) <= set(free)
    shares = per_node(picked)
    assert set(shares.values()) == {feasible[0]}  # the most per tray, so the fewest trays
    assert launchable(picked, tp) is None
    assert picked == sorted(picked, key=lambda r: preset_index("gb200-nvl72").info[r].order)


def test_level_none_across_hgx_nodes_uses_whole_nodes_by_best_fit() -> None:
    index = ClusterIndex(hgx_h100_cluster(nodes=4))
    busy = {"h100-00/0", "h100-02/5", "h100-02/6"}
    free = [r for r in index.info if r not in busy]
    picked = pick_in_group(index, free, 16)
    assert picked is not None
    assert per_node(picked) == {"h100-01": 8, "h100-03": 8}
    assert launchable(picked, 16) is None
    # tp 4 fits on one node: the one with the fewest free GPUs (h100-02, 6 free)
    small = pick_in_group(index, free, 4)
    assert small == refs("h100-02", [0, 1, 2, 3])
