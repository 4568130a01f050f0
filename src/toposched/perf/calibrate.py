"""Fit the cost model's coefficients (``PerfConfig``) to measured samples; leave-one-out errors.

``predict_sample`` turns one measured setup into the model's figures, compared the way
reference/data/anchors-train.md says:

* ``ttft_ms``: the prefill of one ``input_len`` prompt (chunked by ``max_batched_tokens``); at
  concurrency ``c > 1`` the other ``c - 1`` sequences decode in the same pass (continuous batching),
  and the request first waits, on average, half a decode step of theirs (it arrives mid-iteration).
* ``tpot_ms``: the decode step at batch ``c`` and context ``input_len + output_len / 2``, inflated by
  the prefills of arriving requests: each of the other ``c - 1`` sequences prefills once per
  ``output_len`` steps, in a pass with the decodes (the extra time of that mixed pass).
* ``tokens_per_s``: output tokens/s of ``c`` sequences (all GPUs): ``c x output_len`` over the
  time to prefill all ``c`` prompts in budget-sized passes plus ``output_len - 1`` decode steps. For
  offline maximum-throughput runs the caller sets ``batch`` to the saturated batch (what the KV
  cache and the engine's batch limit allow). A run of ``num_requests`` identical requests runs in
  waves of ``c``; an open-loop run (``request_rate``) serves its arrivals, and no more than the
  closed loop at ``c`` would (``perf/serving_run.py`` ``ServingRun``, the same model the plans' operating points use).

The sample's ``engine`` is passed on to the model (``latency.prefill_launched_from_host``: whether a
prefill pays the host-launch cost).

``fit_config`` is a bounded least-squares fit of ``log(predicted / measured)`` over every measured
kind of every sample (Levenberg-Marquardt on a logistic reparametrisation of each field's bounds,
numpy only), with a weak pull towards ``base`` so fields the samples do not inform stay put.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from toposched.errors import InputError
from toposched.perf.coefficients import PerfConfig
from toposched.perf.engine_names import engine_of, known_engine
from toposched.perf.hardware import get_gpu
from toposched.perf.latency import PassModel
from toposched.perf.links import get_link
from toposched.perf.profile import ANY, Profile, ProfileEntry
from toposched.perf.samples import Sample
from toposched.perf.serving_run import ServingRun
from toposched.workload.catalog import resolve_model
from toposched.workload.dtypes import parse_kv_dtype, parse_weight_dtype
from toposched.workload.spec import ModelSpec

KINDS = ("ttft", "tpot", "throughput")
MEASURED = {"ttft": "ttft_ms", "tpot": "tpot_ms", "throughput": "tokens_per_s"}

DEFAULT_FIELDS: tuple[str, ...] = (
    "eta_mem",
    "eta_flops",
    "eta_flops_fp8",
    "roofline_p",
    "moe_tile_m",
    "moe_layer_us",
    "mla_layer_us",
    "prefill_kernel_factor",
    "step_overhead_ms",
    "prefill_overhead_ms",
    "comm_scale",
)
"""Fields fitted by default; ``kernel_us``, ``kernels_per_layer`` and ``eta_attn`` stay at their
literature values (``eta_attn``: only two published prompts are long enough for attention to
matter, and fitted on them it traded against the fixed prefill cost: docs/cost-model.md)."""

DEFAULT_MAX_BATCHED_TOKENS = 8192
"""Batched-token budget of one pass: TensorRT-LLM's build default ``max_num_tokens`` (8192) and
vLLM V1's serving default ``max_num_batched_tokens`` (8192, engines.md §1.1)."""

PRIOR_WEIGHT = 0.03
"""Weight of the pull towards ``base`` (per field, in logistic units) against the log-residuals."""

MIN_SAMPLES_PER_FIELD = 2
"""Samples a (GPU, weight dtype) needs per fitted field for its own profile entry (fewer share ``*``)."""


def _bounds(field: str) -> tuple[float, float]:
    info = PerfConfig.model_fields.get(field)
    if info is None:
        raise InputError(f"PerfConfig has no field {field!r}", fix=f"fit some of {', '.join(DEFAULT_FIELDS)}")
    lo = hi = None
    for m in info.metadata:
        lo = getattr(m, "ge", None) if getattr(m, "ge", None) is not None else lo
        lo = getattr(m, "gt", None) if getattr(m, "gt", None) is not None else lo
        hi = getattr(m, "le", None) if getattr(m, "le", None) is not None else hi
    if lo is None or hi is None or info.annotation is not float:
        raise InputError(f"PerfConfig.{field} is not a bounded float", fix="fit bounded float fields only")
    return float(lo), float(hi)


def _spec_of(sample: Sample) -> ModelSpec:
    wdt = parse_weight_dtype(sample.weight_dtype) if sample.weight_dtype else None
    kvd = parse_kv_dtype(sample.kv_dtype) if sample.kv_dtype else None
    return resolve_model(sample.model, weight_dtype=wdt, kv_dtype=kvd)


