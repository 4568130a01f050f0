"""Fitting the cost model's coefficients (``PerfConfig``) to measured samples.

``fit_config`` is a bounded robust (soft-L1, ``ROBUST_SCALE``) least-squares fit of
``log(predicted / measured)`` over every measured kind of every sample (Levenberg-Marquardt on a
logistic reparametrisation of each field's bounds, numpy only), with a weak pull towards ``base`` so
fields the samples do not inform stay put. ``fit_engine_configs`` adds host costs per engine
(``ENGINE_FIELDS``) to pooled coefficients. ``leave_one_out`` and ``leave_group_out`` refit with a
``Fitter`` (``pooled_fitter``, ``engine_fitter``), warm-started from the fit on all samples.

The sample says where its TTFT was measured (``ttft_at``): a client's TTFT pays
``client_overhead_ms`` once, the engine's own metrics do not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from toposched.errors import InputError
from toposched.perf.coefficients import PerfConfig
from toposched.perf.engine_names import engine_of
from toposched.perf.sample_predict import MEASURED, predict_sample
from toposched.perf.samples import Sample

OPERATOR_FIELDS: tuple[str, ...] = ("eta_mem", "eta_flops", "eta_flops_fp8", "roofline_p")
"""The GEMM term's efficiencies and roofline, measured on operator tables (``PerfConfig``'s defaults, from
NVIDIA's GEMM tables: ``benchmarks/gemm_tables.py``) and not fitted on the published serving rows: fitted
there they stood for other terms (BF16 ``eta_flops`` 0.58 against 0.76 measured). Held out by publication,
the fit without them did as well (docs/cost-model.md). A user's ``calibrate`` fits them
(``CALIBRATION_FIELDS``): its runs are on the GPU and engine it prices. The GEMMs' fixed costs
(``gemm_us``, ``gemm_us_fp8``), measured on the same tables, are fitted by nobody: a few end-to-end runs
cannot tell a kernel's fixed cost from the pass's overheads. A profile written before ``gemm_us_fp8``
existed prices FP8 GEMMs with its default (7.3 us); one written before the width curve
(``gemm_n_half``) keeps its flat GEMM efficiencies (``perf/profile.py``)."""

DEFAULT_FIELDS: tuple[str, ...] = (
    "moe_tile_m",
    "moe_layer_us",
    "mla_layer_us",
    "prefill_kernel_factor",
    "step_overhead_ms",
    "prefill_overhead_ms",
    "client_overhead_ms",
    "comm_scale",
)
"""Fields fitted on the published serving rows (the shipped profile, ``benchmarks/anchors_loo.py``);
``OPERATOR_FIELDS``, ``gemm_us``/``gemm_us_fp8``, ``gemm_n_half``/``gemm_n_half_fp8``, the attention
tables' fields, ``kernel_us`` and ``kernels_per_layer`` stay at their measured or literature values
(``eta_attn``: only two published prompts are long enough for attention to matter, and fitted on them
it traded against the fixed prefill cost: docs/cost-model.md)."""

CALIBRATION_FIELDS: tuple[str, ...] = OPERATOR_FIELDS + DEFAULT_FIELDS
"""Fields a user's ``calibrate`` fits on their own runs."""

PRIOR_WEIGHT = 0.03
"""Weight of the pull towards ``base`` (per field, in logistic units) against the log-residuals."""

GAIN_STOP = 1e-6
"""The fit stops when an iteration lowers the sum of squared log-residuals by less than this (a change of
well under 0.1 % in any prediction)."""


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


Fitter = Callable[[Sequence[Sample]], Callable[[Sample], PerfConfig]]
"""Samples -> what prices each sample (``leave_one_out``/``leave_group_out`` refit with it)."""

ENGINE_FIELDS: tuple[str, ...] = ("step_overhead_ms", "prefill_overhead_ms", "prefill_kernel_factor")
"""The host costs an engine has of its own (``fit_engine_configs``): a decode step's, a prefill pass's, and
the small-kernel factor of a prefill launched from Python."""

ENGINE_PRIOR_WEIGHT = 1.0
"""Pull of an engine's own host costs towards the pooled ones (logistic units), against the log-residuals:
an engine with few rows stays near the pool instead of fitting its rows' noise."""

MIN_ENGINE_SAMPLES = 4
"""Samples an engine needs in a fit for host costs of its own (fewer: it is priced by the pooled ones)."""


