"""Layouts the engines can launch, the default layout rule, multi-node NVLink TP, best-fit tie-break (issue 12)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.solver.builders import make_request, make_scheduler
from toposched.solver.index import Group, LevelIndex
from toposched.solver.layout import layout_problem
from toposched.solver.request import Placement


def _per_node(p: Placement) -> Counter[str]:
    return Counter(r.node for r in p.ranks)


@pytest.mark.parametrize(
    ("model", "extra", "layout"),
    [
        # 405B in FP8 on one HGX H100: TP8 (the old default was TP1 x PP7, one GPU idle, TPOT 158 ms)
        ("llama-3.1-405b", {"weight_dtype": "fp8"}, (8, 1)),
        ("llama-3.1-70b", {}, (4, 1)),  # was TP1 x PP3
        ("llama-3.1-8b", {}, (1, 1)),
    ],
)
def test_default_layout_without_slo_is_tp_inside_the_domain(
    model: str, extra: dict[str, str], layout: tuple[int, int]
) -> None:
    (p,) = make_scheduler("hgx-h100").place(make_request(model, **extra)).placements
    assert (p.tp, p.pp) == layout
    assert p.level == "nvlink"


def test_default_layout_puts_one_stage_per_domain_when_no_domain_holds_the_model() -> None:
    (p,) = make_scheduler(nodes=4).place(make_request("llama-3.1-405b")).placements
    assert (p.tp, p.pp) == (8, 2)
    assert sorted(_per_node(p).values()) == [8, 8]


@pytest.mark.parametrize("model", ["llama-3.1-405b", "deepseek-v3"])
@pytest.mark.parametrize("slo", [None, 60.0, 100.0, 200.0])
def test_multi_node_plans_are_launchable(model: str, slo: float | None) -> None:
    """cluster-32x-hgx-h100 used to give TP4 x PP3 on 8 + 4 GPUs, which launch refused."""
    s = make_scheduler("cluster-32x-hgx-h100")
    (p,) = s.place(make_request(model, slo_tpot_ms=slo)).placements
    assert layout_problem(p.ranks, p.tp) is None
    assert len(set(_per_node(p).values())) == 1
    for stage in range(p.pp):  # every TP group inside one node's NVLink domain
        assert len({r.node for r in p.ranks if r.stage == stage}) == 1


def test_stages_spread_evenly_when_no_node_holds_them_all() -> None:
    """Three free GPUs per node: TP2 x PP2 can't sit on one node, so one stage on each of two nodes."""
    busy = [f"h100-{n:02d}/{g}" for n in range(3) for g in range(8) if g >= 3]
    s = make_scheduler(nodes=3, busy=busy)
    (p,) = s.place(make_request("llama-3.1-70b", allowed_tp=(2,))).placements
    assert (p.tp, p.pp) == (2, 2), p
    assert layout_problem(p.ranks, p.tp) is None
    assert sorted(_per_node(p).values()) == [2, 2]


def test_uneven_room_never_gives_an_unlaunchable_layout() -> None:
    """Node 0 has 8 free, node 1 has 4: TP4 x PP3 must not take 8 + 4."""
    busy = [f"h100-01/{g}" for g in range(4)] + [f"h100-02/{g}" for g in range(8)] + [f"h100-03/{g}" for g in range(8)]
    s = make_scheduler(nodes=4, busy=busy)
    out = s.place(make_request("llama-3.1-405b", allowed_tp=(4,), slo_tpot_ms=200))
    for p in out.placements:
        assert layout_problem(p.ranks, p.tp) is None, p.ranks
    assert not out.placements  # 12 GPUs in equal whole stages would need 3 nodes with 4 free


def test_tp_spans_trays_of_a_multi_node_nvlink_domain() -> None:
    """GB200 NVL72: one NVLink domain over 18 trays of 4; TP8 used to fail with 'largest group (4 GPUs)'."""
    s = make_scheduler("gb200-nvl72")
    (p,) = s.place(make_request("llama-3.1-405b", allowed_tp=(8,))).placements
    assert p.tp == 8 and p.pp == 1
    assert p.level == "nvlink" and p.link == "mnnvl"
    assert layout_problem(p.ranks, p.tp) is None
    assert len(set(_per_node(p).values())) == 1
    assert all(c.held for c in p.constraints if c.name != "slo"), p.constraints


def test_best_fit_prefers_a_partly_used_group_over_a_whole_one() -> None:
    """Same free count: the partly used group of 8 goes before the wholly free group of 4."""
    whole = Group("whole", "nvlink", tuple(f"a/{i}" for i in range(4)), frozenset({"a"}), "a")
    partial = Group("partial", "nvlink", tuple(f"b/{i}" for i in range(8)), frozenset({"b"}), "b")
    free = set(whole.gpus) | {f"b/{i}" for i in range(4)}
    level = LevelIndex("nvlink", [whole, partial], free)
    assert list(level.best_fit(2)) == [1, 0]
    level.take("b/0")  # 3 free in the partial group: still before the whole one
    assert list(level.best_fit(2)) == [1, 0]
    for ref in ("b/1", "b/2"):
        level.take(ref)
    assert list(level.best_fit(2)) == [0]  # 1 free: too little room
    for ref in ("b/0", "b/1", "b/2", "b/4", "b/5", "b/6", "b/7"):
        level.give(ref)
    assert list(level.best_fit(2)) == [0, 1]  # both whole now: tightest first
