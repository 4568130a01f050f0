"""Sizing a deployment for its load: how many instances of which degree serve a request rate, and what
would make a missed SLO met.

Every figure here is an operating point (``perf/serving.py``) of a degree option over the GPU's own
link (NVLink inside one domain), the best case the placement then checks on the GPUs it gets:

* :func:`size_for_rate` (``plan --request-rate R``): for each degree option that meets the SLO, the
  instances needed are ``ceil(R / served_rps)`` and the GPUs ``instances x tp x pp``; the option
  needing the fewest GPUs wins (ties: the higher goodput per GPU, then the fewer instances).
  ``served_rps`` is the Poisson rate one instance is planned for (``perf/serving.py``
  ``planned_rate``: 95 % of the requests find a free sequence slot in time), not what it completes
  with its batch always full (``benchmarks/goodput_check.py`` simulates the result).
* :func:`slo_remedies`: when no option meets the SLO, the changes of the request that would (FP8
  weights, an FP8 KV cache, a larger TP degree, a smaller fixed batch), each with the figures it gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from toposched.errors import InputError
from toposched.perf.serving import OperatingPoint
from toposched.solver.request import PlacementRequest

if TYPE_CHECKING:  # the scheduler calls slo_remedies: no import circle at run time
    from toposched.solver.scheduler import Candidate, Scheduler


class Capacity(BaseModel):
    """What ``--request-rate`` asked and what the plan serves (the plan document's ``capacity``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_rate_rps: float
    replicas: int
    gpus: int
    served_rps: float
    """Requests/s the replicas are planned to serve together within the SLO (at least the rate asked)."""
    tp: int
    pp: int
    gpu: str
    batch: int
    """Running sequences per instance (each instance's operating point)."""


@dataclass(frozen=True)
class Sizing:
    """The chosen option for a rate, and the request that places it."""

    capacity: Capacity
    request: PlacementRequest
    point: OperatingPoint


def _point(cand: Candidate) -> OperatingPoint:
    """The option's operating point over its GPU's own link (stages joined by the same link)."""
    return cand.options.operating(cand.option, cand.options.gpu.native_link)


def size_for_rate(scheduler: Scheduler, request: PlacementRequest, rate: float) -> Sizing:
    """The fewest GPUs that serve ``rate`` requests/s of the request's workload within its SLO.

    InputError when no degree option meets the SLO on this cluster's GPUs (with the remedies)."""
    if not (math.isfinite(rate) and rate > 0):
        raise InputError(f"request rate {rate!r} is not a positive number", fix="give requests/s, e.g. 10")
    cands, dropped = scheduler.candidates(request)
    best: tuple[tuple[int, float, int], Candidate, OperatingPoint, int] | None = None
    for cand in cands:
        point = _point(cand)
        if not point.meets_slo or point.served_rps <= 0:
            continue
        replicas = max(1, math.ceil(rate / point.served_rps - 1e-9))
        gpus = replicas * cand.option.gpus
        key = (gpus, -point.goodput_tokens_per_s / cand.option.gpus, replicas)
        if best is None or key < best[0]:
            best = (key, cand, point, replicas)
    if best is None:
        why = "; ".join(dropped[:2]) if not cands else "no degree option meets the SLO at any batch"
        remedies = slo_remedies(scheduler, request)
        raise InputError(
            f"{request.model} cannot serve {rate:g} req/s on this cluster's GPUs: {why}",
            fix=("would meet it: " + "; ".join(remedies)) if remedies else "relax the SLO or use a larger GPU",
        )
    _, cand, point, replicas = best
    option = cand.option
    capacity = Capacity(
        request_rate_rps=rate,
        replicas=replicas,
        gpus=replicas * option.gpus,
        served_rps=round(replicas * point.served_rps, 4),
        tp=option.tp,
        pp=option.pp,
        gpu=cand.options.gpu.name,
        batch=point.batch,
    )
    sized = request.model_copy(update={"replicas": replicas, "allowed_tp": (option.tp,), "max_pp": option.pp})
    return Sizing(capacity, sized, point)


def missing_gpus(scheduler: Scheduler, sizing: Sizing, placed: int) -> str:
    """One line: how many GPUs of which kind the cluster lacks for the replicas not placed."""
    cap = sizing.capacity
    short = cap.replicas - placed
    per = cap.tp * cap.pp
    free = len(scheduler.index.free)
    return (
        f"{short} of {cap.replicas} instances (tp={cap.tp} pp={cap.pp}) could not be placed: "
        f"{short * per} more {cap.gpu} GPUs are needed, in groups of {cap.tp} in one NVLink domain "
        f"({free} GPUs are left free)"
    )


def _describe(point: OperatingPoint, cand: Candidate) -> str:
    return (
        f"tp={cand.option.tp} pp={cand.option.pp}, batch {point.batch}: TPOT {point.tpot_ms:.1f} ms "
        f"(95th percentile {point.tpot_p95_ms:.1f}), TTFT {point.ttft_ms:.0f} ms"
    )


def slo_remedies(scheduler: Scheduler, request: PlacementRequest, limit: int = 3) -> list[str]:
    """Changes of ``request`` that would meet its SLO on an empty cluster of these GPUs, each with what
    it gets (the first meeting option of each change); empty when none does or there is no SLO."""
    if request.slo_tpot_ms is None and request.slo_ttft_ms is None:
        return []
    tried: list[tuple[str, PlacementRequest]] = []
    if request.weight_dtype not in ("fp8", "int8", "int4"):
        tried.append(("--weight-dtype fp8", request.model_copy(update={"weight_dtype": "fp8"})))
    if request.kv_dtype in (None, "auto"):
        tried.append(("--kv-dtype fp8", request.model_copy(update={"kv_dtype": "fp8"})))
    if request.allowed_tp is not None:
        larger = tuple(t for t in (2, 4, 8, 16, 32, 64, 72) if t > max(request.allowed_tp) and not t & (t - 1))
        if larger:
            tried.append(("a larger --tp", request.model_copy(update={"allowed_tp": larger})))
    if request.concurrent_seqs is not None and request.concurrent_seqs > 1:
        tried.append(
            ("a smaller batch (leave out --concurrent-seqs)", request.model_copy(update={"concurrent_seqs": None}))
        )
    out: list[str] = []
    for label, variant in tried:
        try:
            cands, _ = scheduler.candidates(variant)
        except InputError:
            continue
        for cand in cands:
            point = _point(cand)
            if point.meets_slo:
                out.append(f"{label} ({_describe(point, cand)})")
                break
        if len(out) >= limit:
            break
    return out


__all__ = ["Capacity", "Sizing", "missing_gpus", "size_for_rate", "slo_remedies"]
