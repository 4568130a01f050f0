"""Serving under continuous batching: one instance at a running batch, and the batch to run it at.

``perf/latency.py`` times one pass; an engine that serves (vLLM V1, SGLang, TensorRT-LLM's in-flight
batcher) keeps ``c`` sequences running and lets each new request's prompt ride in the decode steps
of the others, in chunks of at most ``max_num_batched_tokens``. :class:`ServingRun` gives what a
client of such an engine measures (the definitions ``calibrate`` fits, ``perf/calibrate.py``):

* ``ttft_ms``: one request's time to first token, not the prefill of the whole batch. The request
  waits half a step of the others on average (it arrives mid-iteration), then its prompt is
  prefilled in passes where the other ``c - 1`` sequences decode.
* ``tpot_ms``: the decode step at batch ``c`` and context ``input_len + output_len / 2``, plus the
  prefills of arriving requests: each of the other ``c - 1`` sequences prefills once per
  ``output_len`` steps, in a pass with the decodes (the extra time of that mixed pass).
* ``tokens_per_s``: output tokens/s of a benchmark run (closed or open loop).

:func:`operating_point` chooses the running batch of one instance for a workload (prompt and output
lengths) and its SLO, the rule of docs/solver.md "Operating point":

* at a batch ``c`` the instance completes ``c / e2e`` requests/s with its batch always full (``e2e =
  TTFT + (output_len - 1) x TPOT``); a TPOT SLO is met when ``ATTAINMENT`` (95 %) of the requests'
  mean TPOTs are under it (:meth:`ServingRun.tpot_ms` with ``z``), a TTFT SLO when the predicted TTFT is;
* requests that arrive at random need free slots and prefill capacity: the instance is planned for
  the Poisson rate at which 95 % of the requests wait for a slot no longer than the TTFT SLO leaves
  after their TTFT at that rate (:func:`planned_rate`, Erlang C; the prefill queue's mean wait,
  :func:`prefill_wait_ms`, is part of that TTFT); its goodput is that rate x ``output_len`` when the
  SLO is met, else 0;
* TTFT includes waiting for a prefill slot: prompts arrive at ``c / e2e`` per second and the engine
  prefills at most ``max_num_batched_tokens - c`` prompt tokens per step; the wait is the M/D/1 mean
  ``rho / (2 (1 - rho)) x service`` with ``rho`` the share of that prefill capacity the arrivals
  use. A batch whose arrivals need all of it (``rho >= 1``) cannot be sustained and is never chosen;
* with an SLO, the operating point is the largest batch that meets it (TPOT and TTFT grow with the
  batch, so one step larger would miss it), at most what the KV cache holds at the workload's lengths
  and the engine's batch limit: goodput grows with the batch up to there;
* without an SLO, the throughput knee: the smallest batch whose throughput is at least
  ``KNEE_FRACTION`` of the throughput at the largest batch the KV cache and the engine allow (past
  the knee, a larger batch buys little throughput for a longer TPOT).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from toposched.perf.latency import PassModel
from toposched.perf.serving_run import CommAdjust, ServingRun

ATTAINMENT = 0.95
"""The share of requests an SLO is met for: an operating point meets a TPOT SLO when this quantile of
one request's mean TPOT does, and a planned request rate keeps this share of requests from waiting
for a free sequence slot longer than the TTFT SLO leaves."""
Z_ATTAINMENT = 1.645
"""The standard normal quantile of ``ATTAINMENT``."""

KNEE_FRACTION = 0.9
"""Without an SLO, the operating point is the smallest batch reaching this share of the largest
batch's throughput (docs/solver.md)."""

Limit = Literal["slo-tpot", "slo-ttft", "kv-cache", "engine", "pass", "knee", "fixed"]
"""What stops the batch from being larger: the TPOT or TTFT SLO at the next batch, the KV cache (at the
workload's lengths), the engine's batch limit, a prefill instance's pass (the prompts a pass of the
token budget holds), the throughput knee (no SLO), or the caller's fixed batch."""

ServingRole = Literal["prefill", "decode"] | None
"""What one instance serves: prompts only, decodes only (a disaggregated deployment), or both (None)."""


