"""The ``oracle`` reference policy of the simulator: ``slo`` with free, instant repacking.

A real scheduler cannot move a running instance without starting a copy, loading weights and
draining the old one (``sim/admission.py``'s defragmentation pays all of that). The oracle can: when
an instance finds no room although enough GPUs are free in all, it takes every running instance off
the cluster and places them all again together with the newcomer (``Scheduler.place_batch`` with
``thorough``: every order it knows, with and without keeping whole NVLink domains, the best kept),
each running instance pinned to its own TP and PP degrees. If every one of them finds
room, the new layout is taken at once: the running instances keep their queues, KV and in-flight
steps and carry on from their new GPUs at those GPUs' speed (zero migration cost; on a cluster of
several GPU kinds an instance may change kind, where its KV fits); otherwise the old layout is booked back
and the newcomer waits as under ``slo``. Headroom and defragmentation are off (repacking makes room
whenever any packing the batch placer finds has room).

It is a reference, not a proven bound: the batch placer is a heuristic (``benchmarks/solver_bench.py
gap``: none of 3,000 random batches left an instance unplaced that CP-SAT places; on churn-mixed the first
30 repacks it could not take, CP-SAT with 10 s each did not place either), a repack happens only when an
instance is waiting, not at every arrival (an arrival that fits needs none), and a repacked layout changes
what later arrivals find, so on some seeds the oracle ends below ``slo`` (docs/simulator.md). Its TP=8 SLO
attainment is what ``slo`` is judged against (issue 35).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toposched.errors import UnknownNameError
from toposched.solver.place import Assessment
from toposched.solver.policies import POLICIES
from toposched.solver.request import Placement, PlacementRequest
from toposched.solver.stepcost import step_cost

if TYPE_CHECKING:
    from toposched.sim.state import SimState
    from toposched.sim.units import SimInstance

ORACLE = "oracle"
"""The reference policy's name (the simulator's only; the scheduler places its instances with ``slo``)."""


def placement_policy(policy: str) -> str:
    """The scheduler policy a simulator policy places with."""
    return "slo" if policy == ORACLE else policy


def check_sim_policy(name: str) -> str:
    """``name`` if the simulator can run it (a placement policy or ``oracle``); else ``UnknownNameError``
    listing them all."""
    if name.strip().lower() == ORACLE:
        return ORACLE
    if name not in POLICIES:
        raise UnknownNameError("placement policy", name, [*POLICIES.all_names(), ORACLE])
    return POLICIES.canonical(name)


class Repacker:
    """Repacks a run's instances when one is waiting; counts what it did."""

    def __init__(self, sim: SimState) -> None:
        self.sim = sim
        self.repacks = 0  # layouts taken
        self.moved = 0  # instances whose GPUs changed in them
        self.tried = 0
        self._failed_at: dict[int, int] = {}  # deployment -> layout generation of its last failed try

    def _pinned(self, inst: SimInstance) -> PlacementRequest:
        p = inst.placement
        return inst.request.model_copy(
            update={"allowed_tp": (p.tp,), "max_pp": p.pp, "keep_whole_domains": 0, "replicas": 1}
        )

    def try_repack(self, request: PlacementRequest, deployment_key: int) -> Placement | None:
        """A placement for ``request`` after repacking every running instance, booked; None (and the
        old layout intact) when no repack finds room for all of them."""
        if self._failed_at.get(deployment_key) == self.sim.layout_generation:
            return None  # nothing has changed since this deployment's last failed try
        sim = self.sim
        scheduler = sim.scheduler
        running = [c for c in sim.copies.values() if c.state != "gone" and c.request.replicas == 1]
        if not running:
            return None
        self.tried += 1
        for c in running:
            scheduler.release(c.id)
        out = scheduler.place_batch([self._pinned(c) for c in running] + [request], "slo", thorough=True)
        placed = {p.id: p for p in out.placements}
        ok = not out.unplaced and all(
            c.id in placed
            and len(placed[c.id].ranks) == c.gpus
            and placed[c.id].pp == c.placement.pp
            and placed[c.id].kv_tokens_capacity >= c.batcher.kv_used  # its KV moves along
            for c in running
        )
        if not ok:
            for p in out.placements:
                scheduler.release(p.id)
            for c in running:  # the old layout, booked back as it was
                old = c.placement
                scheduler.commit(Assessment(old, old.check("slo").held, old.cross_domain_gbps))
            self._failed_at[deployment_key] = self.sim.layout_generation
            return None
        self.repacks += 1
        for c in running:
            new = placed[c.id]
            if new.gpu_refs != c.placement.gpu_refs:
                self.moved += 1
            self._move(c, new)
        sim.layout_generation += 1
        sim.record_gpus()
        return placed.get(request.id)

    def _move(self, inst: SimInstance, placement: Placement) -> None:
        """The copy carries on from ``placement``'s GPUs: same queues and KV, the new links' step cost."""
        sim = self.sim
        old = inst.placement
        sim.hbm_held += inst.gpus * (placement.hbm_per_gpu.total - old.hbm_per_gpu.total)
        inst.placement = placement
        inst.batcher.cost = step_cost(sim.scheduler, inst.request, placement)
        inst.batcher.kv_capacity = placement.kv_tokens_capacity
        affinity = all(c.held for c in placement.constraints if c.name == "domain-affinity")
        inst.in_domain = placement.tp == 1 or (affinity and placement.level == "nvlink")


__all__ = ["ORACLE", "Repacker", "check_sim_policy", "placement_policy"]
