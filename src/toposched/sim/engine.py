"""Discrete-event cluster simulator driving the real scheduler, ledger and cost model on a fake clock.

Entities: ``SimRequest`` (one inference request), ``Unit`` (one logical model instance of a
deployment, with its lifetime and request stream) and ``SimInstance`` (one placed copy of a unit:
a booking in the ledger and a continuous-batching engine, ``sim/batching.py``; a unit has two copies
while a defragmentation move runs), in ``sim/units.py``. Events (``sim/events.py``) are classes with
``apply(sim) -> list[Event]``; the loop pops them from a heap keyed ``(time, priority, seq)``.
Randomness comes from seeded ``random.Random`` objects: one for the instance arrivals, one per unit
for its request stream, so every policy sees the same instances and the same requests.

``Simulation`` is one run: the instances present at the start (a fixed set, or the churn instances
drawn up front), the event loop, then teardown. What the events change (copies, requests,
departures, failures) is ``SimState`` (``sim/state.py``); a disaggregated deployment is
``PdSimulation`` (``sim/disaggregated.py``).
"""

from __future__ import annotations

import heapq
import math
import random
from typing import TYPE_CHECKING

from toposched.sim.events import EndOfArrivals, Event, GpuFailure
from toposched.sim.metrics import DomainSampler
from toposched.sim.state import SimState
from toposched.sim.units import Unit
from toposched.sim.workload import SimRequest

if TYPE_CHECKING:
    from collections.abc import Callable


class Simulation(SimState):
    """One run of one policy over one workload."""

    occupancy: DomainSampler | None = None
    """GPUs held per NVLink domain at each sample (set at the first; the plots' heat map)."""

    # --------------------------------------------------------------------- instances at the start

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

    # --------------------------------------------------------------------- loop

    def sample(self, time: float) -> None:
        waiting = sum(len(d.queue) for d in self.deployments)
        running = 0
        for inst in self.copies.values():
            running += len(inst.batcher.running)
            waiting += len(inst.batcher.waiting)
        self.timeline.append((time, waiting, running))
        if self.occupancy is None:
            self.occupancy = DomainSampler.of(self.scheduler.index)
        self.occupancy.sample(time, self.copies)

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