@dataclass(frozen=True)
class OperatingPoint:
    """One instance at its running batch: per-request latencies, what it serves, why this batch."""

    batch: int
    """Running sequences (the engines' ``--max-num-seqs`` / ``--max-running-requests`` / ``--max_batch_size``)."""
    max_num_batched_tokens: int
    """Tokens of one pass (vLLM ``--max-num-batched-tokens``, SGLang ``--chunked-prefill-size``,
    TensorRT-LLM ``--max_num_tokens``)."""
    ttft_ms: float
    """One request's time to first token, the wait for a prefill slot included."""
    tpot_ms: float
    """Mean time per output token, the prefills of arriving requests included."""
    tpot_p95_ms: float
    """The ``ATTAINMENT`` quantile of one request's mean TPOT (what a TPOT SLO is checked against)."""
    full_rps: float
    """Requests per second the instance completes with its batch always full (closed loop)."""
    throughput_tokens_per_s: float
    """Output tokens/s with the batch always full."""
    meets_slo: bool
    served_rps: float
    """Requests per second the instance is planned for: the largest Poisson arrival rate at which
    ``ATTAINMENT`` of the requests find a free sequence slot within the TTFT SLO's slack
    (:func:`planned_rate`); 0 when the SLO is missed. Filled by :func:`operating_point`."""
    goodput_tokens_per_s: float
    """Output tokens/s of requests meeting the SLO at ``served_rps``."""
    limit: Limit
    batch_prefill_ms: float
    """The prefill of all ``batch`` prompts at once (a static batch's TTFT; labelled as such where shown)."""
    prefill_load: float
    """``rho``: the share of the prefill capacity the arrivals at ``served_rps`` use (0 before
    :func:`settle` plans the rate)."""
    max_batch: int
    """The largest batch the KV cache (at the workload's lengths) and the engine allow."""
    osl: int
    """Output tokens per request (goodput = served_rps x osl)."""
    isl: int = 0
    """Prompt tokens per request."""
    prefill_tokens_per_s: float = math.inf
    """Prompt tokens per second the instance can prefill beside its batch
    (``ServingRun.prefill_capacity_tokens_per_s``)."""


def evaluate(
    model: PassModel,
    batch: int,
    *,
    isl: int,
    osl: int,
    budget: int,
    slo_tpot_ms: float | None = None,
    slo_ttft_ms: float | None = None,
    comm: CommAdjust | None = None,
    limit: Limit = "fixed",
    max_batch: int | None = None,
    role: ServingRole = None,
) -> OperatingPoint:
    """The operating point at ``batch`` running sequences (module docstring for the definitions).

    ``role``: ``decode`` for a decode instance of a disaggregated deployment (no prompt rides along:
    TPOT is the decode step; its "TTFT" is the wait for its first step), ``prefill`` for a prefill
    instance (:func:`prefill_point`); None: an instance that serves both."""
    if role == "prefill":
        return prefill_point(
            model, batch, isl=isl, osl=osl, budget=budget, slo_ttft_ms=slo_ttft_ms, comm=comm, limit=limit,
            max_batch=max_batch,
        )  # fmt: skip
    run = ServingRun(model, batch, isl, osl, max(budget, batch), comm)  # vLLM: tokens >= seqs
    if role == "decode":
        return _decode_point(run, slo_tpot_ms, limit, max_batch)
    tpot = run.tpot_ms()
    tpot_p95 = run.tpot_ms(Z_ATTAINMENT)
    ttft = run.ttft_ms()
    rate = batch / ((ttft + (osl - 1) * tpot) / 1e3)
    meets = (slo_tpot_ms is None or tpot_p95 <= slo_tpot_ms) and (slo_ttft_ms is None or ttft <= slo_ttft_ms)
    throughput = rate * osl
    return OperatingPoint(
        batch=batch,
        max_num_batched_tokens=run.budget,
        ttft_ms=ttft,
        tpot_ms=tpot,
        tpot_p95_ms=tpot_p95,
        full_rps=rate,
        throughput_tokens_per_s=throughput,
        meets_slo=meets,
        served_rps=rate if meets else 0.0,
        goodput_tokens_per_s=throughput if meets else 0.0,
        limit=limit,
        batch_prefill_ms=run.batch_prefill_ms(),
        prefill_load=0.0,
        max_batch=max_batch if max_batch is not None else batch,
        osl=osl,
        isl=isl,
        prefill_tokens_per_s=run.prefill_capacity_tokens_per_s(),
    )


