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
* :func:`size_pd_for_rate` (``plan --pd auto --request-rate R``): the same for a disaggregated
  deployment (prefill instances for the TTFT, decode instances for the TPOT), and :func:`choose_mode`
  keeps whichever of the two serves the rate with fewer GPUs (aggregated on a tie), saying why.
* :func:`slo_remedies`: when no option meets the SLO, the changes of the request that would (FP8
  weights, an FP8 KV cache, a larger TP degree, a smaller fixed batch), each with the figures it gets.

Disaggregated, a request's TTFT is the prefill instance's (half a pass of wait and its pass), the KV
transfer of its prompt to the decode instance (``kv_ms``: the prompt's KV bytes over the decode ranks'
NICs at the fabric's bandwidth, as ``perf/kv_transfer.py`` charges a same-rack transfer), and the
decode instance's first step. What the TTFT SLO leaves after those (or, without one, the prefill's
own TTFT) is split evenly between the two queues a request can wait in: for a prefill slot and for a
decode slot (each role's planned rate: ``perf/serving.py planned_rate``). The decode instance's TPOT
has no prompt riding along (that is what disaggregation buys); the transfer and the second queue are
what it costs TTFT.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

from toposched.errors import InfeasibleError, InputError
from toposched.perf.serving import OperatingPoint, planned_rate, prefill_planned_rate
from toposched.solver.request import PlacementRequest

if TYPE_CHECKING:  # the scheduler calls slo_remedies: no import circle at run time
    from toposched.solver.candidates import Candidate
    from toposched.solver.scheduler import Scheduler


MAX_REPLICAS: int = next(m.le for m in PlacementRequest.model_fields["replicas"].metadata if getattr(m, "le", None))
"""The most instances one request may ask for (``PlacementRequest.replicas``)."""
MAX_ROLE_INSTANCES = 1024
"""The most instances of a role in a disaggregated plan (``solver/pd.py Disaggregation``)."""


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
    sizing = _best(scheduler, request, rate, lambda _cand, point: point.served_rps)
    if sizing is None:
        cands, dropped = scheduler.candidates(request)
        why = "; ".join(dropped[:2]) if not cands else "no degree option meets the SLO at any batch"
        remedies = slo_remedies(scheduler, request)
        raise InfeasibleError(
            f"{request.model} cannot serve {rate:g} req/s on this cluster's GPUs: {why}",
            fix=("would meet it: " + "; ".join(remedies)) if remedies else "relax the SLO or use a larger GPU",
        )
    cap = sizing.capacity
    if cap.replicas > MAX_REPLICAS:
        raise InputError(
            f"{rate:g} req/s of {request.model} needs {cap.replicas:,} instances (tp={cap.tp}, "
            f"{sizing.point.served_rps:.3g} req/s each); one request places at most {MAX_REPLICAS:,}",
            fix="split the rate over several requests, or relax the SLO",
        )
    return sizing


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


@dataclass(frozen=True)
class PdSizing:
    """A disaggregated deployment sized for a rate: each role's option, operating point and count."""

    prefill: Sizing
    decode: Sizing
    kv_ms: float
    ttft_ms: float
    """Predicted mean TTFT at the rate: the prefill instance's (its passes as full as the rate makes them),
    the KV transfer and the decode instance's first step."""

    @property
    def gpus(self) -> int:
        return self.prefill.capacity.gpus + self.decode.capacity.gpus


class ModeChoice(BaseModel):
    """``plan --pd auto``: aggregated or disaggregated, both sized for the rate, and why (the plan's ``mode``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    chosen: Literal["aggregated", "disaggregated"]
    aggregated_gpus: int | None
    """GPUs of the aggregated sizing (None: no aggregated option meets the SLO)."""
    disaggregated_gpus: int | None
    """GPUs of prefill and decode pools together (None: no disaggregated sizing meets the SLO)."""
    prefill: int = 0
    decode: int = 0
    why: str


def _best(
    scheduler: Scheduler,
    request: PlacementRequest,
    rate: float,
    rate_of: Callable[[Candidate, OperatingPoint], float],
    limit: int | None = None,
) -> Sizing | None:
    """The option serving ``rate`` with the fewest GPUs (ties: more per GPU, fewer instances), each option
    planned for ``rate_of(candidate, its operating point)`` requests/s per instance; options needing more
    than ``limit`` instances are left out. None when no option meets the SLO."""
    cands, _ = scheduler.candidates(request)
    best: tuple[tuple[int, float, int], Candidate, OperatingPoint, int] | None = None
    for cand in cands:
        point = _point(cand)
        if not point.meets_slo:
            continue
        served = rate_of(cand, point)
        if served <= 0:
            continue
        point = replace(point, served_rps=served, goodput_tokens_per_s=served * point.osl)
        replicas = max(1, math.ceil(rate / served - 1e-9))
        if limit is not None and replicas > limit:
            continue
        key = (replicas * cand.option.gpus, -served / cand.option.gpus, replicas)
        if best is None or key < best[0]:
            best = (key, cand, point, replicas)
    if best is None:
        return None
    _, cand, point, replicas = best
    option = cand.option
    capacity = Capacity(
        request_rate_rps=rate, replicas=replicas, gpus=replicas * option.gpus,
        served_rps=round(replicas * point.served_rps, 4), tp=option.tp, pp=option.pp, gpu=cand.options.gpu.name,
        batch=point.batch,
    )  # fmt: skip
    sized = request.model_copy(update={"replicas": replicas, "allowed_tp": (option.tp,), "max_pp": option.pp})
    return Sizing(capacity, sized, point)


def _kv_ms(scheduler: Scheduler, request: PlacementRequest, decode_tp: int) -> float:
    """A prompt's KV moved to a decode instance: its bytes over the decode ranks' NICs (one each)."""
    from toposched.perf.kv_transfer import kv_bytes_per_token
    from toposched.perf.links import get_link
    from toposched.solver.place import fabric_link
    from toposched.workload import resolve_model
    from toposched.workload.dtypes import parse_kv_dtype

    spec = resolve_model(request.model, kv_dtype=parse_kv_dtype(request.kv_dtype) if request.kv_dtype else None)
    link = get_link(fabric_link(scheduler.cluster.fabric))
    nbytes = request.input_len * kv_bytes_per_token(spec)
    return (link.p2p_alpha_us + nbytes / decode_tp / (link.p2p_bandwidth_gbps * 1e3)) / 1e3


PREFILL_SHARE = 0.75
"""Of what a TTFT SLO leaves after the KV transfer and the decode instance's first step, the share a
request may spend at the prefill instance (waiting for a pass and its own); the rest is its wait for a
decode slot."""


def size_pd_for_rate(scheduler: Scheduler, request: PlacementRequest, rate: float) -> PdSizing | None:
    """Prefill and decode pools that serve ``rate`` within the SLO with the fewest GPUs (None: none does).

    The TTFT budget (module docstring): the SLO less the KV transfer and the decode's first step, split
    ``PREFILL_SHARE`` to the prefill instance (``perf/serving.py prefill_planned_rate``) and the rest to
    the wait for a decode slot (``planned_rate``). Without a TTFT SLO a prefill instance may run full
    passes, and a request may wait for a decode slot as long as its prefill took."""
    from toposched.solver.pd import prefill_request

    prefill_req = prefill_request(request, 1)
    decode_req = request.model_copy(update={"slo_ttft_ms": None, "serving_role": "decode", "replicas": 1})
    dec_points = [(c, p) for c, p in ((c, _point(c)) for c in scheduler.candidates(decode_req)[0]) if p.meets_slo]
    if not dec_points:
        return None
    kv = _kv_ms(scheduler, request, max(c.option.tp for c, _ in dec_points))
    first_dec = min(p.ttft_ms for _, p in dec_points)
    slo = request.slo_ttft_ms
    spare = None if slo is None else slo - kv - first_dec
    if spare is not None and spare <= 0:
        return None
    isl, osl = request.input_len, request.output_len
    at_rate: dict[tuple[int, int, str], float] = {}  # (tp, pp, GPU) -> its TTFT at the rate it is planned for

    def prefill_rate(cand: Candidate, point: OperatingPoint) -> float:
        model = cand.options.pass_model(cand.option, cand.options.gpu.native_link)
        budget_ms = 2 * point.batch_prefill_ms if spare is None else PREFILL_SHARE * spare
        served, ttft = prefill_planned_rate(
            model, isl=isl, osl=osl, budget=point.max_num_batched_tokens, prompts=point.batch, ttft_budget_ms=budget_ms
        )
        at_rate[(cand.option.tp, cand.option.pp, cand.options.gpu.name)] = ttft
        return served

    prefill = _best(scheduler, prefill_req, rate, prefill_rate, MAX_ROLE_INSTANCES)
    if prefill is None:
        return None
    pre_ttft = at_rate[(prefill.capacity.tp, prefill.capacity.pp, prefill.capacity.gpu)]
    wait_ms = pre_ttft if spare is None else (1 - PREFILL_SHARE) * spare
    decode = _best(scheduler, decode_req, rate, lambda _c, p: planned_rate(p, p.ttft_ms + wait_ms), MAX_ROLE_INSTANCES)
    if decode is None:
        return None
    kv = _kv_ms(scheduler, request, decode.capacity.tp)
    ttft = pre_ttft + kv + decode.point.ttft_ms
    if slo is not None and ttft > slo:  # the options chosen are slower than the fastest ones budgeted for
        return None
    return PdSizing(prefill, decode, kv, ttft)


def choose_mode(
    scheduler: Scheduler, request: PlacementRequest, rate: float
) -> tuple[ModeChoice, Sizing | None, PdSizing | None]:
    """Aggregated instances or prefill/decode pools for ``rate``: whichever needs fewer GPUs (aggregated on
    a tie: one pool, no KV transfer); InputError when neither meets the SLO."""
    try:
        agg: Sizing | None = size_for_rate(scheduler, request, rate)
    except InputError:
        agg = None
    pd = size_pd_for_rate(scheduler, request, rate)
    if agg is None and pd is None:
        size_for_rate(scheduler, request, rate)  # raises with the reasons and remedies
    a_gpus = agg.capacity.gpus if agg else None
    d_gpus = pd.gpus if pd else None
    disagg = pd is not None and (agg is None or pd.gpus < agg.capacity.gpus)
    parts = []
    if agg is not None:
        c = agg.capacity
        parts.append(
            f"aggregated: {c.replicas} x tp={c.tp} pp={c.pp} at batch {c.batch} = {c.gpus} GPUs "
            f"(TPOT {agg.point.tpot_ms:.1f} ms with prompts riding along, TTFT {agg.point.ttft_ms:.0f} ms)"
        )
    else:
        parts.append("aggregated: no option meets the SLO")
    if pd is not None:
        p, d = pd.prefill.capacity, pd.decode.capacity
        parts.append(
            f"disaggregated: {p.replicas} prefill x tp={p.tp} + {d.replicas} decode x tp={d.tp} at batch {d.batch} = "
            f"{pd.gpus} GPUs (TPOT {pd.decode.point.tpot_ms:.1f} ms, TTFT {pd.ttft_ms:.0f} ms with a {pd.kv_ms:.1f} ms "
            "KV transfer)"
        )
    else:
        parts.append("disaggregated: no prefill and decode pools meet the SLO")
    verdict = (
        "disaggregated serves the rate with fewer GPUs"
        if disagg
        else "aggregated serves the rate with no more GPUs, one pool and no KV transfer"
    )
    choice = ModeChoice(
        chosen="disaggregated" if disagg else "aggregated",
        aggregated_gpus=a_gpus,
        disaggregated_gpus=d_gpus,
        prefill=pd.prefill.capacity.replicas if disagg and pd else 0,
        decode=pd.decode.capacity.replicas if disagg and pd else 0,
        why=f"{verdict}; " + "; ".join(parts),
    )
    return choice, agg, pd


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


__all__ = [
    "Capacity",
    "ModeChoice",
    "PdSizing",
    "Sizing",
    "choose_mode",
    "missing_gpus",
    "size_for_rate",
    "size_pd_for_rate",
    "slo_remedies",
]
