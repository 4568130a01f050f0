"""Instance admission in the simulator: place, else wait; fall back across domains; defragment.

Driven the same way as the service's admission queue (issue 15):

* an arriving instance is placed by the policy under test; if it cannot be, it waits in a fair
  queue over SLO classes (``solver/queue.FairQueue``, FIFO within a class) and every waiting
  instance is tried again, in the queue's order, whenever GPUs are freed (a smaller one may go
  ahead of a larger one that still does not fit);
* a topology-aware policy (``slo``, ``latency``, ``exact``) that finds no room although enough GPUs
  are free in all counts the instance as *waiting for NVLink room*; after its class's
  ``SLO_CLASSES[c].cross_domain_after_s`` it is tried again with ``allow_cross_domain`` (the
  bounded fallback of ``solver/scheduler.py``; ``exact`` ignores the flag); blind policies
  (``index-order``, ``random``) place on any free GPUs and never wait for NVLink room;
* **headroom**: an instance smaller than an NVLink domain is placed with the scenario's
  ``keep_whole_domains`` (``PlacementRequest.keep_whole_domains``): it does not break one of the
  last wholly free domains, which the instances that need a whole domain (TP=8 on HGX) could
  otherwise only get by waiting for departures or by defragmentation. It waits instead (counted as
  *held for headroom*, not as waiting for NVLink room, when a whole domain was all that had room)
  until GPUs free up elsewhere or ``keep_whole_wait_s`` is over, then it may break one. No headroom
  is kept when no tenant of the scenario needs a whole domain (nothing would use it). Small
  instances belong to tenants with many instances that absorb a short wait; a large one's tenant
  has few, so its wait spills onto them (docs/simulator.md has the measurements);
* a waiting instance whose TP group needs a whole NVLink domain may trigger ``plan_defrag``
  (at most one plan in flight, rate-limited by ``DefragLimiter``). All moves of the plan start at
  once (their targets are free and disjoint): the replacement is booked (``start_move``), comes up
  after the start-up time and takes the unit's new requests, the old copy drains its requests, then
  ``finish_move`` releases it. The freed domain's GPUs are held back from other waiting instances
  until the last move finishes, then the instance that asked is placed first;
* an instance waiting longer than ``abandon_after_s`` is abandoned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from toposched.errors import LedgerConflict, StateError
from toposched.sim.oracle import ORACLE, Repacker, placement_policy
from toposched.solver.defrag import DefragLimiter, DefragPlan, Move, finish_move, plan_defrag, start_move
from toposched.solver.queue import FairQueue
from toposched.solver.request import SLO_CLASSES, Placement

if TYPE_CHECKING:
    from toposched.sim.events import Event
    from toposched.sim.state import SimState
    from toposched.sim.units import SimInstance, Unit

BLIND_POLICIES = frozenset({"index-order", "random"})
"""Policies that ignore topology: they never wait for NVLink room."""


@dataclass(eq=False)
class MoveRun:
    """One move in flight: the old copy serves until the replacement is up, then drains."""

    move: Move
    old: SimInstance
    new: SimInstance
    defrag: DefragRun
    done: bool = False


@dataclass(eq=False)
class DefragRun:
    """A plan being executed and the GPUs of the freed domain held back meanwhile."""

    plan: DefragPlan
    beneficiary: Unit
    active: set[MoveRun] = field(default_factory=set)
    held: set[str] = field(default_factory=set)
    failed: bool = False


class Admission:
    """The waiting instances of one run and the defragmentation in flight."""

    def __init__(self, sim: SimState) -> None:
        self.sim = sim
        self.cfg = sim.scenario.admission
        self.aware = sim.policy not in BLIND_POLICIES
        self.place_policy = placement_policy(sim.policy)
        self.repacker = Repacker(sim) if sim.policy == ORACLE else None  # free repacking (sim/oracle.py)
        self.queue = FairQueue()
        self.pending: dict[str, Unit] = {}
        self.limiter = DefragLimiter(self.cfg.defrag_moves_per_window, self.cfg.defrag_window_s)
        self.defrag: DefragRun | None = None
        level = sim.scheduler.index.levels["nvlink"]
        # the NVLink room the largest instances need: the smallest domain size that holds the largest TP
        # (on one kind of node, the domain; on a mixed cluster, an 8-GPU HGX domain for TP=8, not the
        # 36-GPU GB200 one, whose 8 free GPUs serve as well: there headroom counts such places)
        big = max((d.ref_tp for d in sim.deployments), default=1)
        self.domain_size = min((n for n in set(level.size) if n >= big), default=level.max_size)
        self.whole_size = None if self.domain_size == level.max_size else self.domain_size
        sim.scheduler.headroom_size = self.whole_size  # what keep_whole_domains keeps (stages.breaks_reserve)
        # headroom is kept for instances that need a whole NVLink domain: none of the scenario's tenants
        # does, none is kept (churn-tiny's TP=4 tenant waited 30 s per instance for a TP=8 that never came)
        # (and none under the oracle, which repacks to make room instead)
        self.whole_needed = self.repacker is None and any(d.ref_tp >= self.domain_size for d in sim.deployments)
        self.waited_nvlink = 0  # instances that waited for NVLink room (each counted once)
        self.held_headroom = 0  # instances that waited because of keep_whole_domains (each counted once)
        self.fallback_placements = 0
        self.abandoned = 0
        self.migrations = 0  # moves started
        self.plans = 0
        self.closed = False

    # ------------------------------------------------------------------ placing

    def _try(self, unit: Unit, now: float, startup_s: float | None = None) -> list[Event] | None:
        """One placement attempt; the new copy's InstanceUp event, or None (and why, in the counters)."""
        sim = self.sim
        dep = unit.deployment
        free = len(sim.scheduler.index.free)
        if free < dep.ref_gpus and dep.tenant.tp != "auto":
            return None  # not enough GPUs in all: no policy could place it
        update: dict[str, object] = {"id": unit.next_id()}
        if unit.cross_ok:
            update["allow_cross_domain"] = True
        headroom = self._headroom(unit)
        if headroom:
            update["keep_whole_domains"] = headroom
        request = dep.template.model_copy(update=update)
        out = sim.scheduler.place(request, self.place_policy)
        repacked = None
        if not out.placements and self.repacker is not None and free >= dep.ref_gpus:
            repacked = self.repacker.try_repack(request, dep.index)
        if not out.placements and repacked is None:
            if not self.aware or free < dep.ref_gpus:
                return None
            if headroom and self._only_whole_room(dep.ref_tp):
                if not unit.held_headroom:
                    unit.held_headroom = True
                    self.held_headroom += 1
            elif not unit.waited_nvlink:
                unit.waited_nvlink = True
                self.waited_nvlink += 1
            return None
        placement = out.placements[0] if repacked is None else repacked
        if "cross-domain" in placement.fallbacks:
            self.fallback_placements += 1
        inst = sim.new_copy(unit, placement, request)
        if unit.placed_s < 0:
            unit.placed_s = now
        unit.state = "active"
        unit.copy = inst
        wait = sim.scenario.instance_startup_s if startup_s is None else startup_s
        if wait <= 0:
            return sim.instance_up(inst)
        return [sim.up_event(inst, now + wait)]

    def _headroom(self, unit: Unit) -> int:
        """The ``keep_whole_domains`` a unit is placed with: the scenario's, for a topology-aware
        policy and an instance smaller than a domain, until its ``keep_whole_wait_s`` is over."""
        if not self.aware or not self.whole_needed or unit.headroom_waived:
            return 0
        if unit.deployment.ref_tp >= self.domain_size:
            return 0
        return self.cfg.keep_whole_domains

    def _only_whole_room(self, tp: int) -> bool:
        """Whether ``tp`` GPUs fit in no partly used NVLink domain, only in a wholly free one (so the
        headroom is what made the instance wait, not a lack of NVLink room); with places counted
        (``whole_size``) whether they fit in any domain: a domain with room refused only for the headroom."""
        level = self.sim.scheduler.index.levels["nvlink"]
        partly = any(level.buckets[c] for c in range(max(tp, 1), level.max_size + 1))
        whole = any(level.whole[c] for c in range(max(tp, 1), level.max_size + 1))
        if self.whole_size is not None:  # places are counted (Scheduler.headroom_size): any room refused was it
            return whole or partly
        return whole and not partly

    def place_now(
        self, unit: Unit, now: float, *, startup_s: float | None = None, headroom: bool = True
    ) -> list[Event] | None:
        """Place ``unit`` now or not at all (instances at the start of a run); its events, or None.

        ``headroom=False``: without ``keep_whole_domains`` (filling a cluster with fixed instances,
        where no instance arrives later to use the headroom)."""
        unit.headroom_waived = not headroom
        return self._try(unit, now, startup_s)

    def submit(self, unit: Unit, now: float) -> list[Event]:
        """``unit`` asks for GPUs: placed now, or it waits (timers for the fallback and for giving up)."""
        unit.cross_ok = False
        unit.headroom_waived = False
        placed = self._try(unit, now)
        if placed is not None:
            return placed
        unit.state = "pending"
        unit.waits += 1
        unit.pending_since = now
        key = str(unit.id)
        gpus = unit.deployment.ref_gpus
        occupancy = min(1.0, gpus / self.domain_size) if self.domain_size else 0.0
        slo_class = unit.deployment.tenant.slo_class
        self.queue.push(key, slo_class, float(gpus), occupancy, enqueued_at=now)
        self.pending[key] = unit
        follow = [self.sim.timer_event(now + self.cfg.abandon_after_s, unit, "abandon")]
        after = SLO_CLASSES[slo_class].cross_domain_after_s
        if self.aware and self.cfg.cross_domain and after is not None:
            follow.append(self.sim.timer_event(now + after, unit, "cross-domain"))
        if self.cfg.defrag_after_s > 0:
            follow.append(self.sim.timer_event(now + self.cfg.defrag_after_s, unit, "defrag"))
        if self._headroom(unit):
            follow.append(self.sim.timer_event(now + self.cfg.keep_whole_wait_s, unit, "headroom"))
        follow.extend(self._maybe_defrag(unit, now))
        return follow

    def withdraw(self, unit: Unit) -> None:
        key = str(unit.id)
        if self.pending.pop(key, None) is not None:
            self.queue.remove(key)

    def timer(self, unit: Unit, kind: str, waits: int, now: float) -> list[Event]:
        if unit.state != "pending" or unit.waits != waits:
            return []  # placed, withdrawn or waiting again since
        if kind == "abandon":
            if self.sim.idle():
                return []  # the run's work is done: it stays waiting (unplaced at the end), not abandoned
            self.withdraw(unit)
            unit.state = "abandoned"
            unit.stream_version += 1  # the tenant gives up: no more requests
            self.abandoned += 1
            return []
        if kind == "defrag":
            return self._maybe_defrag(unit, now)
        if kind == "headroom":
            unit.headroom_waived = True
        else:
            unit.cross_ok = True
        placed = self._try(unit, now)
        if placed is None:
            return self._maybe_defrag(unit, now)
        self.withdraw(unit)
        return placed

    def retry(self, now: float) -> list[Event]:
        """GPUs were freed: try every waiting instance once, in the fair queue's order."""
        follow: list[Event] = []
        if not self.pending:
            return follow
        for item in list(self.queue):
            unit = self.pending.get(item.item_id)
            if unit is None:
                continue
            placed = self._try(unit, now)
            if placed is None:
                follow.extend(self._maybe_defrag(unit, now))
                continue
            self.withdraw(unit)
            follow.extend(placed)
        return follow

    def close(self) -> None:
        """End of the run: nothing waits any more (counted as unplaced); held GPUs go back."""
        self.closed = True
        for unit in list(self.pending.values()):
            self.withdraw(unit)
            unit.state = "unplaced"
        if self.defrag is not None:
            self._give_back(self.defrag)

    # ------------------------------------------------------------------ defragmentation

    def _movable(self, placement: Placement) -> bool:
        inst = self.sim.copies.get(placement.id)
        return (
            inst is not None
            and inst.state == "up"
            and inst.move is None
            and inst.unit.state == "active"
            and inst.unit.copy is inst
        )

    def _maybe_defrag(self, unit: Unit, now: float) -> list[Event]:
        dep = unit.deployment
        if (
            not (self.aware and self.cfg.defrag)
            or self.repacker is not None  # the oracle repacks instead
            or self.closed
            or self.defrag is not None
            or not unit.waited_nvlink
            or now - unit.pending_since < self.cfg.defrag_after_s - 1e-9  # a departure may free room first
            or dep.ref_tp < self.domain_size  # only an instance needing a whole NVLink domain
            or len(self.sim.scheduler.index.free) < dep.ref_gpus
        ):
            return []
        scheduler = self.sim.scheduler
        plan = plan_defrag(
            scheduler, dep.ref_tp, level="nvlink", max_moves=self.cfg.defrag_max_moves, movable=self._movable
        )
        if plan is None or not plan.moves or not self.limiter.allow(now, len(plan.moves)):
            return []
        self.limiter.record(now, len(plan.moves))
        self.plans += 1
        run = DefragRun(plan, unit)
        self.defrag = run
        follow: list[Event] = []
        for move in plan.moves:
            old = self.sim.copies[move.placement_id]
            try:
                placement = start_move(scheduler, move)
            except (StateError, LedgerConflict):
                run.failed = True  # a stale plan: the domain will not be freed; the others still finish
                continue
            new = self.sim.new_copy(old.unit, placement, old.request)
            mr = MoveRun(move, old, new, run)
            old.move = new.move = mr
            run.active.add(mr)
            self.migrations += 1
            follow.append(self.sim.up_event(new, now + self.sim.scenario.instance_startup_s))
        self._hold(run)
        if not run.active:
            self._complete(run)
        return follow

    def _hold(self, run: DefragRun) -> None:
        """Take the freed domain's free GPUs out of the index until the moves finish."""
        if self.closed:
            return
        index = self.sim.scheduler.index
        refs = [r for r in run.plan.frees if r in index.free and r not in run.held]
        if refs:
            index.take(refs)
            run.held.update(refs)

    def _give_back(self, run: DefragRun) -> None:
        index = self.sim.scheduler.index
        failed = self.sim.scheduler.failed
        refs = [r for r in run.held if r not in failed and r not in index.free]
        if refs:
            index.give(refs)
        run.held.clear()
        if self.defrag is run:
            self.defrag = None

    def _finished(self, mr: MoveRun) -> None:
        mr.done = True
        mr.old.move = None
        mr.new.move = None
        run = mr.defrag
        run.active.discard(mr)
        self._hold(run)
        if not run.active:
            self._complete(run)

    def _complete(self, run: DefragRun) -> None:
        """The last move finished: the held GPUs go back, and the instance that asked goes first."""
        self._give_back(run)
        sim = self.sim
        unit = run.beneficiary
        if unit.state == "pending" and not run.failed:
            placed = self._try(unit, sim.now)
            if placed is not None:
                self.withdraw(unit)
                for event in placed:
                    sim.push(event)
        sim.retry = True

    def replacement_up(self, mr: MoveRun) -> None:
        """The new copy serves the unit's requests from now on; the old one drains."""
        new, old = mr.new, mr.old
        unit = new.unit
        unit.copy = new
        unit.deployment.router.add(new)
        if old.state == "up":
            for event in self.sim.drain(old, hand_back=True):
                self.sim.push(event)
        elif old.state == "gone":
            self._finished(mr)

    def old_drained(self, mr: MoveRun) -> None:
        """The old copy has no work left: release it (``finish_move`` when the replacement is booked)."""
        sim = self.sim
        if mr.new.state != "gone" and mr.new.id in sim.scheduler.placements:
            finish_move(sim.scheduler, mr.move)
            sim.release(mr.old, booked=False)
        else:
            sim.release(mr.old)
        self._finished(mr)

    def copy_gone(self, mr: MoveRun, inst: SimInstance) -> SimInstance | None:
        """A copy of a move stopped early (failure, departure, end of run); returns the unit's next
        serving copy when the old one went and the replacement lives on."""
        if mr.done:
            return None
        if inst is mr.old:
            if mr.new.state == "up":
                self._finished(mr)
                return None
            if mr.new.state == "starting":
                return mr.new  # it comes up and serves; nothing left to drain
            self._finished(mr)
            return None
        # the replacement went: the old copy keeps (or stops) serving; the domain is not freed. A draining
        # old copy finishes the move when it has drained (old_drained); otherwise the move ends here, also
        # when the old copy went first (it handed its slot to this replacement, which never came up)
        mr.defrag.failed = True
        if mr.old.state != "draining":
            mr.old.move = None
            mr.new.move = None
            mr.done = True
            run = mr.defrag
            run.active.discard(mr)
            if not run.active:
                self._complete(run)
        return None


__all__ = ["BLIND_POLICIES", "Admission", "DefragRun", "MoveRun"]