def _decode_point(run: ServingRun, slo_tpot_ms: float | None, limit: Limit, max_batch: int | None) -> OperatingPoint:
    """A decode-only instance: each step decodes the batch, nothing rides along; a request joins (its KV
    arrived) at the next step boundary, half a step later on average, and gets its token a step later."""
    step = run.decode_ms(run.c)
    first = 1.5 * step
    rate = run.c / ((first + (run.osl - 1) * step) / 1e3)
    meets = slo_tpot_ms is None or step <= slo_tpot_ms
    return OperatingPoint(
        batch=run.c, max_num_batched_tokens=run.budget, ttft_ms=first, tpot_ms=step, tpot_p95_ms=step,
        full_rps=rate, throughput_tokens_per_s=rate * run.osl, meets_slo=meets, served_rps=rate if meets else 0.0,
        goodput_tokens_per_s=rate * run.osl if meets else 0.0, limit=limit, batch_prefill_ms=0.0,
        prefill_load=0.0, max_batch=max_batch if max_batch is not None else run.c, osl=run.osl, isl=run.isl,
    )  # fmt: skip


def prefill_point(
    model: PassModel,
    prompts: int,
    *,
    isl: int,
    osl: int,
    budget: int,
    slo_ttft_ms: float | None = None,
    comm: CommAdjust | None = None,
    limit: Limit = "fixed",
    max_batch: int | None = None,
) -> OperatingPoint:
    """A prefill-only instance of a disaggregated deployment that prefills ``prompts`` prompts per pass
    (within ``budget`` tokens; a longer prompt is chunked over passes) and hands each on after its pass.
    A prompt waits half a pass on average, then its pass: that is its TTFT (the KV transfer and the
    decode side are the caller's). It decodes nothing: ``tpot_ms`` is the time of its step, one pass
    (what the cross-domain traffic per step is counted at); the throughput is the output tokens its
    prompts go on to generate."""
    prompts = max(1, min(prompts, budget // isl)) if isl <= budget else 1
    run = ServingRun(model, prompts, isl, osl, max(budget, prompts), comm)
    pass_ms = run.batch_prefill_ms()
    ttft = 1.5 * pass_ms
    rate = prompts / (pass_ms / 1e3)
    meets = slo_ttft_ms is None or ttft <= slo_ttft_ms
    return OperatingPoint(
        batch=prompts, max_num_batched_tokens=run.budget, ttft_ms=ttft, tpot_ms=pass_ms, tpot_p95_ms=pass_ms,
        full_rps=rate, throughput_tokens_per_s=rate * osl, meets_slo=meets, served_rps=rate if meets else 0.0,
        goodput_tokens_per_s=rate * osl if meets else 0.0, limit=limit, batch_prefill_ms=pass_ms,
        prefill_load=0.0, max_batch=max_batch if max_batch is not None else prompts, osl=osl, isl=isl,
    )  # fmt: skip


def prefill_planned_rate(
    model: PassModel, *, isl: int, osl: int, budget: int, prompts: int, ttft_budget_ms: float
) -> tuple[float, float]:
    """(requests/s, predicted TTFT ms) of a prefill instance that prefills up to ``prompts`` prompts per pass,
    at the largest Poisson rate whose requests get their first token within ``ttft_budget_ms``.

    At rate ``lambda`` a pass holds the prompts that arrived during the one before: ``k`` with
    ``k = lambda x pass(k)`` (at least 1, at most ``prompts``). A request waits at most one pass and then
    has its own: ``2 x pass(k)`` bounds its TTFT (the mean is ``1.5 x pass(k)``, what is returned). At
    ``prompts`` per pass the passes must keep up with ``ATTAINMENT`` of the arrivals' bursts: ``lambda <=
    ATTAINMENT x prompts / pass(prompts)``."""
    cache: dict[int, float] = {}

    def pass_ms(k: int) -> float:
        if k not in cache:
            cache[k] = ServingRun(model, k, isl, osl, max(budget, k)).batch_prefill_ms()
        return cache[k]

    def held(rate: float) -> int:
        k = 1
        for _ in range(20):  # the fixed point k = rate x pass(k), from below
            nxt = min(prompts, max(1, math.ceil(rate * pass_ms(k) / 1e3)))
            if nxt == k:
                break
            k = nxt
        return k

    top = ATTAINMENT * prompts / (pass_ms(prompts) / 1e3)
    if 2 * pass_ms(1) > ttft_budget_ms:
        return 0.0, 1.5 * pass_ms(1)
    lo, hi = 0.0, top
    for _ in range(40):
        mid = (lo + hi) / 2
        if 2 * pass_ms(held(mid)) <= ttft_budget_ms:
            lo = mid
        else:
            hi = mid
    return lo, 1.5 * pass_ms(held(lo))


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest ``b`` in ``[lo, hi]`` with ``ok(b)``, given ``ok(lo)`` and ``ok`` monotone (true then false)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def operating_point(
    model: PassModel,
    *,
    isl: int,
    osl: int,
    budget: int,
    max_batch: int,
    kv_limited: bool,
    slo_tpot_ms: float | None = None,
    slo_ttft_ms: float | None = None,
    comm: CommAdjust | None = None,
    role: ServingRole = None,
) -> OperatingPoint:
    """The batch this instance should run at (module docstring), at most ``max_batch``.

    ``kv_limited`` says whether ``max_batch`` is what the KV cache holds (else the engine's limit).
    When even one sequence misses the SLO, the point at batch 1 is returned with ``meets_slo`` false.
    ``role``: for a prefill instance the batch is the prompts per pass (:func:`prefill_point`), at most
    what one pass of ``budget`` tokens holds; a decode instance has nothing riding along its steps.
    """
    max_batch = max(1, max_batch)
    memo: dict[int, OperatingPoint] = {}

    def at(b: int) -> OperatingPoint:
        if b not in memo:
            memo[b] = evaluate(
                model, b, isl=isl, osl=osl, budget=budget, slo_tpot_ms=slo_tpot_ms, slo_ttft_ms=slo_ttft_ms,
                comm=comm, max_batch=max_batch, role=role,
            )  # fmt: skip
        return memo[b]

    cap_limit: Limit = "kv-cache" if kv_limited else "engine"
    if role == "prefill":  # prompts per pass: no more than a pass holds
        max_batch = max(1, min(max_batch, budget // isl))
        cap_limit = "pass"
    if slo_tpot_ms is None and slo_ttft_ms is None:
        best = at(max_batch).throughput_tokens_per_s
        knee = _largest(1, max_batch, lambda b: at(b).throughput_tokens_per_s < KNEE_FRACTION * best)
        if at(knee).throughput_tokens_per_s < KNEE_FRACTION * best:
            knee += 1  # the smallest batch reaching the share (``_largest`` found the last one below it)
        chosen = at(min(knee, max_batch))
        limit: Limit = "knee" if chosen.batch < max_batch else cap_limit
        return settle(chosen, limit, slo_ttft_ms, model=model, role=role)
    if not at(1).meets_slo:
        return settle(at(1), _missed(at(1), slo_tpot_ms), slo_ttft_ms, model=model, role=role)
    b = _largest(1, max_batch, lambda n: at(n).meets_slo)
    limit = cap_limit if b == max_batch else _missed(at(b + 1), slo_tpot_ms)
    return settle(at(b), limit, slo_ttft_ms, model=model, role=role)


def _missed(point: OperatingPoint, slo_tpot_ms: float | None) -> Limit:
    if slo_tpot_ms is not None and point.tpot_p95_ms > slo_tpot_ms:
        return "slo-tpot"
    return "slo-ttft"


def settle(
    point: OperatingPoint,
    limit: Limit,
    slo_ttft_ms: float | None,
    *,
    model: PassModel | None = None,
    role: ServingRole = None,
) -> OperatingPoint:
    """``point`` with why its batch is what it is, the request rate it is planned for and the TTFT at
    that rate (its queue waits included): :func:`planned_rate`, or for a prefill instance (``model``
    given) :func:`prefill_planned_rate`. A point missing its SLO is planned for no requests."""
    if not point.meets_slo:
        return replace(point, limit=limit, served_rps=0.0, goodput_tokens_per_s=0.0)
    if role == "prefill" and model is not None:
        budget_ms = slo_ttft_ms if slo_ttft_ms is not None else 2 * point.batch_prefill_ms
        rate, ttft = prefill_planned_rate(
            model, isl=point.isl, osl=point.osl, budget=point.max_num_batched_tokens, prompts=point.batch,
            ttft_budget_ms=budget_ms,
        )  # fmt: skip
        return replace(point, limit=limit, served_rps=rate, goodput_tokens_per_s=rate * point.osl, ttft_ms=ttft)
    rate = planned_rate(point, slo_ttft_ms)
    wait = prefill_wait_ms(point, rate)
    load = rate * point.isl / point.prefill_tokens_per_s if point.isl else 0.0
    return replace(
        point, limit=limit, served_rps=rate, goodput_tokens_per_s=rate * point.osl, ttft_ms=point.ttft_ms + wait,
        prefill_load=load,
    )  # fmt: skip


def prefill_wait_ms(point: OperatingPoint, rate: float) -> float:
    """The mean wait of a prompt for prefill capacity at ``rate`` requests/s: M/D/1 over the prompt tokens
    the instance prefills beside its batch (``rho / (2 (1 - rho))`` prefill times); 0 with one slot (a
    request then waits for the slot, :func:`planned_rate`), inf at or past the capacity."""
    if point.batch <= 1 or not point.isl or not math.isfinite(point.prefill_tokens_per_s):
        return 0.0
    rho = rate * point.isl / point.prefill_tokens_per_s
    if rho >= 1.0:
        return math.inf
    return rho / (2.0 * (1.0 - rho)) * point.isl / point.prefill_tokens_per_s * 1e3


def erlang_c(servers: int, load: float) -> float:
    """The probability that an arrival waits in an M/M/c queue of ``servers`` at offered ``load``
    (Erlangs, ``< servers``), by the Erlang-B recursion (stable for thousands of servers)."""
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    rho = load / servers
    return b / (1.0 - rho + rho * b)


def planned_rate(point: OperatingPoint, slo_ttft_ms: float | None, attainment: float = ATTAINMENT) -> float:
    """The largest Poisson arrival rate one instance at ``point`` serves with ``attainment`` of the
    requests waiting for a free sequence slot no longer than the TTFT SLO leaves.

    The ``batch`` slots are the servers of an M/M/c queue, each holding a request for its end-to-end
    time at the full batch (``batch / full_rps``); a request waits longer than ``t`` with probability
    ``C(c, a) exp(-(c mu - lambda) t)`` (Erlang C). ``t`` is the TTFT SLO less the predicted TTFT at that
    rate (``point.ttft_ms`` and the wait for prefill capacity, :func:`prefill_wait_ms`); without a TTFT
    SLO the budget is twice the TTFT with no wait (a request waits, for prefill capacity and for a slot
    together, no longer than its own TTFT takes, ``attainment`` of the time)."""
    c = point.batch
    mu = point.full_rps / c  # per slot
    if mu <= 0:
        return 0.0
    miss = 1.0 - attainment

    budget_ms = slo_ttft_ms if slo_ttft_ms is not None else 2 * point.ttft_ms

    def ok(rate: float) -> bool:
        ttft = point.ttft_ms + prefill_wait_ms(point, rate)
        slack_ms = budget_ms - ttft
        if not math.isfinite(ttft) or slack_ms < 0:
            return False
        return erlang_c(c, rate / mu) * math.exp(-(c * mu - rate) * slack_ms / 1e3) <= miss

    lo, hi = 0.0, c * mu
    for _ in range(40):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


__all__ = [
    "ATTAINMENT",
    "KNEE_FRACTION",
    "OperatingPoint",
    "erlang_c",
    "evaluate",
    "operating_point",
    "planned_rate",
    "prefill_planned_rate",
    "prefill_point",
    "prefill_wait_ms",
    "settle",
]
