"""The launchable-layout rule (solver/layout.py): what vLLM and SGLang can start over several nodes."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from toposched.solver.layout import layout_problem, node_blocks, per_node_choices
from toposched.solver.request import Rank


def ranks(*blocks: tuple[str, int]) -> list[Rank]:
    """Ranks in order over ``(node, count)`` blocks, GPUs numbered from 0 on each visit of a node."""
    out: list[Rank] = []
    used: dict[str, int] = {}
    for node, count in blocks:
        for _ in range(count):
            gpu = used.get(node, 0)
            used[node] = gpu + 1
            out.append(Rank(rank=len(out), node=node, gpu=gpu, stage=0, tp_rank=len(out)))
    return out


def even(tp: int, pp: int, per_node: int) -> list[Rank]:
    return ranks(*[(f"n{i}", per_node) for i in range(tp * pp // per_node)])


def test_one_node_is_always_launchable() -> None:
    assert layout_problem(ranks(("a", 8)), tp=8) is None
    assert layout_problem(ranks(("a", 6)), tp=2) is None  # tp=2 x pp=3 on one box
    assert layout_problem([], tp=1) is None


def test_ranks_of_a_node_must_be_contiguous() -> None:
    problem = layout_problem(ranks(("a", 2), ("b", 2), ("a", 2), ("b", 2)), tp=8)
    assert problem is not None and "ranks on node a are not contiguous" in problem


def test_every_node_must_hold_the_same_number_of_gpus() -> None:
    problem = layout_problem(ranks(("h0", 8), ("h1", 4)), tp=4)  # TP4 x PP3 on 8 + 4: defect 6
    assert problem == "h0 has 8, h1 has 4 GPUs; multi-node engines need the same number of GPUs on every node"
    assert layout_problem(ranks(("t0", 4), ("t1", 1)), tp=1) is not None


def test_a_node_with_part_of_a_stage_and_part_of_another_is_refused() -> None:
    # tp=4 x pp=3 on two nodes of 6: node 0 has stage 0 and half of stage 1.
    problem = layout_problem(ranks(("h0", 6), ("h1", 6)), tp=4)
    assert problem is not None and "6 GPUs per node with tp=4" in problem
    assert layout_problem(ranks(("h0", 3), ("h1", 3)), tp=2) is not None  # 3 per node, tp=2


def test_whole_stages_per_node_are_launchable() -> None:
    assert layout_problem(ranks(("h0", 8), ("h1", 8)), tp=8) is None  # TP8 x PP2
    assert layout_problem(ranks(("h0", 8), ("h1", 8), ("h2", 8)), tp=4) is None  # two TP4 stages per node


def test_tp_spanning_nodes_in_equal_shares_is_launchable() -> None:
    # GB200 NVL72: TP8 over two trays of 4, TP16 over four, TP8 x PP2 over four trays.
    assert layout_problem(ranks(("t0", 4), ("t1", 4)), tp=8) is None
    assert layout_problem(ranks(("t5", 4), ("t2", 4), ("t9", 4), ("t7", 4)), tp=16) is None
    assert layout_problem(even(8, 2, 4), tp=8) is None
    assert layout_problem(ranks(("t0", 2), ("t1", 2), ("t2", 2), ("t3", 2)), tp=8) is None  # 2 per tray


def test_node_blocks_are_in_rank_order_with_gpus_in_rank_order() -> None:
    shuffled = [
        Rank(rank=2, node="b", gpu=3, stage=0, tp_rank=2),
        Rank(rank=0, node="a", gpu=1, stage=0, tp_rank=0),
        Rank(rank=3, node="b", gpu=0, stage=0, tp_rank=3),
        Rank(rank=1, node="a", gpu=0, stage=0, tp_rank=1),
    ]
    assert node_blocks(shuffled) == [("a", [1, 0]), ("b", [3, 0])]


def test_per_node_choices() -> None:
    assert per_node_choices(8, 2, [8, 8]) == [8, 4, 2, 1]
    assert per_node_choices(4, 3, [8]) == [4, 2, 1]  # 6 would split a stage; 12 does not fit
    assert per_node_choices(8, 1, [4] * 18) == [4, 2, 1]
    assert per_node_choices(2, 3, []) == []


def _layouts(tp: int, pp: int, choices: Sequence[int]) -> list[int]:
    return [g for g in range(1, tp * pp + 1) if (tp * pp) % g == 0 and g not in choices]


@given(tp=st.sampled_from([1, 2, 4, 8, 16]), pp=st.integers(1, 6), node_size=st.sampled_from([4, 8, 16]))
def test_per_node_choices_agree_with_layout_problem(tp: int, pp: int, node_size: int) -> None:
    choices = per_node_choices(tp, pp, [node_size])
    assert all(g <= node_size for g in choices) and choices == sorted(choices, reverse=True)
    for g in choices:  # every offered split, filled contiguously, launches
        assert layout_problem(even(tp, pp, g), tp) is None, (tp, pp, g)
    for g in _layouts(tp, pp, choices):  # every other equal split that fits the nodes is refused
        if g <= node_size and g < tp * pp:
            assert layout_problem(even(tp, pp, g), tp) is not None, (tp, pp, g)