def predict_sample(
    sample: Sample, config: PerfConfig, *, max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
) -> dict[str, float]:
    """The model's ``ttft_ms``, ``tpot_ms`` and ``tokens_per_s`` for the kinds ``sample`` measured."""
    spec = _spec_of(sample)
    gpu = get_gpu(sample.gpu)
    link = get_link(sample.link or gpu.native_link)
    model = PassModel(spec, gpu, tp=sample.tp, pp=sample.pp, link=link, pp_link=link, cfg=config, engine=sample.engine)
    run = ServingRun(model, sample.batch, sample.input_len, sample.output_len, max_batched_tokens)
    out: dict[str, float] = {}
    if sample.ttft_ms is not None:
        out["ttft_ms"] = run.ttft_ms()
    if sample.tpot_ms is not None:
        out["tpot_ms"] = run.tpot_ms()
    if sample.tokens_per_s is not None:
        out["tokens_per_s"] = run.tokens_per_s(sample.num_requests, sample.request_rate)
    return out


def _residuals(samples: Sequence[Sample], config: PerfConfig) -> list[float]:
    res: list[float] = []
    for s in samples:
        pred = predict_sample(s, config)
        for key in MEASURED.values():
            measured = getattr(s, key)
            if measured is not None:
                res.append(math.log(pred[key] / measured))
    return res


def fit_config(
    samples: Sequence[Sample],
    *,
    base: PerfConfig | None = None,
    fields: Sequence[str] = DEFAULT_FIELDS,
    iterations: int = 40,
) -> PerfConfig:
    """Bounded least squares of the log relative errors over every measured kind of ``samples``."""
    if not samples:
        raise InputError("no samples to fit", fix="pass benchmark results with TTFT, TPOT or throughput")
    base = base or PerfConfig()
    bounds = [_bounds(f) for f in fields]
    lo = np.array([b[0] for b in bounds])
    hi = np.array([b[1] for b in bounds])

    def to_u(x: np.ndarray) -> np.ndarray:
        # start 1 % inside the bounds: at a bound the logistic map has no slope to leave it by
        t = np.clip((x - lo) / (hi - lo), 0.01, 0.99)
        return np.asarray(np.log(t / (1 - t)))

    def to_cfg(u: np.ndarray) -> PerfConfig:
        x = lo + (hi - lo) / (1 + np.exp(-u))
        return base.model_copy(update={f: float(v) for f, v in zip(fields, x, strict=True)})

    u0 = to_u(np.array([float(getattr(base, f)) for f in fields]))

    def resid(u: np.ndarray) -> np.ndarray:
        data = _residuals(samples, to_cfg(u))
        prior = PRIOR_WEIGHT * (u - u0)
        return np.concatenate([np.array(data), prior])

    u = u0.copy()
    r = resid(u)
    cost = float(r @ r)
    lam = 1e-2
    for _ in range(iterations):
        jac = np.empty((r.size, u.size))
        for j in range(u.size):
            du = np.zeros_like(u)
            du[j] = 1e-4
            jac[:, j] = (resid(u + du) - r) / 1e-4
        jtj = jac.T @ jac
        g = jac.T @ r
        improved = False
        for _ in range(8):
            step = np.linalg.solve(jtj + lam * np.diag(np.diag(jtj) + 1e-9), -g)
            u_new = u + step
            r_new = resid(u_new)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                u, r, gain, cost = u_new, r_new, cost - c_new, c_new
                lam = max(lam / 3, 1e-7)
                improved = True
                break
            lam *= 4
        if not improved or gain < 1e-10:
            break
    return to_cfg(u)


def relative_errors(sample: Sample, config: PerfConfig) -> dict[str, float]:
    """``predicted / measured - 1`` per kind the sample measured."""
    pred = predict_sample(sample, config)
    return {kind: pred[key] / getattr(sample, key) - 1 for kind, key in MEASURED.items() if key in pred}


def leave_one_out(samples: Sequence[Sample], **kw: Any) -> list[tuple[Sample, dict[str, float]]]:
    """Relative error per kind of each sample, predicted with the config fitted on all the others."""
    out: list[tuple[Sample, dict[str, float]]] = []
    for i, s in enumerate(samples):
        rest = [t for j, t in enumerate(samples) if j != i]
        out.append((s, relative_errors(s, fit_config(rest, **kw))))
    return out


