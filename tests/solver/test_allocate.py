"""GetPreferredAllocation on real ``nvidia-smi topo -m`` captures and on presets."""

from __future__ import annotations

import itertools
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import FIXTURES
from toposched.errors import InputError
from toposched.solver.allocate import AllocationResult, preferred_allocation
from toposched.topology.model import GPU, Link, LinkKind, Node
from toposched.topology.presets import load_preset
from toposched.topology.sources import SourceRef, load_source

TOPO = FIXTURES / "topo"
DGX1 = "07_dgx1-v100-1nic-driver440.txt"
H100 = "04_8x-h100-nv18-no-gpunumaid.txt"
RTX4090 = "21_8x-rtx4090-node-sys-with-prompt.txt"
ALL8 = tuple(range(8))


@cache
def smi_node(name: str) -> Node:
    return load_source(SourceRef(kind="smi", ref=str(TOPO / name))).cluster.nodes[0]


def allocate(name: str, size: int, available: tuple[int, ...] = ALL8, must: tuple[int, ...] = ()) -> AllocationResult:
    return preferred_allocation(smi_node(name), available, must, size)


def all_nvlink(node: Node, gpus: tuple[int, ...]) -> bool:
    return all(
        (link := node.link(a, b)) is not None and link.kind is LinkKind.NVLINK
        for a, b in itertools.combinations(gpus, 2)
    )


