"""The step cost of a placed instance: ``perf.step.StepCost`` over the links its GPUs really use.

The simulator steps each instance's continuous batching with this; the links come from
``place.stage_links`` (what ``assess`` predicted the placement's TPOT over), the model with the KV
dtype the placement ended up with (capacity fallbacks), compression and overlap from the placement.
"""

from __future__ import annotations

from functools import lru_cache

from toposched.errors import InputError
from toposched.perf.coefficients import PerfConfig
from toposched.perf.hardware import GpuSpec
from toposched.perf.latency import resolve_config
from toposched.perf.links import get_link
from toposched.perf.step import StepCost
from toposched.solver.place import stage_links
from toposched.solver.request import Placement, PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.workload.spec import ModelSpec


@lru_cache(maxsize=1024)
def _cost(
    spec: ModelSpec,
    gpu: GpuSpec,
    tp: int,
    pp: int,
    link: str,
    pp_link: str | None,
    compression: bool,
    overlap: float,
    config: PerfConfig,
    engine: str,
) -> StepCost:
    return StepCost(
        spec,
        gpu,
        tp=tp,
        pp=pp,
        link=get_link(link),
        pp_link=get_link(pp_link) if pp_link else None,
        config=config,
        compression=compression,
        overlap=overlap,
        engine=engine,
    )


def step_cost(scheduler: Scheduler, request: PlacementRequest, placement: Placement) -> StepCost:
    """The ``StepCost`` of ``placement`` (decided by ``scheduler`` for ``request``); shared between
    instances with the same model, degrees, links, compression and overlap."""
    node = placement.ranks[0].node
    gpu = scheduler.gpu_of_node[node]
    cands, _ = scheduler.candidates(request)
    wanted = tuple(f for f in placement.fallbacks if f != "cross-domain")
    option = next(
        (
            c.option
            for c in cands
            if c.options.gpu.name == gpu.name
            and (c.option.tp, c.option.pp, c.option.fallbacks) == (placement.tp, placement.pp, wanted)
        ),
        None,
    )
    if option is None:
        raise InputError(
            f"placement {placement.id}: tp={placement.tp} pp={placement.pp} on {gpu.name} is not an option of "
            f"request {request.id}",
            fix="pass the request the placement was decided for",
        )
    stages: list[list[str]] = [[] for _ in range(placement.pp)]
    for rank in sorted(placement.ranks, key=lambda r: r.rank):
        stages[rank.stage].append(f"{rank.node}/{rank.gpu}")
    link, _in_domain, pp_link = stage_links(scheduler.index, stages, gpu)
    return _cost(
        option.spec,
        gpu,
        placement.tp,
        placement.pp,
        link,
        pp_link,
        placement.compression is not None,
        placement.overlap,
        resolve_config(option.spec, gpu, None, request.cost_engine),  # in the key: one cache across profiles
        request.cost_engine,
    )


__all__ = ["step_cost"]
