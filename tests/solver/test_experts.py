"""EP placement with hot-expert replicas (seed 000 section 5)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toposched.errors import InputError
from toposched.solver.experts import ExpertPlacement, place_experts


def zipf(num_experts: int, exponent: float, seed: int = 0) -> list[float]:
    """Zipf-like hit rates with the hot experts at shuffled (seeded) ids, as routers produce."""
    rates = [1.0 / (k + 1) ** exponent for k in range(num_experts)]
    random.Random(seed).shuffle(rates)
    return rates


def check_invariants(placement: ExpertPlacement, rates: list[float], budget: int, max_replicas: int) -> None:
    held = [e for rank in placement.experts_per_rank for e in rank]
    assert set(held) == set(range(placement.num_experts))  # every expert on at least one rank
    for rank in placement.experts_per_rank:
        assert len(rank) == len(set(rank))  # copies of one expert sit on distinct ranks
    assert [held.count(e) for e in range(placement.num_experts)] == list(placement.copies)
    assert placement.replicas <= budget
    assert max(placement.copies) <= max_replicas
    assert sum(placement.rank_load) == pytest.approx(sum(rates))
    for r, rank in enumerate(placement.experts_per_rank):
        assert placement.rank_load[r] == pytest.approx(sum(rates[e] / placement.copies[e] for e in rank))
    base = placement.num_experts // placement.ep
    assert sum(placement.extra_experts_per_rank) == placement.replicas
    assert all(len(rank) >= base for rank in placement.experts_per_rank)
    assert placement.imbalance_after <= placement.imbalance_balanced + 1e-9


def test_uniform_rates_need_no_replicas() -> None:
    placement = place_experts(128, 8, None, replica_budget=8)
    assert placement.imbalance_before == pytest.approx(1.0)
    assert placement.imbalance_after == pytest.approx(1.0)
    assert placement.replicas == 0
    assert placement.extra_experts_per_rank == (0,) * 8
    assert [len(rank) for rank in placement.experts_per_rank] == [16] * 8


def test_seed_example_hot_gpu_1_8x_falls_to_1_0x_with_top8_times_2() -> None:
    """Seed: top-8 x 2 copies take the hot GPU from ~1.8x to ~1.1x. Here (128 experts, EP=8, Zipf 0.6 at
    shuffled ids): contiguous layout 1.80x; LPT re-layout alone 1.08x; with copies 1.00x using 6 of the 8."""
    rates = zipf(128, 0.6)
    placement = place_experts(128, 8, rates, replica_budget=8, max_replicas=2)
    check_invariants(placement, rates, 8, 2)
    assert placement.imbalance_before == pytest.approx(1.80, abs=0.01)
    assert placement.imbalance_balanced == pytest.approx(1.084, abs=0.01)
    assert placement.imbalance_after <= 1.01
    assert placement.replicas == 6
    assert placement.max_experts_per_rank == 17  # one extra expert's weights on the ranks holding copies


def test_one_dominant_expert_needs_its_replica() -> None:
    """An expert with 30 % of all hits cannot be balanced by moving experts; copies are the only fix."""
    rates = [1.0] * 64
    rates[5] = 0.3 / 0.7 * 63
    without = place_experts(64, 8, rates, replica_budget=0)
    with_copies = place_experts(64, 8, rates, replica_budget=4, max_replicas=4)
    check_invariants(with_copies, rates, 4, 4)
    assert without.imbalance_after == pytest.approx((0.3 + 7 * 0.7 / 63) * 8)  # its rank: it + 7 cold experts
    # 4 copies of 7.5 % each, and every rank still holds 8 experts: the best any layout can do
    assert with_copies.copies[5] == 4
    assert with_copies.imbalance_after == pytest.approx((0.3 / 4 + 7 * 0.7 / 63) * 8)  # 1.22x
    assert with_copies.replicated_experts[0] == 5


@pytest.mark.parametrize("exponent", [0.8, 1.0, 1.2])
def test_skewed_rates_imbalance_drops_with_replicas(exponent: float) -> None:
    rates = zipf(128, exponent, seed=3)
    none = place_experts(128, 8, rates, replica_budget=0)
    some = place_experts(128, 8, rates, replica_budget=8)
    assert none.replicas == 0
    assert some.imbalance_after < none.imbalance_after < none.imbalance_before
    assert some.replicas >= 1


@settings(max_examples=60, deadline=None)
@given(
    ep=st.sampled_from([1, 2, 4, 8]),
    per_rank=st.integers(1, 8),
    exponent=st.floats(0.0, 2.0),
    seed=st.integers(0, 1000),
    budget=st.integers(0, 12),
    max_replicas=st.integers(1, 4),
)
def test_invariants_hold_for_any_rates(
    ep: int, per_rank: int, exponent: float, seed: int, budget: int, max_replicas: int
) -> None:
    num_experts = ep * per_rank
    rates = zipf(num_experts, exponent, seed)
    max_replicas = min(max_replicas, ep)
    placement = place_experts(num_experts, ep, rates, replica_budget=budget, max_replicas=max_replicas)
    check_invariants(placement, rates, budget, max_replicas)
    assert placement == place_experts(num_experts, ep, rates, replica_budget=budget, max_replicas=max_replicas)


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        ((60, 8, None), {}, "ep=8 does not divide num_experts=60"),
        ((64, 0, None), {}, "ep must be at least 1"),
        ((0, 1, None), {}, "num_experts must be at least 1"),
        ((8, 2, [1.0] * 7), {}, "hit_rates has 7 values; num_experts is 8"),
        ((4, 2, [1.0, -1.0, 1.0, 1.0]), {}, "hit_rates[1] = -1.0"),
        ((4, 2, [1.0, float("nan"), 1.0, 1.0]), {}, "hit_rates[1] = nan"),
        ((4, 2, [0.0] * 4), {}, "hit_rates are all zero"),
        ((8, 2, None), {"replica_budget": -1}, "replica_budget must be >= 0"),
        ((8, 2, None), {"max_replicas": 3}, "max_replicas must be within [1, ep=2]"),
    ],
)
def test_bad_input_names_the_argument(args: tuple[object, ...], kwargs: dict[str, int], fragment: str) -> None:
    options = {"replica_budget": 4} | kwargs
    with pytest.raises(InputError) as info:
        place_experts(*args, **options)  # type: ignore[arg-type]
    assert fragment in info.value.message
