"""Deployments: a tenant's placement request, its in-domain reference figures and its request router.

The **in-domain reference** of a tenant is what its instance would do with every TP group inside
one NVLink domain, at the design batch (``batch`` sequences of the mean lengths), from the same
step cost the simulation steps with:

    per-token  = (prefill of batch prompts + (output - 1) x decode step) / output     (ms per token)
    capacity   = batch / (per-token x output)                                          (requests/s)

That is ``predict_latency``'s end-to-end time per output token: under continuous batching a request
in a full batch shares its steps with the prefills of about ``batch`` other requests over its
lifetime, so the static-batch figure is also the steady-state one. ``slo_factor`` scales the
per-token reference into the per-token SLO, and the same factor scales the in-domain TPOT into the
``slo_tpot_ms`` the scheduler checks placements against (its predictions are per step, without the
prefill share). A tenant with ``slo_ms`` passes it as ``slo_tpot_ms`` unchanged (as before issue 15).

Requests of a deployment go to the live instance with the fewest requests given and not finished
(join-shortest-queue; ties: the instance that reached that load first); with no live instance they
wait in the deployment's fair queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from toposched.errors import InputError
from toposched.perf.links import get_link
from toposched.perf.step import StepCost
from toposched.sim.scenario import Tenant
from toposched.solver.place import fabric_link
from toposched.solver.queue import FairQueue
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler

if TYPE_CHECKING:
    from toposched.sim.engine import SimInstance


class Router:
    """Join-shortest-queue over live instances: buckets by load, so a pick is a short walk."""

    def __init__(self) -> None:
        self._buckets: list[dict[SimInstance, None]] = []
        self._load: dict[SimInstance, int] = {}

    def __len__(self) -> int:
        return len(self._load)

    def __contains__(self, inst: object) -> bool:
        return inst in self._load

    def _put(self, inst: SimInstance, load: int) -> None:
        while len(self._buckets) <= load:
            self._buckets.append({})
        self._buckets[load][inst] = None
        self._load[inst] = load

    def add(self, inst: SimInstance) -> None:
        self._put(inst, inst.batcher.load)

    def remove(self, inst: SimInstance) -> None:
        load = self._load.pop(inst, None)
        if load is not None:
            del self._buckets[load][inst]

    def update(self, inst: SimInstance) -> None:
        old = self._load.get(inst)
        load = inst.batcher.load
        if old is None or old == load:
            return
        del self._buckets[old][inst]
        self._put(inst, load)

    def best(self) -> SimInstance | None:
        """The least-loaded live instance, or None."""
        if not self._load:
            return None
        for bucket in self._buckets:
            if bucket:
                return next(iter(bucket))
        return None

    def instances(self) -> list[SimInstance]:
        return list(self._load)


@dataclass(eq=False)
class Deployment:
    """One tenant's instances, request queue and reference figures."""

    index: int
    tenant: Tenant
    template: PlacementRequest
    slo_ms: float
    ref_per_token_ms: float
    ref_tpot_ms: float
    capacity_rps: float
    ref_tp: int
    ref_gpus: int
    queue: FairQueue = field(default_factory=FairQueue)
    router: Router = field(default_factory=Router)
    units: int = 0


def placement_template(tenant: Tenant, slo_tpot_ms: float | None) -> PlacementRequest:
    """The placement request of a tenant's instances (its id is replaced per instance)."""
    return PlacementRequest(
        id=tenant.name,
        model=tenant.model,
        weight_dtype=tenant.weight_dtype,
        kv_dtype=tenant.kv_dtype,
        max_model_len=tenant.max_model_len,
        concurrent_seqs=tenant.batch,
        input_len=tenant.input_len.mean,
        output_len=tenant.output_len.mean,
        slo_tpot_ms=slo_tpot_ms,
        slo_class=tenant.slo_class,
        allowed_tp=None if tenant.tp == "auto" else (tenant.tp,),
    )


def build_deployment(index: int, tenant: Tenant, scheduler: Scheduler, *, where: str) -> Deployment:
    """The tenant's deployment on this cluster; InputError when its model fits no degree here."""
    probe = placement_template(tenant, tenant.slo_ms)
    try:
        cands, dropped = scheduler.candidates(probe)
    except InputError as exc:  # an unknown model, a context longer than the model's
        raise InputError(f"{where}: tenant {tenant.name!r}: {exc.message}", fix=exc.fix) from None
    if not cands:
        why = "; ".join(dropped[:3]) or "no degree within the limits"
        raise InputError(
            f"{where}: tenant {tenant.name!r} ({tenant.model}) fits no degree on this cluster: {why}",
            fix="allow another tp, a smaller batch or shorter lengths, or a larger GPU",
        )
    # the option the scheduler tries first (with an SLO in ms: the fewest GPUs meeting it on an empty
    # cluster; with a factor: the layout rule without an SLO, which the factor is relative to)
    cand = cands[0]
    if tenant.slo_ms is not None:
        meeting = [c for c in cands if c.options.meets_slo(c.options.latency(c.option, c.options.gpu.native_link))]
        cand = meeting[0] if meeting else cands[0]
    option, gpu = cand.option, cand.options.gpu
    pp_link = get_link(fabric_link(scheduler.cluster.fabric)) if option.pp > 1 else None
    cost = StepCost(option.spec, gpu, tp=option.tp, pp=option.pp, link=get_link(gpu.native_link), pp_link=pp_link)
    batch, inp, out = tenant.batch, tenant.input_len.mean, tenant.output_len.mean
    tpot = cost.decode_ms(batch, inp + out / 2)
    per_token = (cost.prefill_ms(batch, inp) + (out - 1) * tpot) / out
    if tenant.slo_factor is not None:
        slo_ms = tenant.slo_factor * per_token
        template = placement_template(tenant, tenant.slo_factor * tpot)
    else:
        assert tenant.slo_ms is not None  # one of the two, checked by Tenant
        slo_ms = tenant.slo_ms
        template = probe
    return Deployment(
        index=index,
        tenant=tenant,
        template=template,
        slo_ms=slo_ms,
        ref_per_token_ms=per_token,
        ref_tpot_ms=tpot,
        capacity_rps=batch / (per_token * out / 1000.0),
        ref_tp=option.tp,
        ref_gpus=option.gpus,
    )


__all__ = ["Deployment", "Router", "build_deployment"]
