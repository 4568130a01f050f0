"""Discrete-event cluster simulator driving the real scheduler, ledger and cost model on a fake clock.

Entities: ``SimRequest`` (one inference request), ``Unit`` (one logical model instance of a
deployment, with its lifetime and request stream) and ``SimInstance`` (one placed copy of a unit:
a booking in the ledger and a continuous-batching engine, ``sim/batching.py``; a unit has two copies
while a defragmentation move runs). Events (``sim/events.py``) are classes with ``apply(sim) ->
list[Event]``; the loop pops them from a heap keyed ``(time, priority, seq)``. Randomness comes from seeded
``random.Random`` objects: one for the instance arrivals, one per unit for its request stream, so
every policy sees the same instances and the same requests.

* Requests go to the deployment's live instance with the fewest unfinished requests
  (``sim/deployment.py``), or wait in the deployment's queue while none is up. Each instance steps
  its batch with the placement's step cost (``solver/stepcost.py``: the links it really uses).
* Instances are placed by the policy under test; one that cannot be placed waits, may fall back
  across domains, may trigger defragmentation, or is abandoned (``sim/admission.py``).
* A failed GPU takes its instances down at once: their requests start again elsewhere (counted as
  requeued) and the instance is placed again. ``nvlink-down`` rewrites the topology instead.
* Departure (end of lifetime, or the end of a churn run): the instance takes no new requests,
  hands back those it never started, finishes the others, then releases its GPUs.
* A disaggregated deployment (``PdSimulation``, ``Scenario.pd``): a request is prefilled on the
  least loaded prefill instance; its KV then moves to the least loaded decode instance paired with
  that prefill instance, over the links of ``perf/kv_transfer.py``. Every NIC (each direction), GPU
  link and rack uplink is a FIFO queue: each carries its share of a transfer (its bytes over its
  bandwidth) once the transfers queued before on it are through, the resources of one transfer
  working at once (cut-through), and the transfer ends when its last resource is done, plus the
  route's latency; so transfers sharing a NIC or an uplink queue behind each other. The first
  token counts when the KV reaches the decode instance (TTFT = queueing + prefill + KV transfer);
  the decode instance then generates the rest.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from toposched.perf.kv_transfer import KvLinks, KvRoute, Resource, kv_bytes_per_token, kv_route
from toposched.sim.admission import Admission, MoveRun
from toposched.sim.batching import Batcher
from toposched.sim.deployment import Deployment, PdLayout
from toposched.sim.events import (
    AdmissionTimer,
    Arrival,
    Departure,
    DrainDeadline,
    EndOfArrivals,
    Event,
    GpuFailure,
    InstanceArrival,
    InstanceUp,
    KvArrival,
    StepEnd,
    StreamArrival,
)
from toposched.sim.workload import SimRequest
from toposched.solver.pd import placement_lanes, rank_kv_needs, store_lanes
from toposched.solver.request import Placement, PlacementRequest, SloClass
from toposched.solver.scheduler import Scheduler
from toposched.solver.stepcost import step_cost
from toposched.topology.faults import without_nvlink
from toposched.workload.memory import MemoryConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from toposched.sim.scenario import Scenario


@dataclass(eq=False)
class Unit:
    """One logical instance of a deployment: arrives, is placed (perhaps again), serves, departs."""

    id: int
    deployment: Deployment
    lifetime_s: float
    arrival_s: float
    state: str = "new"  # pending | active | draining | done | abandoned | unplaced
    copy: SimInstance | None = None  # the copy that serves (or will, once up)
    copies: set[SimInstance] = field(default_factory=set)  # booked copies (two while a move runs)
    departs_at: float = math.inf
    up_since: float = -1.0
    attempts: int = 0
    waits: int = 0  # times it has waited for placement (stale timers check it)
    pending_since: float = 0.0
    cross_ok: bool = False
    headroom_waived: bool = False  # placed without ``keep_whole_domains`` (its wait for room is over)
    held_headroom: bool = False  # has waited because of the headroom
    waited_nvlink: bool = False
    placed: bool = False
    placed_s: float = -1.0  # first booked
    stream: random.Random | None = None
    stream_version: int = 0
    ready_s: float = 0.0
    """Churn: when the tenant's demand starts (arrival + start-up: when an instance placed at once
    would serve) and its lifetime starts counting; waiting for GPUs does not move it."""
    demand: bool = False  # the demand window (requests, departure) has been scheduled

    def next_id(self) -> str:
        self.attempts += 1
        return f"{self.deployment.tenant.name}.{self.id}-{self.attempts}"


@dataclass(eq=False)
class SimInstance:
    """One placed copy: its booking, its batching engine and where it is in its life."""

    placement: Placement
    request: PlacementRequest
    unit: Unit
    batcher: Batcher
    in_domain: bool
    state: str = "starting"  # starting | up | draining | gone
    version: int = 0
    move: MoveRun | None = None

    @property
    def id(self) -> str:
        return self.placement.id

    @property
    def gpus(self) -> int:
        return len(self.placement.ranks)


class Simulation:
    """One run of one policy over one workload."""

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
        self.gpus_held += inst.gpus
        self.hbm_held += inst.gpus * placement.hbm_per_gpu.total
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

    # --------------------------------------------------------------------- instances at the start

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

    def start_churn(self) -> list[Event]:
        """Pre-draw the churn instances (the same for every policy) and place those up at the start."""
        churn = self.scenario.churn
        assert churn is not None
        rng = random.Random(f"{self.seed}:instances")
        weights = [d.tenant.weight for d in self.deployments]
        mean_gpus = sum(d.ref_gpus * w for d, w in zip(self.deployments, weights, strict=True)) / sum(weights)
        startup = self.scenario.instance_startup_s
        rate = churn.occupancy * self.gpus_total / (mean_gpus * (churn.mean_lifetime_s + startup))

        def draw(arrival_s: float, startup_s: float) -> Unit:
            dep = rng.choices(self.deployments, weights)[0]
            unit = self.new_unit(dep, arrival_s, rng.expovariate(1.0 / churn.mean_lifetime_s))
            unit.ready_s = arrival_s + startup_s
            if self.scenario.trace is None:  # with a trace, the trace is the traffic
                unit.stream = random.Random(f"{self.seed}:stream:{unit.id}")
            return unit

        follow: list[Event] = []
        if churn.start_full:  # the steady state of an M/M/inf system: Poisson(rate x lifetime) up
            initial = _poisson(rng, rate * churn.mean_lifetime_s)
            for _ in range(initial):
                unit = draw(0.0, 0.0)
                self.units.append(unit)
                ev = self.admission.place_now(unit, 0.0, startup_s=0.0)
                follow.extend(ev if ev is not None else self.admission.submit(unit, 0.0))
                follow.extend(self.begin_demand(unit))
        t = rng.expovariate(rate)
        while t < churn.duration_s:
            self._instances.append(draw(t, startup))
            t += rng.expovariate(rate)
        follow.extend(self.next_instance())
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

    # --------------------------------------------------------------------- loop

    def push(self, event: Event) -> None:
        heapq.heappush(self._heap, (event.time, event.priority, next(self._seq), event))

    def sample(self, time: float) -> None:
        waiting = sum(len(d.queue) for d in self.deployments)
        running = 0
        for inst in self.copies.values():
            running += len(inst.batcher.running)
            waiting += len(inst.batcher.waiting)
        self.timeline.append((time, waiting, running))

    def run(self, arrivals: list[SimRequest], progress: Callable[[Simulation], None] | None = None) -> None:
        """The whole run: instances and traffic set up, events until none is left, then teardown."""
        self.start(arrivals)
        self.loop(progress)

    def start(self, arrivals: list[SimRequest]) -> None:
        """Place the instances present at the start and queue the first arrivals and the failures."""
        churn = self.scenario.churn
        self._arrivals = arrivals
        if churn is not None:
            self.end_s = churn.duration_s
            for ev in self.start_churn():
                self.push(ev)
            self.push(EndOfArrivals(churn.duration_s))
        else:
            self.end_s = math.inf
            count = self.scenario.instances
            for ev in self.place_fixed(None if count == "max" else int(count)):
                self.push(ev)
            self._full = False
        for ev in self.next_arrival():
            self.push(ev)
        for failure in self.scenario.failures:
            self.push(GpuFailure(failure.at_s, failure.gpu, failure.kind))
        span = churn.duration_s if churn is not None else max((r.arrival_s for r in arrivals), default=1.0) * 1.5
        self._sample_every = (span or 1.0) / 400

    def loop(self, progress: Callable[[Simulation], None] | None = None, *, until: float = math.inf) -> None:
        """Apply events in (time, priority, seq) order until none is left; then tear down. ``until``: stop
        before the first event at or after this time instead, without tearing down (a test steps a run)."""
        next_sample = 0.0
        heap = self._heap
        while heap and heap[0][0] < until:
            time, _, _, event = heapq.heappop(heap)
            self.now = time
            if next_sample <= time <= self.end_s:
                self.sample(time)
                next_sample = time + self._sample_every
            for follow in event.apply(self):
                self.push(follow)
            if self.retry:
                self.retry = False
                for follow in self.admission.retry(time):
                    self.push(follow)
            self.events_done += 1
            if progress is not None and self.events_done % 4096 == 0:
                progress(self)
        if not heap:
            self.teardown()

    def teardown(self) -> None:
        """End of run: every copy is released, the ledger emptied; what never ran is counted."""
        if self.scenario.churn is None:
            done = [r.finish_s for r in self.requests if r.state == "done"]
            self.end_s = max(done, default=self.now)
        self.admission.close()
        for inst in sorted(self.copies.values(), key=lambda c: c.id):
            self.release(inst)
        for unit in self.units:
            if unit.state in ("active", "draining"):
                unit.state = "done"
        for req in self.requests:
            if req.state in ("queued", "waiting"):
                req.state = "timed_out"  # waited for an instance (or in one) past the end: it was never served
            elif req.state == "new":
                req.state = "rejected"


class PdSimulation(Simulation):
    """One layout of a disaggregated deployment (``Scenario.pd``, module docstring): the layout's
    instances up from the start, requests prefilled, their KV moved, then decoded."""

    def __init__(
        self,
        scenario: Scenario,
        scheduler: Scheduler,
        deployments: list[Deployment],
        policy: str,
        seed: int,
        layout: PdLayout,
        links: KvLinks,
        *,
        jump: bool = True,
    ) -> None:
        super().__init__(scenario, scheduler, deployments, policy, seed, jump=jump)
        assert scenario.pd is not None  # a PdSimulation runs a pd scenario
        self.pd = scenario.pd
        self.layout = layout
        self.links = links
        self.pair_of = {d.id: pid for d, _, pid in layout.decodes}
        self.decodes: dict[str, list[SimInstance]] = {}  # prefill id -> its decode copies that are up
        self.all_decodes: list[SimInstance] = []
        self.inflight: Counter[str] = Counter()  # decode id -> KV transfers on their way to it
        self.link_free: dict[Resource, float] = {}  # when each link resource is next free (s)
        self._routes: dict[tuple[str, str], list[KvRoute]] = {}
        self.pd_info = {
            "layout": layout.name,
            "kv_via": self.pd.kv_via,
            "prefill": len(layout.prefills),
            "decode": len(layout.decodes),
            "oversubscription": self.pd.oversubscription,
        }

    def start(self, arrivals: list[SimRequest]) -> None:
        """Book the layout's instances as copies (up at once), then queue the first arrival."""
        self._arrivals = arrivals
        self.end_s = math.inf
        dep = self.deployments[0]
        booked = [(p, r, True) for p, r in self.layout.prefills] + [(p, r, False) for p, r, _ in self.layout.decodes]
        for placement, request, prefill in booked:
            unit = self.new_unit(dep, 0.0, math.inf)
            self.units.append(unit)
            inst = self.new_copy(unit, placement, request)
            inst.batcher.prefill_only = prefill
            unit.placed_s = 0.0
            unit.state = "active"
            unit.copy = inst
            for ev in self.instance_up(inst):
                self.push(ev)
        for ev in self.next_arrival():
            self.push(ev)
        self._sample_every = (max((r.arrival_s for r in arrivals), default=1.0) * 1.5 or 1.0) / 400

    def instance_up(self, inst: SimInstance) -> list[Event]:
        if inst.placement.role != "decode":
            return super().instance_up(inst)
        if inst.state != "starting":
            return []
        inst.state = "up"
        inst.unit.copy = inst
        inst.unit.up_since = self.now
        self.decodes.setdefault(self.pair_of[inst.id], []).append(inst)
        self.all_decodes.append(inst)
        return []

    def routes(self, prefill: SimInstance, decode: SimInstance) -> list[KvRoute]:
        """The hops of KV from ``prefill`` to ``decode``: direct, or into the decode's store and out."""
        key = (prefill.id, decode.id)
        cached = self._routes.get(key)
        if cached is not None:
            return cached
        nodes = {n.name: n for n in self.scheduler.cluster.nodes}
        src, dst = placement_lanes(prefill.placement, nodes), placement_lanes(decode.placement, nodes)
        need = rank_kv_needs(decode.batcher.cost.spec, decode.placement)
        if self.pd.kv_via == "direct":
            hops = [kv_route(src, dst, need, self.links)]
        else:
            store = store_lanes(self.layout.stores[decode.id])
            whole = kv_bytes_per_token(prefill.batcher.cost.spec, prefill.placement.kv_dtype)  # type: ignore[arg-type]
            hops = [
                kv_route(src, store, [whole / len(store)] * len(store), self.links),
                kv_route(store, dst, need, self.links),
            ]
        self._routes[key] = hops
        return hops

    def finished(self, inst: SimInstance, req: SimRequest) -> list[Event]:
        if not inst.batcher.prefill_only or req.generated >= req.output_len:
            if req.first_token_s < 0:  # one output token: the prefill instance served it all
                req.first_token_s = self.now
            req.state = "done"
            return []
        pool = self.decodes.get(inst.id) or self.all_decodes
        decode = min(pool, key=lambda d: (d.batcher.load + self.inflight[d.id], d.id))
        t = self.now
        waited = 0.0
        scopes = []
        for route in self.routes(inst, decode):
            end = t
            for resource, ms in route.busy_ms(req.input_len).items():
                free = max(t, self.link_free.get(resource, 0.0)) + ms / 1000.0
                self.link_free[resource] = free
                end = max(end, free)
            end += route.latency_us / 1e6
            waited += end - t - route.ms(req.input_len) / 1000.0
            t = end
            scopes.append(route.scope)
        req.kv_ms = 1000.0 * (t - self.now)
        req.kv_wait_ms = 1000.0 * waited
        req.kv_scope = max(scopes, key=("same-node", "same-rack", "cross-rack").index)
        req.state = "transferring"
        self.inflight[decode.id] += 1
        return [KvArrival(t, req, decode)]

    def kv_arrived(self, req: SimRequest, inst: SimInstance) -> list[Event]:
        self.inflight[inst.id] -= 1
        req.first_token_s = self.now
        return self.give(inst, req)


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's product of uniforms, in chunks so a large mean does not underflow)."""
    count = 0
    while mean > 0:
        step = min(mean, 30.0)
        mean -= step
        limit, product = math.exp(-step), rng.random()
        while product > limit:
            count += 1
            product *= rng.random()
    return count


__all__ = ["Event", "PdSimulation", "SimInstance", "SimRequest", "Simulation", "Unit"]