def _levenberg_marquardt(
    u0: np.ndarray,
    per_sample: Callable[[np.ndarray, int], np.ndarray],
    count: int,
    affects: Sequence[Sequence[int]],
    prior: Callable[[np.ndarray], np.ndarray],
    iterations: int,
) -> np.ndarray:
    """Minimise the squared residuals of ``count`` samples (``per_sample(u, i)``) plus ``prior(u)``;
    parameter ``j`` moves the residuals of the samples ``affects[j]`` only (the Jacobian skips the rest)."""

    def parts(u: np.ndarray) -> list[np.ndarray]:
        return [per_sample(u, i) for i in range(count)]

    def flat(ps: list[np.ndarray], u: np.ndarray) -> np.ndarray:
        return np.concatenate([*ps, prior(u)])

    u = u0.copy()
    ps = parts(u)
    r = flat(ps, u)
    cost = float(r @ r)
    lam = 1e-2
    for _ in range(iterations):
        jac = np.empty((r.size, u.size))
        for j in range(u.size):
            du = np.zeros_like(u)
            du[j] = 1e-4
            moved = list(ps)
            for i in affects[j]:
                moved[i] = per_sample(u + du, i)
            jac[:, j] = (flat(moved, u + du) - r) / 1e-4
        jtj = jac.T @ jac
        g = jac.T @ r
        improved = False
        gain = 0.0
        for _ in range(8):
            step = np.linalg.solve(jtj + lam * np.diag(np.diag(jtj) + 1e-9), -g)
            u_new = u + step
            ps_new = parts(u_new)
            r_new = flat(ps_new, u_new)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                u, ps, r, gain, cost = u_new, ps_new, r_new, cost - c_new, c_new
                lam = max(lam / 3, 1e-7)
                improved = True
                break
            lam *= 4
        if not improved or gain < GAIN_STOP:
            break
    return u


class _Logistic:
    """Each fitted field on its bounds through a logistic map (the fit moves unbounded ``u``)."""

    def __init__(self, fields: Sequence[str]) -> None:
        bounds = [_bounds(f) for f in fields]
        self.fields = tuple(fields)
        self.lo = np.array([b[0] for b in bounds])
        self.hi = np.array([b[1] for b in bounds])

    def to_u(self, x: np.ndarray) -> np.ndarray:
        # start 1 % inside the bounds: at a bound the logistic map has no slope to leave it by
        t = np.clip((x - self.lo) / (self.hi - self.lo), 0.01, 0.99)
        return np.asarray(np.log(t / (1 - t)))

    def to_x(self, u: np.ndarray) -> np.ndarray:
        return np.asarray(self.lo + (self.hi - self.lo) / (1 + np.exp(-u)))

    def config(self, base: PerfConfig, u: np.ndarray) -> PerfConfig:
        return base.model_copy(update={f: float(v) for f, v in zip(self.fields, self.to_x(u), strict=True)})


ROBUST_SCALE = 0.2
"""Log-residual beyond which a sample's pull grows like a square root, not linearly (soft-L1 loss): a
few rows the model cannot describe (a warm-up transient in a published mean) do not drag every coefficient."""


def _soft_l1(r: np.ndarray) -> np.ndarray:
    """The residual whose square is the soft-L1 loss ``2 s^2 (sqrt(1 + (r/s)^2) - 1)`` of ``r``: ``r`` for
    small residuals, ``sqrt(2 s |r|)`` for large ones."""
    z = (r / ROBUST_SCALE) ** 2
    return np.asarray(r * np.sqrt(2.0 / (1.0 + np.sqrt(1.0 + z))))  # the same, without cancellation at small z


def _sample_residuals(sample: Sample, config: PerfConfig) -> np.ndarray:
    pred = predict_sample(sample, config)
    logs = np.array([math.log(pred[k] / getattr(sample, k)) for k in MEASURED.values() if getattr(sample, k)])
    return _soft_l1(logs)


def fit_config(
    samples: Sequence[Sample],
    *,
    base: PerfConfig | None = None,
    fields: Sequence[str] = DEFAULT_FIELDS,
    iterations: int = 40,
    start: PerfConfig | None = None,
) -> PerfConfig:
    """Bounded least squares of the log relative errors over every measured kind of ``samples``.

    The fit starts from ``start`` (default ``base``; a refit on fewer samples starts from the fit on all
    of them and converges in a few iterations) and is pulled towards ``base``."""
    if not samples:
        raise InputError("no samples to fit", fix="pass benchmark results with TTFT, TPOT or throughput")
    base = base or PerfConfig()
    m = _Logistic(fields)
    u0 = m.to_u(np.array([float(getattr(base, f)) for f in fields]))
    every = range(len(samples))
    u = _levenberg_marquardt(
        m.to_u(np.array([float(getattr(start, f)) for f in fields])) if start is not None else u0,
        lambda u, i: _sample_residuals(samples[i], m.config(base, u)),
        len(samples),
        [every] * len(fields),
        lambda u: PRIOR_WEIGHT * (u - u0),
        iterations,
    )
    return m.config(base, u)