def make_nvswitch_node(gpus: int, per_numa: int) -> Node:
    """A big NVSwitch node (every pair NV18) with NUMA groups of ``per_numa`` GPUs."""
    return Node(
        name="big",
        nvswitch=True,
        gpus=tuple(GPU(index=i, numa_node=i // per_numa) for i in range(gpus)),
        links=tuple(
            Link(a=a, b=b, kind=LinkKind.NVLINK, nvlinks=18, bandwidth_gbps=450.0, latency_us=2.0)
            for a, b in itertools.combinations(range(gpus), 2)
        ),
    )


# ------------------------------------------------------------------------------------- DGX-1 mesh


def test_dgx1_size4_is_a_quad() -> None:
    result = allocate(DGX1, 4)
    assert result.gpus == (0, 1, 2, 3)
    assert result.score is not None and result.score.in_nvlink_clique
    assert result.method == "exhaustive"
    assert result.candidates == 70


def test_dgx1_size4_takes_the_other_quad_when_the_first_is_partly_used() -> None:
    assert allocate(DGX1, 4, available=(1, 2, 3, 4, 5, 6, 7)).gpus == (4, 5, 6, 7)


def test_dgx1_size2_prefers_a_double_nvlink_pair() -> None:
    result = allocate(DGX1, 2)
    link = smi_node(DGX1).link(*result.gpus)
    assert link is not None and link.nvlinks == 2


def test_dgx1_size2_leaves_another_nvlink_pair_free() -> None:
    available = (0, 1, 2, 3, 4)
    result = allocate(DGX1, 2, available=available)
    node = smi_node(DGX1)
    assert all_nvlink(node, result.gpus)
    rest = sorted(set(available) - set(result.gpus))
    assert any(all_nvlink(node, pair) for pair in itertools.combinations(rest, 2))
    # and it stays on one socket, leaving GPU 4's NUMA group alone
    assert result.gpus == (0, 3)
    assert result.score is not None and result.score.free_sets[0] == 1


def test_dgx1_size1_takes_the_lone_gpu_and_keeps_the_quad() -> None:
    assert allocate(DGX1, 1, available=(0, 1, 2, 3, 4)).gpus == (4,)


def test_dgx1_must_include_pulls_in_its_quad() -> None:
    assert allocate(DGX1, 4, must=(5,)).gpus == (4, 5, 6, 7)
    pair = allocate(DGX1, 2, must=(5,)).gpus
    assert 5 in pair and all_nvlink(smi_node(DGX1), pair)


def test_dgx1_size5_cannot_be_one_clique_but_maximises_lanes() -> None:
    result = allocate(DGX1, 5)
    assert result.score is not None and not result.score.in_nvlink_clique
    assert len(result.gpus) == 5 and result.score.nvlink_lanes >= 9 + 2


# ------------------------------------------------------------------------------- NVSwitch H100


@pytest.mark.parametrize("size", range(1, 9))
def test_nvswitch_takes_lowest_contiguous_numa_local_sets(size: int) -> None:
    result = allocate(H100, size)
    assert result.gpus == tuple(range(size))
    assert result.score is not None and result.score.in_nvlink_clique
    assert result.score.numa_span == (1 if size <= 4 else 2)


def test_nvswitch_second_request_takes_the_other_numa_node() -> None:
    assert allocate(H100, 4, available=(2, 3, 4, 5, 6, 7)).gpus == (4, 5, 6, 7)


def test_nvswitch_size2_best_fit_fills_the_partly_used_numa_node() -> None:
    # GPUs 0-2 on NUMA 0 and 4-7 on NUMA 1: take from the odd group, keep NUMA 1 whole
    result = allocate(H100, 2, available=(0, 1, 2, 4, 5, 6, 7))
    assert set(result.gpus) <= {0, 1, 2}


# ---------------------------------------------------------------------------------- PCIe box


def test_pcie_box_size4_is_one_numa_node() -> None:
    result = allocate(RTX4090, 4)
    assert result.gpus in ((0, 1, 2, 3), (4, 5, 6, 7))
    assert result.score is not None and result.score.worst_link == "NODE"


def test_pcie_box_avoids_sys_when_one_numa_node_still_fits() -> None:
    result = allocate(RTX4090, 3, available=(0, 1, 4, 5, 6))
    assert result.gpus == (4, 5, 6)


def test_pcie_box_must_include_on_the_other_socket() -> None:
    assert allocate(RTX4090, 4, must=(6,)).gpus == (4, 5, 6, 7)


def test_pcie_box_crosses_sockets_only_when_it_must() -> None:
    result = allocate(RTX4090, 4, available=(0, 1, 4, 5, 6))
    assert result.score is not None and result.score.worst_link == "SYS"
    assert set(result.gpus) >= {4, 5, 6}


# ---------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("available", "must", "size", "fragment"),
    [
        ((0, 1, 2), (3,), 2, "must-include GPU 3 not in the available set"),
        ((0, 1), (), 3, "size 3 is larger than the 2 available"),
        (ALL8, (0, 1, 2), 2, "must-include lists 3 GPUs, more than the size 2"),
        (ALL8, (), 0, "size must be at least 1"),
        ((), (), 1, "larger than the 0 available"),
    ],
)
def test_impossible_requests_are_refused_with_a_reason(
    available: tuple[int, ...], must: tuple[int, ...], size: int, fragment: str
) -> None:
    result = allocate(H100, size, available=available, must=must)
    assert result.gpus == ()
    assert not result.ok
    assert result.reason is not None and fragment in result.reason


def test_gpu_not_on_the_node_is_bad_input() -> None:
    with pytest.raises(InputError, match="available names GPU 8"):
        allocate(H100, 2, available=(0, 8))
    with pytest.raises(InputError, match="must-include names GPU 9"):
        allocate(H100, 2, must=(9,))
    with pytest.raises(InputError, match="more than once"):
        allocate(H100, 2, available=(0, 0, 1))


# ------------------------------------------------------------------------------ greedy (big nodes)


def test_big_node_uses_greedy_growth_and_stays_numa_local() -> None:
    node = make_nvswitch_node(72, per_numa=18)
    result = preferred_allocation(node, range(72), (), 8)
    assert result.method == "greedy"
    assert result.gpus == tuple(range(8))
    assert result.score is not None and result.score.numa_span == 1


def test_big_node_best_fit_keeps_whole_numa_groups_for_the_next_request() -> None:
    # NUMA groups of 18; GPUs 0-2 are taken, so group 0 has 15 free. Taking those 15 plus one more
    # leaves 17 + 18 + 18 free: three NUMA-local sets of 16 stay possible (two if group 1 is used).
    node = make_nvswitch_node(72, per_numa=18)
    result = preferred_allocation(node, range(3, 72), (), 16)
    assert result.method == "greedy"
    assert result.gpus == tuple(range(3, 19))
    assert result.score is not None and result.score.free_sets[2] == 3


def test_greedy_honours_must_include() -> None:
    node = make_nvswitch_node(32, per_numa=8)
    result = preferred_allocation(node, range(32), (20,), 8)
    assert result.method == "greedy"
    assert result.gpus == tuple(range(16, 24))


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_greedy_matches_exhaustive_on_dgx2(size: int) -> None:
    node = load_preset("dgx2").nodes[0]
    available = tuple(i for i in range(16) if i not in (1, 9))
    exact = preferred_allocation(node, available, (), size)
    greedy = preferred_allocation(node, available, (), size, exhaustive_limit=0)
    assert (exact.method, greedy.method) == ("exhaustive", "greedy")
    assert greedy.score == exact.score


def test_exhaustive_search_scores_one_set_per_mix_of_interchangeable_gpus() -> None:
    # DGX-2: every pair NV6, two NUMA groups of 8, so a set is known by how many it takes from each
    # group: 9 sets for size 8 instead of C(16, 8) = 12,870, and the same answer as all of them.
    node = load_preset("dgx2").nodes[0]
    result = preferred_allocation(node, range(16), (), 8)
    assert (result.method, result.candidates, result.gpus) == ("exhaustive", 9, tuple(range(8)))
    # the DGX-1 mesh has overlapping cliques, where the packing estimate is not symmetric: all 70 sets
    assert allocate(DGX1, 4).candidates == 70


# ------------------------------------------------------------------------------------ properties


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, tuple[int, ...], tuple[int, ...], int]:
    name = draw(st.sampled_from([DGX1, H100, RTX4090]))
    available = tuple(sorted(draw(st.sets(st.integers(0, 7), min_size=1))))
    size = draw(st.integers(1, len(available)))
    must = tuple(sorted(draw(st.sets(st.sampled_from(available), max_size=size))))
    return name, available, must, size


@settings(max_examples=150, deadline=None)
@given(requests(), st.randoms(use_true_random=False))
def test_answer_is_a_valid_deterministic_subset(
    request: tuple[str, tuple[int, ...], tuple[int, ...], int], rnd: object
) -> None:
    name, available, must, size = request
    result = allocate(name, size, available=available, must=must)
    assert result.ok
    assert set(result.gpus) <= set(available)
    assert set(result.gpus) >= set(must)
    assert len(result.gpus) == len(set(result.gpus)) == size
    shuffled = list(available)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert allocate(name, size, available=tuple(shuffled), must=must).gpus == result.gpus


@settings(max_examples=60, deadline=None)
@given(requests())
def test_a_clique_is_chosen_whenever_one_exists(request: tuple[str, tuple[int, ...], tuple[int, ...], int]) -> None:
    name, available, must, size = request
    node = smi_node(name)
    result = allocate(name, size, available=available, must=must)
    exists = any(
        all_nvlink(node, tuple(sorted(must + extra)))
        for extra in itertools.combinations(sorted(set(available) - set(must)), size - len(must))
    )
    assert all_nvlink(node, result.gpus) == exists
