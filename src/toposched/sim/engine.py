"""Discrete-event cluster simulator driving the real scheduler, ledger and cost model on a fake clock.

Entities: ``SimRequest`` (one inference request), ``SimInstance`` (one placed model instance with
``batch`` slots). Events are classes with ``apply(sim) -> list[Event]``; the loop pops them from a
heap keyed ``(time, priority, seq)``. Randomness comes from one seeded ``random.Random``.

Service model (deliberately simple, stated in docs/simulator.md):

* an instance serves up to ``batch`` requests at once; a request's prefill takes the instance's
  predicted TTFT for a full batch divided by the batch (prefill is compute-bound, so its time is
  close to linear in tokens), then each further output token takes the predicted TPOT at the design
  batch, over the links the placement really uses (NVLink, PCIe or InfiniBand);
* a request goes to an instance with a free slot whose predicted per-token latency meets its SLO,
  else to any instance with a free slot, else it waits in a weighted fair queue by SLO class (and,
  with autoscaling, asks for one more instance); it times out after ``timeout_s`` in the queue;
* a failed GPU takes its instance down at once: its requests return to the queue (counted as
  migrations) and a replacement instance is placed.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, cast

from toposched.solver.queue import FairQueue
from toposched.solver.request import Placement, PlacementRequest, SloClass
from toposched.solver.scheduler import Scheduler
from toposched.topology.model import Health, LinkKind, nominal_link

if TYPE_CHECKING:
    from collections.abc import Callable

    from toposched.sim.scenario import Scenario


@dataclass
class SimRequest:
    id: int
    arrival_s: float
    input_len: int
    output_len: int
    slo_class: str
    state: str = "new"  # new | queued | running | done | timed_out | rejected
    start_s: float = 0.0
    ttft_s: float = 0.0
    finish_s: float = 0.0
    instance: str | None = None
    in_domain: bool = False
    migrations: int = 0


@dataclass
class SimInstance:
    placement: Placement
    batch: int
    prefill_s: float  # one request's prefill
    tpot_s: float
    in_domain: bool
    active: set[int] = field(default_factory=set)
    up: bool = True

    @property
    def per_token_ms(self) -> float:
        return self.tpot_s * 1000


class Event:
    priority: ClassVar[int] = 5

    def __init__(self, time: float) -> None:
        self.time = time

    def apply(self, sim: Simulation) -> list[Event]:
        raise NotImplementedError


class Arrival(Event):
    priority = 3

    def __init__(self, time: float, request: SimRequest) -> None:
        super().__init__(time)
        self.request = request

    def apply(self, sim: Simulation) -> list[Event]:
        req = self.request
        sim.requests[req.id] = req
        started = sim.try_start(req)
        if started is not None:
            return [started]
        req.state = "queued"
        sim.queue.push(str(req.id), cast(SloClass, req.slo_class), 1.0, 0.0)
        follow: list[Event] = [Timeout(self.time + sim.scenario.timeout_s, req)]
        follow.extend(sim.autoscale())
        return follow


class Finish(Event):
    priority = 1  # free slots before same-instant arrivals

    def __init__(self, time: float, request: SimRequest, instance: str) -> None:
        super().__init__(time)
        self.request = request
        self.instance = instance

    def apply(self, sim: Simulation) -> list[Event]:
        req = self.request
        if req.state != "running" or req.instance != self.instance:
            return []  # the instance failed and the request moved
        inst = sim.instances.get(self.instance)
        req.state = "done"
        req.finish_s = self.time
        if inst is not None:
            inst.active.discard(req.id)
            sim.mark_free(inst)
        return sim.drain_queue()


class Timeout(Event):
    priority = 2

    def __init__(self, time: float, request: SimRequest) -> None:
        super().__init__(time)
        self.request = request

    def apply(self, sim: Simulation) -> list[Event]:
        if self.request.state == "queued" and sim.queue.remove(str(self.request.id)):
            self.request.state = "timed_out"
        return []


class InstanceUp(Event):
    priority = 0

    def __init__(self, time: float, instance: SimInstance) -> None:
        super().__init__(time)
        self.instance = instance

    def apply(self, sim: Simulation) -> list[Event]:
        if self.instance.placement.id not in sim.scheduler.placements:
            return []  # taken down by a failure before it came up
        sim.instances[self.instance.placement.id] = self.instance
        sim.mark_free(self.instance)
        return sim.drain_queue()


class GpuFailure(Event):
    priority = 0

    def __init__(self, time: float, gpu: str, kind: str) -> None:
        super().__init__(time)
        self.gpu = gpu
        self.kind = kind

    def apply(self, sim: Simulation) -> list[Event]:
        follow: list[Event] = []
        victims = sim.nvlink_down(self.gpu) if self.kind == "nvlink-down" else sim.scheduler.fail_gpu(self.gpu)
        for pid in victims:
            inst = sim.instances.pop(pid, None)
            sim.free.pop(pid, None)
            sim.free_slo.pop(pid, None)
            sim.scheduler.release(pid)
            sim.replacements += 1
            if inst is None:
                continue
            for rid in sorted(inst.active):
                req = sim.requests[rid]
                req.state = "queued"
                req.instance = None
                req.migrations += 1
                sim.migrations += 1
                sim.queue.push(str(rid), cast(SloClass, req.slo_class), 1.0, 0.0)
            follow.extend(sim.place_instances(1))
        follow.extend(sim.drain_queue())
        return follow


class Simulation:
    """One run of one policy over one workload."""

    def __init__(
        self, scenario: Scenario, scheduler: Scheduler, request: PlacementRequest, policy: str, seed: int
    ) -> None:
        self.scenario = scenario
        self.scheduler = scheduler
        self.template = request
        self.policy = policy
        self.rng = random.Random(seed)
        self.now = 0.0
        self.requests: dict[int, SimRequest] = {}
        self.instances: dict[str, SimInstance] = {}
        self.free: dict[str, None] = {}  # instances with a free slot
        self.free_slo: dict[str, None] = {}  # ... whose per-token latency meets the SLO
        self.queue = FairQueue()
        self.events_done = 0
        self.migrations = 0
        self.replacements = 0
        self._ids = itertools.count()
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = itertools.count()
        self._full = False  # the last placement attempt found no room (reset when GPUs free up)
        self.placed_history: list[Placement] = []
        self.timeline: list[tuple[float, int, int]] = []  # (time s, queued, running), ~200 samples

    # --------------------------------------------------------------------- instances

    def _instance(self, p: Placement) -> SimInstance:
        batch = self.scenario.batch
        return SimInstance(
            placement=p,
            batch=batch,
            prefill_s=p.ttft_ms / 1000 / batch,
            tpot_s=p.tpot_ms / 1000,
            in_domain=all(c.held for c in p.constraints if c.name == "domain-affinity") and p.level == "nvlink",
        )

    def place_instances(self, count: int | None) -> list[Event]:
        """Place up to ``count`` instances (None: as many as fit); returns their InstanceUp events."""
        events: list[Event] = []
        while count is None or len(events) < count:
            # a known count is one batch (``Scheduler.place_batch``);
            # "as many as fit" goes one at a time until the first refusal
            n = 1 if count is None else count - len(events)
            batch = [self.template.model_copy(update={"id": f"i{next(self._ids)}", "replicas": 1}) for _ in range(n)]
            out = self.scheduler.place_batch(batch, self.policy)
            for p in out.placements:
                self.placed_history.append(p)
                events.append(InstanceUp(self.now + self.scenario.instance_startup_s, self._instance(p)))
            if out.unplaced or not out.placements:
                self._full = True
                break
        return events

    def nvlink_down(self, ref: str) -> list[str]:
        """A GPU loses its NVLinks: it leaves its NVLink domain (the DomainMap changes) but can still
        serve alone. Its peers now reach it over PCIe (NODE within its NUMA node, SYS across).
        Returns the instances whose TP group used NVLink to it (they must drain and move)."""
        node_name, _, index_text = ref.rpartition("/")
        index = int(index_text)
        cluster = self.scheduler.cluster
        node = cluster.node(node_name)
        numa = {g.index: g.numa_node for g in node.gpus}
        links = []
        for link in node.links:
            if index in (link.a, link.b) and link.kind is LinkKind.NVLINK:
                same = numa[link.a] is not None and numa[link.a] == numa[link.b]
                kind = LinkKind.NODE if same else LinkKind.SYS
                bandwidth, latency = nominal_link(kind)
                link = link.model_copy(
                    update={"kind": kind, "nvlinks": 0, "bandwidth_gbps": bandwidth, "latency_us": latency}
                )
            links.append(link)
        gpus = tuple(g.model_copy(update={"health": Health.DEGRADED}) if g.index == index else g for g in node.gpus)
        changed = node.model_copy(update={"links": tuple(links), "gpus": gpus})
        nodes = tuple(changed if n.name == node_name else n for n in cluster.nodes)
        self.scheduler.update_topology(cluster.model_copy(update={"nodes": nodes}))
        return [
            pid
            for pid, p in self.scheduler.placements.items()
            if p.tp > 1
            and any(ref in [f"{r.node}/{r.gpu}" for r in p.ranks if r.stage == stage] for stage in range(p.pp))
        ]

    def autoscale(self) -> list[Event]:
        if not self.scenario.autoscale or self._full:
            return []
        return self.place_instances(1)

    def mark_free(self, inst: SimInstance) -> None:
        pid = inst.placement.id
        if len(inst.active) < inst.batch and pid in self.instances:
            self.free[pid] = None
            if inst.per_token_ms <= self.scenario.slo_ms:
                self.free_slo[pid] = None

    # --------------------------------------------------------------------- requests

    def try_start(self, req: SimRequest) -> Event | None:
        pool = self.free_slo or self.free
        if not pool:
            return None
        pid = next(iter(pool))
        inst = self.instances[pid]
        inst.active.add(req.id)
        if len(inst.active) >= inst.batch:
            self.free.pop(pid, None)
            self.free_slo.pop(pid, None)
        req.state = "running"
        req.instance = pid
        req.in_domain = inst.in_domain
        req.start_s = self.now
        req.ttft_s = self.now + inst.prefill_s - req.arrival_s
        done = self.now + inst.prefill_s + (req.output_len - 1) * inst.tpot_s
        return Finish(done, req, pid)

    def drain_queue(self) -> list[Event]:
        events: list[Event] = []
        while len(self.queue) and (self.free_slo or self.free):
            item = self.queue.pop()
            if item is None:
                break
            req = self.requests[int(item.item_id)]
            started = self.try_start(req)
            if started is not None:
                events.append(started)
        return events

    # --------------------------------------------------------------------- loop

    def push(self, event: Event) -> None:
        heapq.heappush(self._heap, (event.time, event.priority, next(self._seq), event))

    def run(self, arrivals: list[SimRequest], progress: Callable[[Simulation], None] | None = None) -> None:
        for ev in self.place_instances(None if self.scenario.instances == "max" else int(self.scenario.instances)):
            self.push(ev)
        self._full = False
        for req in arrivals:
            self.push(Arrival(req.arrival_s, req))
        for failure in self.scenario.failures:
            self.push(GpuFailure(failure.at_s, failure.gpu, failure.kind))
        span = max((r.arrival_s for r in arrivals), default=1.0) * 1.5 or 1.0
        sample_every = span / 200
        next_sample = 0.0
        while self._heap:
            time, _, _, event = heapq.heappop(self._heap)
            self.now = time
            if time >= next_sample:
                running = sum(len(i.active) for i in self.instances.values())
                self.timeline.append((time, len(self.queue), running))
                next_sample = time + sample_every
            for follow in event.apply(self):
                self.push(follow)
            self.events_done += 1
            if isinstance(event, GpuFailure):
                self._full = False  # the failed instance's healthy GPUs are free again
            if progress is not None and self.events_done % 2048 == 0:
                progress(self)
        # end of run: every instance is torn down and its reservation released
        for pid in list(self.instances):
            self.scheduler.release(pid)
        self.instances.clear()
        for req in self.requests.values():
            if req.state in ("queued", "new"):
                req.state = "rejected"