def leave_group_out(
    samples: Sequence[Sample], group_of: Callable[[Sample], str], **kw: Any
) -> list[tuple[Sample, dict[str, float]]]:
    """Relative error per kind of each sample, predicted with the config fitted on the samples of every
    other group (``group_of``: a sample's publication, engine, GPU...): what the model makes of a whole
    source it never saw, where ``leave_one_out`` still fits on the held-out row's siblings. A sample
    whose group holds every sample is left out (nothing to fit on). In the order of ``samples``."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(group_of(s), []).append(i)
    errors: dict[int, dict[str, float]] = {}
    for members in groups.values():
        rest = [t for j, t in enumerate(samples) if j not in set(members)]
        if not rest:
            continue
        config = fit_config(rest, **kw)
        for i in members:
            errors[i] = relative_errors(samples[i], config)
    return [(samples[i], errors[i]) for i in sorted(errors)]


def mean_abs_by_kind(errors: Sequence[tuple[Sample, dict[str, float]]]) -> dict[str, float]:
    """Mean |relative error| per kind over ``errors`` (kinds with no sample are left out)."""
    by: dict[str, list[float]] = {}
    for _, errs in errors:
        for kind, e in errs.items():
            by.setdefault(kind, []).append(abs(e))
    return {kind: sum(v) / len(v) for kind, v in by.items()}


def fit_profile(
    samples: Sequence[Sample],
    *,
    name: str,
    source: str,
    base: PerfConfig | None = None,
    fields: Sequence[str] = DEFAULT_FIELDS,
    progress: Callable[[str], None] | None = None,
    scoped: bool = True,
) -> Profile:
    """A profile: a shared configuration fitted on all samples, and one entry per (GPU, weight dtype,
    engine, model family) with at least ``MIN_SAMPLES_PER_FIELD`` samples per fitted field, fitted on those
    alone (from ``base``, so its leave-one-out error never sees the held-out sample); LOO errors recorded in
    each entry.

    ``scoped`` (a user's calibration): the shared configuration is written once per (GPU, engine, model
    family) the samples ran, so the profile prices only what it saw and everything else falls back to
    the shipped profile (a sample without an engine matches any engine). Not scoped (the shipped profile,
    fitted on the published anchors): one catch-all ``*`` entry."""
    if not samples:
        raise InputError("no samples to fit a profile on", fix="pass benchmark results with TTFT/TPOT/throughput")
    say = progress or (lambda _msg: None)
    say(f"fitting the shared entry on {len(samples)} samples")
    shared = fit_config(samples, base=base, fields=fields)
    # leave-one-out needs a sample to fit on after one is held out
    loo = mean_abs_by_kind(leave_one_out(samples, base=base, fields=fields)) if len(samples) > 1 else {}
    scopes = sorted({(g, e, f) for g, _w, e, f in map(sample_scope, samples)}) if scoped else [(ANY, ANY, ANY)]
    entries = [
        ProfileEntry(
            gpu=gpu, engine=engine, model_family=family, config=shared, samples=len(samples), loo_mean_abs_error=loo
        )
        for gpu, engine, family in scopes
    ]
    groups: dict[tuple[str, str, str, str], list[Sample]] = {}
    for s in samples:
        gpu, wdt, engine, family = sample_scope(s)
        groups.setdefault((gpu, wdt, engine, family) if scoped else (gpu, wdt, ANY, ANY), []).append(s)
    for (gpu, wdt, engine, family), group in sorted(groups.items()):
        if len(group) < MIN_SAMPLES_PER_FIELD * len(fields):
            continue
        say(f"fitting {gpu}/{wdt}/{engine}/{family} on {len(group)} samples")
        cfg = fit_config(group, base=base, fields=fields)
        errs = mean_abs_by_kind(leave_one_out(group, base=base, fields=fields))
        entries.append(
            ProfileEntry(
                gpu=gpu,
                weight_dtype=wdt,
                engine=engine,
                model_family=family,
                config=cfg,
                samples=len(group),
                loo_mean_abs_error=errs,
            )
        )
    return Profile(name=name, source=source, entries=tuple(entries))


def sample_scope(sample: Sample) -> tuple[str, str, str, str]:
    """(GPU, weight dtype, engine, model family) of a sample, ``*`` for an engine or family it does not name.
    An engine the cost model does not know is an error: an entry for it would never price anything."""
    if sample.engine and not known_engine(sample.engine):
        raise InputError(
            f"sample {sample.source}: engine {sample.engine[:50]!r} is not one the cost model knows",
            fix="name it vllm, sglang, trtllm, tensorrt-llm or nvidia-nim (no version), or leave it out",
        )
    spec = _spec_of(sample)
    return (get_gpu(sample.gpu).name, str(spec.weight_dtype), engine_of(sample.engine) or ANY, spec.model_type or ANY)


__all__ = [
    "DEFAULT_FIELDS",
    "DEFAULT_MAX_BATCHED_TOKENS",
    "KINDS",
    "fit_config",
    "fit_profile",
    "leave_group_out",
    "leave_one_out",
    "mean_abs_by_kind",
    "predict_sample",
    "relative_errors",
    "sample_scope",
]
