"""The state of one simulation run and what the events change in it (``SimState``); the run itself,
instances at the start, the event loop and teardown, is ``Simulation`` (``sim/engine.py``).

* Requests go to the deployment's live instance with the fewest unfinished requests
  (``sim/deployment.py``), or wait in the deployment's queue while none is up. Each instance steps
  its batch with the placement's step cost (``solver/stepcost.py``: the links it really uses).
* Instances are placed by the policy under test; one that cannot be placed waits, may fall back
  across domains, may trigger defragmentation, or is abandoned (``sim/admission.py``).
* A failed GPU takes its instances down at once: their requests start again elsewhere (counted as
  requeued) and the instance is placed again. ``nvlink-down`` rewrites the topology instead.
* Departure (end of lifetime, or the end of a churn run): the instance takes no new requests,
  hands back those it never started, finishes the others, then releases its GPUs.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import TYPE_CHECKING, Any, cast

from toposched.sim.admission import Admission
from toposched.sim.batching import Batcher
from toposched.sim.deployment import Deployment
from toposched.sim.events import (
    AdmissionTimer,
    Arrival,
    Departure,
    DrainDeadline,
    Event,
    InstanceArrival,
    InstanceUp,
    StepEnd,
    StreamArrival,
)
from toposched.sim.units import SimInstance, Unit
from toposched.sim.workload import SimRequest
from toposched.solver.request import SLO_CLASSES, Placement, PlacementRequest, SloClass
from toposched.solver.scheduler import Scheduler
from toposched.solver.stepcost import step_cost
from toposched.topology.faults import without_nvlink
from toposched.workload.memory_config import MemoryConfig

if TYPE_CHECKING:
    from toposched.sim.scenario import Scenario


class SimState:
    """One run's units, copies and requests, and the changes the events make to them."""

    def __init__(
        self,
        scenario: Scenario,
        scheduler: Scheduler,
        deployments: list[Deployment],
        policy: str,
        seed: int,
        *,
        jump: bool = True,
    ) -> None:
        self.scenario = scenario
        self.scheduler = scheduler
        self.deployments = deployments
        self.policy = policy
        self.seed = seed
        self.jump = jump
        self.now = 0.0
        self.requests: list[SimRequest] = []
        self.request_cap = scenario.request_count
        self.capped = False
        self.units: list[Unit] = []
        self.copies: dict[str, SimInstance] = {}
        self.placed_history: list[Placement] = []
        self.compressible: set[str] = set()  # placements whose SLO class allows compression (issue 35)
        self.layout_generation = 0  # bumped by every booking, release and repack (``sim/oracle.py``)
        self.admission = Admission(self)
        self.closed = False
        self.retry = False  # GPUs were freed: waiting instances get another try after this event
        self.events_done = 0
        self.requeued_requests = 0
        self.drain_aborted = 0  # requests a copy had not finished when its drain grace ran out
        self.replacements = 0
        self.gpu_failures = 0
        self.gpus_total = len(scheduler.index.info)
        self.gpus_available = self.gpus_total - len(scheduler.failed)
        self.gpus_held = 0
        self.hbm_held = 0
        self.gpu_capacity = {ref: a.capacity_bytes for ref, a in scheduler.ledger.accounts().items()}
        self.hbm_available = sum(b for ref, b in self.gpu_capacity.items() if ref not in scheduler.failed)
        self.hbm_series: list[tuple[float, int]] = [(0.0, self.hbm_available)]
        """(time s, HBM bytes of the healthy GPUs), at every failure: ``hbm_utilization``'s denominator."""
        # (time s, GPUs held, cross-domain GB/s of the bookings, GPUs available, HBM bytes held), at every change
        self.gpu_series: list[tuple[float, int, float, int, int]] = [(0.0, 0, 0.0, self.gpus_available, 0)]
        self.timeline: list[tuple[float, int, int]] = []  # (time s, waiting requests, running), ~400 samples
        self.end_s = 0.0
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = itertools.count()
        self._arrivals: list[SimRequest] = []
        self._next_arrival = 0
        self._instances: list[Unit] = []
        self._next_instance = 0
        self._unit_ids = itertools.count()
        self._sample_every = 1.0
        self._full = False  # fixed instances: the last placement found no room (reset when GPUs free up)
        cfg = MemoryConfig()
        self._batched_tokens = cfg.max_num_batched_tokens
        self._checkpoint_tokens = cfg.checkpoint_batched_tokens
        self.pd_info: dict[str, Any] | None = None  # a disaggregated run's layout (``PdSimulation``)

    # --------------------------------------------------------------------- copies

    def new_copy(self, unit: Unit, placement: Placement, request: PlacementRequest) -> SimInstance:
        """A booked placement becomes a copy of ``unit`` (starting); its GPUs count as held."""
        tenant = unit.deployment.tenant
        # vLLM's max_num_batched_tokens: the serving default, or what the activation-checkpointing
        # fallback sized the activations for (binding/engine_args.py uses the same two values)
        tokens = self._checkpoint_tokens if "activation-checkpointing" in placement.fallbacks else self._batched_tokens
        batcher = Batcher(
            step_cost(self.scheduler, request, placement),
            max_seqs=tenant.batch,
            max_batched_tokens=tokens,
            kv_capacity=placement.kv_tokens_capacity,
            timeout_s=self.scenario.timeout_s,
            jump=self.jump,
        )
        affinity = all(c.held for c in placement.constraints if c.name == "domain-affinity")
        in_domain = placement.tp == 1 or (affinity and placement.level == "nvlink")
        inst = SimInstance(placement, request, unit, batcher, in_domain)
        self.copies[inst.id] = inst
        unit.copies.add(inst)
        unit.placed = True
        self.placed_history.append(placement)
        if SLO_CLASSES[request.slo_class].allow_compression:
            self.compressible.add(placement.id)
        self.gpus_held += inst.gpus
        self.hbm_held += inst.gpus * placement.hbm_per_gpu.total
        self.layout_generation += 1
        self.record_gpus()
        return inst

    def release(self, inst: SimInstance, *, booked: bool = True) -> None:
        """The copy is gone; its booking is released unless ``booked`` is False (released already)."""
        inst.state = "gone"
        inst.version += 1
        inst.unit.deployment.router.remove(inst)
        if booked:
            self.scheduler.release(inst.id)
        self.copies.pop(inst.id, None)
        inst.unit.copies.discard(inst)
        self.gpus_held -= inst.gpus
        self.hbm_held -= inst.gpus * inst.placement.hbm_per_gpu.total
        self.layout_generation += 1
        self.record_gpus()
        self.retry = True
        self._full = False
        unit = inst.unit
        if unit.state == "draining" and not unit.copies:
            unit.state = "done"

    def record_gpus(self) -> None:
        cross = sum(self.scheduler.cross_used.values())
        self.gpu_series.append((self.now, self.gpus_held, cross, self.gpus_available, self.hbm_held))

    def instance_up(self, inst: SimInstance) -> list[Event]:
        if inst.state != "starting":
            return []  # cancelled or failed before it came up
        inst.state = "up"
        unit = inst.unit
        dep = unit.deployment
        follow: list[Event] = []
        if inst.move is not None and inst.move.new is inst:
            self.admission.replacement_up(inst.move)
        else:
            unit.copy = inst
            dep.router.add(inst)
            if unit.up_since < 0:
                unit.up_since = self.now
            follow.extend(self.begin_demand(unit))
        follow.extend(self.serve_queue(dep))
        return follow

    def drain(self, inst: SimInstance, *, hand_back: bool) -> list[Event]:
        """No new requests for this copy; it finishes what it started, then releases its GPUs."""
        if inst.state == "starting":
            if inst.move is not None:
                self.admission.copy_gone(inst.move, inst)
            self.release(inst)
            return []
        if inst.state != "up":
            return []
        inst.state = "draining"
        dep = inst.unit.deployment
        dep.router.remove(inst)
        follow: list[Event] = []
        if hand_back:
            for req in inst.batcher.unstarted():
                follow.extend(self.route(req))
        if not inst.batcher.busy and not inst.batcher.load:
            self.drained(inst)
        elif self.scenario.drain_grace_s is not None and not self.closed:
            follow.append(DrainDeadline(self.now + self.scenario.drain_grace_s, inst))
        return follow

    def drain_deadline(self, inst: SimInstance) -> list[Event]:
        """The grace period of a draining copy is over (the engine's shutdown timeout): the requests it
        has not finished are aborted, as vLLM aborts them on SIGTERM, and count as timed out."""
        if inst.state != "draining":
            return []  # drained in time
        for req in inst.batcher.evict():
            self.timed_out(req)
            self.drain_aborted += 1
        self.drained(inst)
        return []

    def drained(self, inst: SimInstance) -> None:
        if inst.move is not None and inst.move.old is inst:
            self.admission.old_drained(inst.move)
        else:
            self.release(inst)

    def depart(self, unit: Unit, *, hand_back: bool) -> None:
        if unit.state == "pending":
            self.admission.withdraw(unit)
            unit.stream_version += 1
            if self.closed:
                unit.state = "unplaced"
            else:  # its demand window ended before it got GPUs
                unit.state = "abandoned"
                self.admission.abandoned += 1
            return
        if unit.state != "active":
            return
        unit.state = "draining"
        unit.stream_version += 1
        for inst in sorted(unit.copies, key=lambda c: c.id):
            for follow in self.drain(inst, hand_back=hand_back):
                self.push(follow)
        if not unit.copies:
            unit.state = "done"

    def fail(self, inst: SimInstance) -> list[Event]:
        """A GPU under this copy failed: it stops now, its requests start again elsewhere."""
        requests = inst.batcher.evict()
        self.release(inst)
        unit = inst.unit
        successor = None
        if inst.move is not None:
            successor = self.admission.copy_gone(inst.move, inst)
        follow: list[Event] = []
        if unit.copy is inst and unit.state == "active":
            if successor is not None:
                unit.copy = successor
            else:
                unit.copy = None  # its demand goes on: requests wait in the deployment's queue
                self.replacements += 1
                follow.extend(self.admission.submit(unit, self.now))
        for req in requests:
            req.computed = req.generated = 0
            req.requeued += 1
            self.requeued_requests += 1
            follow.extend(self.route(req))
        return follow

    # --------------------------------------------------------------------- requests

    def add_request(self, req: SimRequest) -> None:
        self.requests.append(req)
        for follow in self.route(req):
            self.push(follow)

    def route(self, req: SimRequest) -> list[Event]:
        dep = self.deployments[req.tenant]
        if req.input_len + req.output_len > dep.template.max_model_len:
            req.state = "rejected"  # longer than the context the instances reserve (vLLM refuses it)
            return []
        inst = dep.router.best()
        if inst is None:
            req.state = "queued"
            dep.queue.push(str(req.id), cast(SloClass, req.slo_class), 1.0, 0.0)
            return []
        full = inst.batcher.load >= inst.batcher.max_seqs
        follow = self.give(inst, req)
        fixed = self.scenario.churn is None and self.scenario.pd is None
        if full and self.scenario.autoscale and fixed and not self._full:
            follow.extend(self.place_fixed(1, dep))
        return follow

    def give(self, inst: SimInstance, req: SimRequest) -> list[Event]:
        req.instance = inst.id
        req.in_domain = inst.in_domain
        req.tp = inst.placement.tp
        req.state = "waiting"
        batcher = inst.batcher
        if batcher.busy:
            end = batcher.interrupt(self.now)
            batcher.waiting.append(req)
        else:
            batcher.waiting.append(req)
            end = batcher.compose(self.now, self.timed_out)
        inst.unit.deployment.router.update(inst)
        return [] if end is None else [self.step_event(inst, end)]

    def finished(self, inst: SimInstance, req: SimRequest) -> list[Event]:
        """``inst`` has finished with ``req`` (its last token, or a prefill instance's prompt)."""
        req.state = "done"
        return []

    def kv_arrived(self, req: SimRequest, inst: SimInstance) -> list[Event]:
        """A disaggregated request's KV reached decode instance ``inst`` (``PdSimulation``)."""
        raise NotImplementedError("only a disaggregated run moves KV")

    def serve_queue(self, dep: Deployment) -> list[Event]:
        """Requests that waited for a live instance go to one now (timed out ones drop)."""
        follow: list[Event] = []
        while len(dep.queue) and len(dep.router):
            item = dep.queue.pop()
            if item is None:
                break
            req = self.requests[int(item.item_id)]
            if not req.started and self.now - req.arrival_s > self.scenario.timeout_s:
                self.timed_out(req)
                continue
            inst = dep.router.best()
            assert inst is not None
            follow.extend(self.give(inst, req))
        return follow

    def idle(self) -> bool:
        """No more requests will come and none is unfinished (the end of a run with lasting instances)."""
        if self.scenario.churn is not None:
            return self.closed
        if self._next_arrival < len(self._arrivals):
            return False
        return all(r.state in ("done", "timed_out", "rejected") for r in self.requests)

    def timed_out(self, req: SimRequest) -> None:
        req.state = "timed_out"

    def up_event(self, inst: SimInstance, at: float) -> Event:
        return InstanceUp(at, inst)

    def timer_event(self, at: float, unit: Unit, kind: str) -> Event:
        return AdmissionTimer(at, unit, kind, unit.waits)

    def step_event(self, inst: SimInstance, end: float) -> StepEnd:
        inst.version += 1
        return StepEnd(end, inst, inst.version)

    def next_arrival(self) -> list[Event]:
        if self._next_arrival >= len(self._arrivals):
            return []
        req = self._arrivals[self._next_arrival]
        self._next_arrival += 1
        return [Arrival(req.arrival_s, req)]

    def begin_demand(self, unit: Unit) -> list[Event]:
        """Schedule a unit's demand window once: its requests from ``ready_s`` on and its departure
        ``lifetime_s`` later, whether or not it has GPUs by then.

        The demand belongs to the tenant, not to the placement: a unit the scheduler makes wait
        (for NVLink room, a defragmentation, a failed GPU's replacement) has requests queueing in
        its deployment from ``ready_s`` (served by the tenant's other instances if any, else timed
        out after ``timeout_s``), and holds its GPUs for what is left of its lifetime. So waiting
        costs SLO attainment and utilisation, as it would cost a real tenant; the start-up time that
        every policy pays is not counted against any.
        """
        if unit.demand:
            return []
        unit.demand = True
        follow: list[Event] = []
        if math.isfinite(unit.lifetime_s):
            unit.departs_at = max(self.now, unit.ready_s + unit.lifetime_s)
            follow.append(Departure(unit.departs_at, unit))
        if unit.stream is not None:
            follow.extend(self.next_stream(unit, after=max(self.now, unit.ready_s)))
        return follow

    def next_stream(self, unit: Unit, after: float | None = None) -> list[Event]:
        dep = unit.deployment
        assert unit.stream is not None
        churn = self.scenario.churn
        load = dep.tenant.load if dep.tenant.load is not None else (churn.load if churn is not None else 1.0)
        t = (self.now if after is None else after) + unit.stream.expovariate(load * dep.capacity_rps)
        return [StreamArrival(t, unit, unit.stream_version)] if t < self.end_s else []

    def next_instance(self) -> list[Event]:
        if self._next_instance >= len(self._instances):
            return []
        unit = self._instances[self._next_instance]
        self._next_instance += 1
        return [InstanceArrival(unit.arrival_s, unit)]

    # --------------------------------------------------------------------- lasting instances

    def new_unit(self, dep: Deployment, arrival_s: float, lifetime_s: float) -> Unit:
        unit = Unit(id=next(self._unit_ids), deployment=dep, lifetime_s=lifetime_s, arrival_s=arrival_s)
        dep.units += 1
        return unit

    def place_fixed(self, count: int | None, only: Deployment | None = None) -> list[Event]:
        """Place up to ``count`` lasting instances now (None: as many as fit); their InstanceUp events.

        With several tenants, instances go to the tenant furthest below its weight's share.
        """
        follow: list[Event] = []
        deps = [only] if only is not None else list(self.deployments)
        placed = 0
        while deps and (count is None or placed < count):
            total = sum(d.tenant.weight for d in deps)
            dep = min(deps, key=lambda d: (d.units / (d.tenant.weight / total), d.index))
            unit = self.new_unit(dep, self.now, math.inf)
            ev = self.admission.place_now(unit, self.now, headroom=False)
            if ev is None:
                dep.units -= 1
                deps.remove(dep)
                self._full = True
                continue
            self.units.append(unit)
            follow.extend(ev)
            placed += 1
        return follow

    # --------------------------------------------------------------------- topology changes

    def nvlink_down(self, ref: str) -> list[str]:
        """A GPU loses its NVLinks: it leaves its NVLink domain (the DomainMap changes) but can still
        serve alone. Its peers now reach it over PCIe (NODE within its NUMA node, SYS across).
        Returns the instances whose TP group used NVLink to it (they stop and are placed again)."""
        self.scheduler.update_topology(without_nvlink(self.scheduler.cluster, ref))
        return [
            pid
            for pid, p in self.scheduler.placements.items()
            if p.tp > 1
            and any(ref in [f"{r.node}/{r.gpu}" for r in p.ranks if r.stage == stage] for stage in range(p.pp))
        ]

    # --------------------------------------------------------------------- events

    def push(self, event: Event) -> None:
        heapq.heappush(self._heap, (event.time, event.priority, next(self._seq), event))
