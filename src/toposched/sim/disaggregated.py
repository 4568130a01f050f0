"""A disaggregated deployment in the simulator (``PdSimulation``): one layout's prefill and decode
instances up from the start, requests prefilled, their KV moved, then decoded.

A disaggregated deployment (``Scenario.pd``): a request is prefilled on the
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

import math
from collections import Counter
from typing import TYPE_CHECKING

from toposched.perf.kv_transfer import KvLinks, KvRoute, Resource, kv_bytes_per_token, kv_route
from toposched.sim.deployment import Deployment, PdLayout
from toposched.sim.engine import Simulation
from toposched.sim.events import Event, KvArrival
from toposched.sim.units import SimInstance
from toposched.sim.workload import SimRequest
from toposched.solver.pd import placement_lanes, rank_kv_needs, store_lanes
from toposched.solver.scheduler import Scheduler

if TYPE_CHECKING:
    from toposched.sim.scenario import Scenario


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
