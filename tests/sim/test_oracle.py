"""The ``oracle`` reference policy (free, instant repacking) and the mixed-generation churn scenario (issue 35)."""

from __future__ import annotations

import pytest

from toposched.errors import UnknownNameError
from toposched.sim.engine import Simulation
from toposched.sim.loading import load_cluster, load_scenario
from toposched.sim.oracle import ORACLE, Repacker, check_sim_policy, placement_policy
from toposched.sim.run import deployments_for, run_policy
from toposched.solver.request import Placement
from toposched.solver.scheduler import Scheduler

TINY = load_scenario("churn-tiny")


def _layout_is_consistent(sim: Simulation, newcomer: Placement | None = None) -> None:
    """Every live copy's GPUs (and the newcomer's, booked before its copy exists) are booked for it, in the
    ledger and the scheduler, and no GPU twice."""
    scheduler = sim.scheduler
    seen: set[str] = set(newcomer.gpu_refs) if newcomer is not None else set()
    for inst in sim.copies.values():
        refs = set(inst.placement.gpu_refs)
        assert not refs & seen, f"{inst.id} shares a GPU"
        seen |= refs
        assert scheduler.placements[inst.id].gpu_refs == inst.placement.gpu_refs
        assert not refs & scheduler.index.free
    booked = {ref: r.id for r in scheduler.ledger.reservations() for ref in r.gpus}
    assert set(booked) == seen
    assert newcomer is None or all(booked[ref] == newcomer.id for ref in newcomer.gpu_refs)
    assert all(booked[ref] == inst.id for inst in sim.copies.values() for ref in inst.placement.gpu_refs)


def test_oracle_repacks_keep_the_ledger_and_the_copies_in_step(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = {"repacks": 0, "failed": 0}
    original = Repacker.try_repack

    def checking(self: Repacker, request, key):  # type: ignore[no-untyped-def]
        placed = original(self, request, key)
        _layout_is_consistent(self.sim, placed)  # after a repack taken and after one rolled back
        checked["repacks" if placed is not None else "failed"] += 1
        return placed

    monkeypatch.setattr(Repacker, "try_repack", checking)
    result = run_policy(TINY, ORACLE, seed=1)  # raises InvariantError when conservation breaks
    m = result.metrics
    assert checked["repacks"] == m["repacks"] >= 1
    assert m["repacks_tried"] >= m["repacks"]  # tries that found no layout count too
    assert m["repack_moves"] >= 1 and m["migrations"] == 0
    assert m["requests"] == m["completed"] + m["timed_out"] + m["rejected"]
    # every repack it tried found room for everyone (1- and 4-GPU instances in 8-GPU domains): no instance
    # waited while enough GPUs were free in all. Its SLO met is not asserted against slo's: it is not a
    # proven bound (seed 1: 0.884 vs 0.884 with the attention tables' profile; docs/simulator.md)
    assert m["repacks_tried"] == m["repacks"] and m["instances_waited_for_nvlink"] == 0
    slo = run_policy(TINY, "slo", seed=1).metrics
    assert slo["repacks"] is None and slo["repacks_tried"] is None


def test_a_repack_that_cannot_place_everyone_books_the_old_layout_back() -> None:
    scenario = TINY.model_copy(update={"failures": ()})
    scheduler = Scheduler(load_cluster(scenario.cluster), seed=0)
    deployments = deployments_for(scenario, scheduler)
    sim = Simulation(scenario, scheduler, deployments, ORACLE, 0)
    big = next(d for d in deployments if d.ref_tp == 4)
    units = [sim.new_unit(big, 0.0, 100.0) for _ in range(4)]
    for unit in units:
        assert sim.admission.place_now(unit, 0.0, startup_s=0.0) is not None
    before = {c.id: c.placement.gpu_refs for c in sim.copies.values()}
    repacker = sim.admission.repacker
    assert repacker is not None
    request = big.template.model_copy(update={"id": "one-too-many"})
    assert repacker.try_repack(request, big.index) is None  # 16 GPUs, all held by four TP=4
    assert {c.id: c.placement.gpu_refs for c in sim.copies.values()} == before
    _layout_is_consistent(sim)
    generation = sim.layout_generation
    assert repacker.try_repack(request, big.index) is None and sim.layout_generation == generation
    assert repacker.tried == 1  # nothing changed since the failed try: not tried again


def test_oracle_is_a_simulator_policy_only() -> None:
    assert check_sim_policy("Oracle") == ORACLE and check_sim_policy("slo") == "slo"
    assert placement_policy(ORACLE) == "slo" and placement_policy("index-order") == "index-order"
    with pytest.raises(UnknownNameError, match="oracle"):
        check_sim_policy("oracel")


def test_mixed_cluster_references_the_slowest_kind_that_runs_the_degrees() -> None:
    """churn-mixed: a tenant's SLO is relative to the slowest GPU kind that runs its first option's degrees,
    so an instance on an L40S can meet it; relative to the GB200 none could, and index-order met 0.03."""
    scenario = load_scenario("churn-mixed")
    cluster = load_cluster(scenario.cluster)
    kinds = {n.gpus[0].model for n in cluster.nodes}
    assert len(kinds) == 3 and sum(len(n.gpus) for n in cluster.nodes) == 116
    scheduler = Scheduler(cluster, seed=0)
    small = deployments_for(scenario, scheduler)[0]  # Llama-3.1-8B at TP=1: fits every kind
    alone = load_scenario("churn-128").model_copy(update={"failures": ()})
    h100 = deployments_for(alone, Scheduler(load_cluster(alone.cluster), seed=0))[0]
    assert small.ref_tp == h100.ref_tp == 1
    assert small.ref_per_token_ms > 1.2 * h100.ref_per_token_ms  # the L40S, not the H100 or GB200
    assert small.capacity_rps < h100.capacity_rps


@pytest.mark.parametrize(
    ("name", "size", "sized"), [("churn-mixed", 8, 8), ("churn-128", 8, None), ("churn-tiny", 8, None)]
)
def test_headroom_is_kept_for_the_room_the_largest_instances_need(name: str, size: int, sized: int | None) -> None:
    """churn-mixed's TP=8 tenant needs an 8-GPU HGX domain or 8 GPUs of the 36-GPU GB200 one: headroom is kept
    for places of 8 (``Scheduler.headroom_size``); before, it was judged against the GB200 domain and never kept (TP=8
    13.6 points behind the oracle, median of ten seeds, docs/simulator.md). On one kind of node the domain
    itself (churn-128), and none where no tenant fills one (churn-tiny's largest is TP=4)."""
    scenario = load_scenario(name)
    scheduler = Scheduler(load_cluster(scenario.cluster), seed=0)
    deployments = deployments_for(scenario, scheduler)
    sim = Simulation(scenario, scheduler, deployments, "slo", 0)
    admission = sim.admission
    assert (admission.domain_size, admission.whole_size, scheduler.headroom_size) == (size, sized, sized)
    assert admission.whole_needed == (name != "churn-tiny")
    unit = sim.new_unit(deployments[0], 0.0, 100.0)
    assert admission._headroom(unit) == (scenario.admission.keep_whole_domains if name != "churn-tiny" else 0)