def fit_engine_configs(
    samples: Sequence[Sample],
    *,
    base: PerfConfig | None = None,
    fields: Sequence[str] = DEFAULT_FIELDS,
    engine_fields: Sequence[str] = ENGINE_FIELDS,
    iterations: int = 40,
    start: tuple[PerfConfig, dict[str, PerfConfig]] | None = None,
) -> tuple[PerfConfig, dict[str, PerfConfig]]:
    """One fit of pooled coefficients and, for each engine with ``MIN_ENGINE_SAMPLES`` samples, its own
    ``engine_fields`` (host costs): (the pooled configuration, configuration per engine).

    An engine's field is the pooled one moved by an offset (logistic units) pulled towards 0 with
    ``ENGINE_PRIOR_WEIGHT``: every sample informs the pooled coefficients, an engine's samples its offsets.
    An engine with fewer samples, or none, is priced by the pooled configuration. ``start``: a previous
    result to start from (``fit_config``'s ``start``)."""
    if not samples:
        raise InputError("no samples to fit", fix="pass benchmark results with TTFT, TPOT or throughput")
    base = base or PerfConfig()
    m = _Logistic(fields)
    own = [f for f in engine_fields if f in m.fields]
    counts: dict[str, int] = {}
    for s in samples:
        e = engine_of(s.engine)
        if e:
            counts[e] = counts.get(e, 0) + 1
    engines = sorted(e for e, n in counts.items() if n >= MIN_ENGINE_SAMPLES)
    k = len(m.fields)
    slot = {(e, f): k + a * len(own) + b for a, e in enumerate(engines) for b, f in enumerate(own)}
    u0 = np.concatenate([m.to_u(np.array([float(getattr(base, f)) for f in fields])), np.zeros(len(slot))])
    index = {f: j for j, f in enumerate(m.fields)}

    def config(u: np.ndarray, engine: str | None) -> PerfConfig:
        shared = u[:k].copy()
        if engine in engines:
            for f in own:
                shared[index[f]] += u[slot[(engine, f)]]
        return m.config(base, shared)

    names = [engine_of(s.engine) for s in samples]
    affects: list[Sequence[int]] = [range(len(samples))] * k
    for e in engines:
        mine = [i for i, n in enumerate(names) if n == e]
        affects += [mine] * len(own)

    def prior(u: np.ndarray) -> np.ndarray:
        return np.concatenate([PRIOR_WEIGHT * (u[:k] - u0[:k]), ENGINE_PRIOR_WEIGHT * u[k:]])

    first = u0.copy()
    if start is not None:
        pooled = m.to_u(np.array([float(getattr(start[0], f)) for f in fields]))
        first[:k] = pooled
        for (e, f), j in slot.items():
            if e in start[1]:
                own_u = m.to_u(np.array([float(getattr(start[1][e], g)) for g in fields]))
                first[j] = own_u[index[f]] - pooled[index[f]]
    u = _levenberg_marquardt(
        first, lambda u, i: _sample_residuals(samples[i], config(u, names[i])), len(samples), affects, prior, iterations
    )
    return config(u, None), {e: config(u, e) for e in engines}


def pooled_fitter(*, warm: Sequence[Sample] | None = None, start: PerfConfig | None = None, **kw: Any) -> Fitter:
    """One configuration for every sample (``fit_config``). ``warm``: fit these (all the samples) once and
    start every refit from that fit; ``start``: that fit, done already."""
    if start is None and warm:
        start = fit_config(warm, **kw)

    def fit(samples: Sequence[Sample]) -> Callable[[Sample], PerfConfig]:
        config = fit_config(samples, start=start, **kw)
        return lambda _s: config

    return fit


def engine_fitter(*, warm: Sequence[Sample] | None = None, **kw: Any) -> Fitter:
    """Pooled coefficients with host costs per engine (``fit_engine_configs``); a sample of an engine with
    no configuration of its own is priced by the pooled one. ``warm``: as ``pooled_fitter``'s."""
    start = fit_engine_configs(warm, **kw) if warm else None

    def fit(samples: Sequence[Sample]) -> Callable[[Sample], PerfConfig]:
        pooled, per_engine = fit_engine_configs(samples, start=start, **kw)
        return lambda s: per_engine.get(engine_of(s.engine) or "", pooled)

    return fit


__all__ = [
    "CALIBRATION_FIELDS",
    "DEFAULT_FIELDS",
    "ENGINE_FIELDS",
    "OPERATOR_FIELDS",
    "Fitter",
    "engine_fitter",
    "fit_config",
    "fit_engine_configs",
    "pooled_fitter",
]
