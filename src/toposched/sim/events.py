"""The simulator's events: one class each, ``apply(sim)`` returning the follow-up events.

The loop (``Simulation.loop``) pops them from a heap keyed ``(time, priority, seq)``; at one instant
lower priorities go first: failures and instances coming up, then step ends (free batch slots
before same-instant arrivals), departures and admission timers, arrivals (and KV reaching a decode
instance), the end of arrivals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from toposched.sim.workload import draw_request

if TYPE_CHECKING:
    from toposched.sim.engine import Simulation
    from toposched.sim.units import SimInstance, Unit
    from toposched.sim.workload import SimRequest


class Event:
    priority: ClassVar[int] = 5

    def __init__(self, time: float) -> None:
        self.time = time

    def apply(self, sim: Simulation) -> list[Event]:
        raise NotImplementedError


class Arrival(Event):
    """A request known before the run (drawn or from a trace); chains the next one."""

    priority = 3

    def __init__(self, time: float, request: SimRequest) -> None:
        super().__init__(time)
        self.request = request

    def apply(self, sim: Simulation) -> list[Event]:
        if sim.closed:
            return []  # a churn run's arrivals stop at duration_s: later trace rows are not offered
        sim.add_request(self.request)
        return sim.next_arrival()


class StreamArrival(Event):
    """The next request of a unit's own stream (churn), from its ``ready_s`` to its departure."""

    priority = 3

    def __init__(self, time: float, unit: Unit, version: int) -> None:
        super().__init__(time)
        self.unit = unit
        self.version = version

    def apply(self, sim: Simulation) -> list[Event]:
        unit = self.unit
        if self.version != unit.stream_version or sim.closed or unit.stream is None:
            return []
        if len(sim.requests) >= sim.request_cap:
            sim.capped = True
            return []
        dep = unit.deployment
        sim.add_request(draw_request(unit.stream, dep.tenant, dep.index, len(sim.requests), self.time))
        return sim.next_stream(unit)


class StepEnd(Event):
    priority = 1  # finish steps (free batch slots) before same-instant arrivals

    def __init__(self, time: float, instance: SimInstance, version: int) -> None:
        super().__init__(time)
        self.instance = instance
        self.version = version

    def apply(self, sim: Simulation) -> list[Event]:
        inst = self.instance
        if inst.version != self.version or inst.state == "gone":
            return []
        batcher = inst.batcher
        follow: list[Event] = []
        for req in batcher.finish(self.time):
            follow.extend(sim.finished(inst, req))
        end = batcher.compose(self.time, sim.timed_out)
        if end is not None:
            follow.append(sim.step_event(inst, end))
        if inst.state == "up":
            inst.unit.deployment.router.update(inst)
        elif inst.state == "draining" and end is None:
            sim.drained(inst)
        return follow


class DrainDeadline(Event):
    """A draining copy's grace period is over: what it has not finished is aborted, its GPUs freed."""

    priority = 2

    def __init__(self, time: float, instance: SimInstance) -> None:
        super().__init__(time)
        self.instance = instance

    def apply(self, sim: Simulation) -> list[Event]:
        return sim.drain_deadline(self.instance)


class KvArrival(Event):
    """A disaggregated request's KV has reached its decode instance: its first token is out, it decodes."""

    priority = 3

    def __init__(self, time: float, request: SimRequest, instance: SimInstance) -> None:
        super().__init__(time)
        self.request = request
        self.instance = instance

    def apply(self, sim: Simulation) -> list[Event]:
        return sim.kv_arrived(self.request, self.instance)


class InstanceUp(Event):
    priority = 0

    def __init__(self, time: float, instance: SimInstance) -> None:
        super().__init__(time)
        self.instance = instance

    def apply(self, sim: Simulation) -> list[Event]:
        return sim.instance_up(self.instance)


class Departure(Event):
    priority = 2

    def __init__(self, time: float, unit: Unit) -> None:
        super().__init__(time)
        self.unit = unit

    def apply(self, sim: Simulation) -> list[Event]:
        sim.depart(self.unit, hand_back=True)
        return []


class AdmissionTimer(Event):
    """A waiting instance may now fall back across domains, or gives up."""

    priority = 2

    def __init__(self, time: float, unit: Unit, kind: str, waits: int) -> None:
        super().__init__(time)
        self.unit = unit
        self.kind = kind
        self.waits = waits

    def apply(self, sim: Simulation) -> list[Event]:
        return sim.admission.timer(self.unit, self.kind, self.waits, self.time)


class InstanceArrival(Event):
    """A churn instance arrives and asks for GPUs; chains the next arrival."""

    priority = 2

    def __init__(self, time: float, unit: Unit) -> None:
        super().__init__(time)
        self.unit = unit

    def apply(self, sim: Simulation) -> list[Event]:
        if sim.closed:
            return []
        sim.units.append(self.unit)
        return [*sim.admission.submit(self.unit, self.time), *sim.begin_demand(self.unit), *sim.next_instance()]


class GpuFailure(Event):
    priority = 0

    def __init__(self, time: float, gpu: str, kind: str) -> None:
        super().__init__(time)
        self.gpu = gpu
        self.kind = kind

    def apply(self, sim: Simulation) -> list[Event]:
        sim.gpu_failures += 1
        if self.kind == "nvlink-down":
            victims = sim.nvlink_down(self.gpu)
        else:
            healthy = self.gpu not in sim.scheduler.failed
            victims = sim.scheduler.fail_gpu(self.gpu)
            sim.gpus_available -= int(healthy)
            if healthy:
                sim.hbm_available -= sim.gpu_capacity[self.gpu]
                sim.hbm_series.append((sim.now, sim.hbm_available))
        follow: list[Event] = []
        for pid in victims:
            inst = sim.copies.get(pid)
            if inst is not None:
                follow.extend(sim.fail(inst))
        sim.record_gpus()
        sim.retry = True
        return follow


class EndOfArrivals(Event):
    """Churn: instance and request arrivals stop; every instance drains, nothing waits any more."""

    priority = 4

    def apply(self, sim: Simulation) -> list[Event]:
        sim.closed = True
        sim.admission.close()
        for unit in sim.units:
            sim.depart(unit, hand_back=False)
        return []


__all__ = [
    "AdmissionTimer",
    "Arrival",
    "Departure",
    "DrainDeadline",
    "EndOfArrivals",
    "Event",
    "GpuFailure",
    "InstanceArrival",
    "InstanceUp",
    "KvArrival",
    "StepEnd",
    "StreamArrival",
]
