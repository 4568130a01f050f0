"""The cost model's MoE term against NVIDIA's measured fused-MoE tables (aiconfigurator-core 0.12.0).

    .venv/bin/python benchmarks/moe_tables.py            # fits and errors by GPU / engine / dtype / tokens
    .venv/bin/python benchmarks/moe_tables.py --json     # the fitted coefficients as one JSON object
    .venv/bin/python benchmarks/moe_tables.py --per-engine [--json]   # only the per-engine fits (below)

``tests/data/reference/data/aiconfigurator_moe.csv`` (``benchmarks/aic_extract.py``) holds 6,102
latencies of one fused MoE layer (the experts' grouped GEMMs with their routing permutes) measured by
aiconfigurator's collectors inside vLLM, SGLang and TensorRT-LLM on A100 (SGLang, BF16), H100 and H200:
the expert shapes of Mixtral-8x7B/8x22B, Qwen3-235B-A22B and DeepSeek-V3/R1, expert TP 1-8, 1-16,384
tokens spread evenly over the experts, BF16, per-tensor FP8 and block-scaled FP8. The model's form for
one MoE layer (``perf/latency.py``), with the GEMM coefficients measured on the GEMM tables
(``PerfConfig``'s defaults: ``eta_mem``, ``roofline_p``, the GEMM efficiency of the dtype, two GEMM fixed
costs for the MLP pair) held:

    touched = E (1 - (1 - k/E)^T)                 experts a pass of T tokens routes to
    rows    = touched x max(T k / touched, moe_tile_m)
    T_mem   = touched x 3 h I / tp x bytes / (eta_mem x BW)
    T_cmp   = rows x 2 x (3 h I / tp + n_half (h + I / tp)) / (eta x peak)     (the GEMMs' width curve)
    T       = (T_mem^p + T_cmp^p)^(1/p) + 2 gemm_us(dtype) + moe_layer_us

Fitted: ``moe_tile_m`` (token rows a touched expert costs at least: a grouped-GEMM tile) and
``moe_layer_us`` (routing, permute and unpermute per layer), the two MoE coefficients the shipped profile
fitted on the serving rows before (9.9 and 26 us). Reported beside them: a grouped-GEMM efficiency of
its own per dtype (``eta_moe``/``eta_moe_fp8``, as a fraction of the dense GEMM efficiency of the dtype),
which the model does not have, to show what it would add. Log-ratio least squares over every row, engines
pooled; leave-one-GPU-out and leave-one-engine-out refit without the held-out group.

Per engine (after the pooled fits; ``--per-engine`` prints only this part): the tables run the same shape
and dtype 2-4x apart between engines, so each engine's rows are fitted on their own, with a grouped-GEMM
efficiency per dtype (``eta_moe``, a fraction of the dense GEMM efficiency of the dtype, at most the
dtype's peak) and an HBM fraction per dtype (``mem_moe``, a fraction of ``eta_mem``, at most the peak):

    T_mem = touched x 3 h I / tp x bytes / (eta_mem x mem_moe x BW)
    T_cmp = rows x 2 x 3 h I / tp / (eta x eta_moe x n / (n + moe_n_half) x peak),   n = I / tp

``n / (n + moe_n_half)`` is the curve a flat efficiency misses: a grouped GEMM whose experts are thin
(Qwen3-235B's 1,536-wide experts at TP 8 are 192 wide) runs far below a wide one at the same tokens per
expert. A curve over tokens per expert ``t / (t + t_half)`` is printed beside it: it is the model's tile
made soft (rows = touched x (t + t_half) instead of touched x max(t, moe_tile_m)). Left out of the
per-engine fits and printed beside: the (engine, model, dtype) cells whose rows take less time than
reading the experts the model's touched count routes to at the GPU's HBM peak (so their collectors
route to fewer distinct experts than uniform top-k). Errors: in sample, leave-one-GPU-out and leave-one-model-out
(refit on the engine's other GPUs / expert shapes).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import gemm_tables  # the benchmark next to this one
import numpy as np
from packaging.version import Version
from scipy.optimize import least_squares

from toposched.perf import get_gpu
from toposched.perf.coefficients import PerfConfig
from toposched.perf.latency import roofline
from toposched.perf.profile import active_config

TABLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "data" / "aiconfigurator_moe.csv"
DATA = Path(__file__).resolve().parents[1] / "src" / "toposched" / "data" / "moe_engines.json"
WEIGHT_BYTES = {"bfloat16": 2.0, "fp8": 1.0, "fp8_block": 1.0}
NAMES = ("moe_tile_m", "moe_layer_us")
NAMES_ETA = (*NAMES, "eta_moe", "eta_moe_fp8")


@dataclass(frozen=True)
class Row:
    gpu: str
    engine: str
    dtype: str
    tokens: int
    hidden: int
    inter: int
    experts: int
    topk: int
    tp: int
    measured_us: float
    version: str = ""

    @property
    def model(self) -> str:
        """The catalog model whose expert shape this is."""
        return MODELS.get((self.experts, self.hidden, self.inter), f"{self.experts}x{self.hidden}x{self.inter}")


def load(path: Path = TABLE) -> list[Row]:
    with path.open(newline="") as f:
        rows = [
            Row(
                r["gpu"],
                r["engine"],
                r["dtype"],
                *(int(r[k]) for k in ("tokens", "hidden", "inter", "experts", "topk", "tp")),
                float(r["latency_ms"]) * 1e3,
                r["version"],
            )
            for r in csv.DictReader(f)
        ]
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def predict_us(row: Row, x: tuple[float, ...] | np.ndarray, c: PerfConfig | None = None) -> float:
    """One MoE layer's time by the model; ``x`` = (moe_tile_m, moe_layer_us[, eta_moe, eta_moe_fp8])."""
    c = c or PerfConfig()
    tile, layer_us = x[0], x[1]
    scale = 1.0 if len(x) < 4 else (x[2] if row.dtype == "bfloat16" else x[3])
    g = get_gpu(row.gpu)
    fp8 = row.dtype != "bfloat16" and g.fp8_flops is not None
    peak = g.fp8_flops if fp8 and g.fp8_flops else g.bf16_flops
    eta = (c.eta_flops_fp8 if fp8 else c.eta_flops) * scale
    n_half = c.gemm_n_half_fp8 if fp8 else c.gemm_n_half
    touched = row.experts * (1.0 - (1.0 - row.topk / row.experts) ** row.tokens)
    params = 3.0 * row.hidden * row.inter / row.tp
    mem = touched * params * WEIGHT_BYTES[row.dtype] / (g.hbm_bandwidth * c.eta_mem)
    rows = touched * max(row.tokens * row.topk / touched, tile)
    # the GEMMs' width curve, as the model charges it: n_half more columns on gate+up (k = hidden) and down
    cmp = rows * 2.0 * (params + n_half * (row.hidden + row.inter / row.tp)) / (peak * eta)
    fixed = 2 * (c.gemm_us_fp8 if fp8 else c.gemm_us)
    return roofline(mem, cmp, c.roofline_p) * 1e6 + fixed + layer_us


def errors(rows: list[Row], x: tuple[float, ...] | np.ndarray) -> np.ndarray:
    return np.array([predict_us(r, x) / r.measured_us - 1 for r in rows])


def fit(rows: list[Row], with_eta: bool = False) -> tuple[float, ...]:
    x0 = [16.0, 20.0] + ([1.0, 1.0] if with_eta else [])
    lo = [1.0, 0.0] + ([0.1, 0.1] if with_eta else [])
    hi = [256.0, 2000.0] + ([1.5, 1.5] if with_eta else [])

    def resid(x: np.ndarray) -> np.ndarray:
        return np.log1p(errors(rows, x))

    return tuple(float(v) for v in least_squares(resid, x0, bounds=(lo, hi)).x)


def summary(label: str, e: np.ndarray) -> str:
    return gemm_tables.summary(label, e, width=44)


def _held_out(rows: list[Row], key: str, with_eta: bool) -> np.ndarray:
    return gemm_tables.held_out(rows, key, lambda part: fit(part, with_eta), errors)


# --- per engine ------------------------------------------------------------------------------------------------

DTYPES = ("bfloat16", "fp8", "fp8_block")
MODELS = {(8, 4096, 14336): "Mixtral-8x7B", (8, 6144, 16384): "Mixtral-8x22B", (128, 4096, 1536): "Qwen3-235B-A22B",
          (256, 7168, 2048): "DeepSeek-V3"}  # fmt: skip
ENGINE_TABLE: dict[str | None, str] = {
    "vllm": "vllm",
    "sglang": "sglang",
    "tensorrt-llm-pytorch": "trtllm",  # trtllm-serve --backend pytorch (toposched's `launch trtllm`)
    "tensorrt-llm": "trtllm",  # TensorRT engines: TensorRT-LLM's MoE kernels too
    "nvidia-nim": "trtllm",  # NIM's TensorRT-LLM profiles
    None: "vllm",  # unnamed or unknown: the cost model prices it like vLLM (engine_names.engine_of)
}
"""The engine whose table prices an engine name of the cost model (``engine_names.engine_of``)."""
MOE_ANCHOR_VERSIONS = {"vllm": "0.11.0, 0.19.0", "sglang": "0.5.5-0.5.7", "trtllm": "0.15.0 (TensorRT), 0.21.0rc2, 1.0"}
"""Engine versions of the MoE serving anchors (``anchors-train*.json``), beside the tables' versions."""


@dataclass(frozen=True)
class Form:
    """Which terms a per-engine fit has beside ``moe_tile_m``, ``moe_layer_us`` and ``eta_moe`` per dtype."""

    label: str
    mem: bool = False  # an HBM fraction per dtype
    width: bool = False  # eta x n / (n + moe_n_half), n = inter / tp
    tokens: bool = False  # eta x t / (t + t_half), t = tokens per touched expert


FORMS = (
    Form("flat eta_moe per dtype"),
    Form("+ tokens curve t/(t+t_half)", tokens=True),
    Form("+ mem_moe per dtype", mem=True),
    Form("+ mem_moe + width curve n/(n+n_half)", mem=True, width=True),
    Form("+ mem_moe + width + tokens curves", mem=True, width=True, tokens=True),
)
RECOMMENDED = FORMS[3]


@dataclass(frozen=True)
class EngineFit:
    engine: str
    moe_tile_m: float
    moe_layer_us: float
    moe_n_half: float  # 0: no width curve
    t_half: float  # 0: no tokens curve
    eta_moe: dict[str, float]  # fitted dtypes only, x the dense GEMM efficiency of the dtype
    mem_moe: dict[str, float]  # the same dtypes, x eta_mem (1.0 without the term)

    def coefficients(self) -> dict[str, object]:
        out: dict[str, object] = {k: round(v, 4) for k, v in vars(self).items() if isinstance(v, float)}
        out.update(eta_moe={k: round(v, 4) for k, v in self.eta_moe.items()})
        return out | {"mem_moe": {k: round(v, 4) for k, v in self.mem_moe.items()}}


def arrays(rows: list[Row], c: PerfConfig | None = None) -> dict[str, np.ndarray]:
    """The rows' columns and the model's per-row constants (``predict_us``'s, vectorised)."""
    c = c or PerfConfig()
    gpus = {name: get_gpu(name) for name in {r.gpu for r in rows}}
    g = [gpus[r.gpu] for r in rows]
    fp8 = np.array([r.dtype != "bfloat16" and x.fp8_flops is not None for r, x in zip(rows, g, strict=True)])
    tokens, experts, topk = (np.array([getattr(r, k) for r in rows], float) for k in ("tokens", "experts", "topk"))
    touched = experts * (1.0 - (1.0 - topk / experts) ** tokens)
    return {
        "dtype": np.array([DTYPES.index(r.dtype) for r in rows]),
        "tokens": tokens,
        "touched": touched,
        "t": tokens * topk / touched,
        "n": np.array([r.inter / r.tp for r in rows]),
        "params": np.array([3.0 * r.hidden * r.inter / r.tp for r in rows]),
        # the GEMMs' width curve (PerfConfig.gemm_n_half*): n_half more columns on gate+up and down
        "curve": np.array([r.hidden + r.inter / r.tp for r in rows]) * np.where(fp8, c.gemm_n_half_fp8, c.gemm_n_half),
        "bytes": np.array([WEIGHT_BYTES[r.dtype] for r in rows]),
        "bw": np.array([x.hbm_bandwidth * c.eta_mem for x in g]),
        "flops": np.array([(x.fp8_flops or 0.0) if f else x.bf16_flops for x, f in zip(g, fp8, strict=True)])
        * np.where(fp8, c.eta_flops_fp8, c.eta_flops),
        "fixed": 2 * np.where(fp8, c.gemm_us_fp8, c.gemm_us),
        "p": np.full(len(rows), c.roofline_p),
        "measured": np.array([r.measured_us for r in rows]),
    }


def engine_predict_us(a: dict[str, np.ndarray], f: EngineFit) -> np.ndarray:
    """One MoE layer per row by the per-engine form; NaN for a dtype ``f`` has no figures for."""
    eta = np.array([f.eta_moe.get(d, np.nan) for d in DTYPES])[a["dtype"]]
    mem_s = np.array([f.mem_moe.get(d, np.nan) for d in DTYPES])[a["dtype"]]
    mem = a["touched"] * a["params"] * a["bytes"] / (a["bw"] * mem_s)
    eta = eta * a["n"] / (a["n"] + f.moe_n_half) * a["t"] / (a["t"] + f.t_half)
    cmp = a["touched"] * np.maximum(a["t"], f.moe_tile_m) * 2.0 * (a["params"] + a["curve"]) / (a["flops"] * eta)
    top = np.maximum(mem, cmp)
    p = a["p"]
    return top * ((mem / top) ** p + (cmp / top) ** p) ** (1.0 / p) * 1e6 + a["fixed"] + f.moe_layer_us


def engine_errors(rows: list[Row], f: EngineFit) -> np.ndarray:
    a = arrays(rows)
    return engine_predict_us(a, f) / a["measured"] - 1


def fit_engine(rows: list[Row], form: Form = RECOMMENDED, c: PerfConfig | None = None) -> EngineFit:
    """Log-ratio least squares of ``form`` on ``rows`` (one engine's); ``eta_moe``/``mem_moe`` for the
    dtypes the rows have, each bounded so the grouped GEMM reaches at most the dtype's peak."""
    c = c or PerfConfig()
    a = arrays(rows, c)
    present = [d for d in DTYPES if any(r.dtype == d for r in rows)]
    cap = {"bfloat16": 1.0 / c.eta_flops, "fp8": 1.0 / c.eta_flops_fp8, "fp8_block": 1.0 / c.eta_flops_fp8}
    x0, lo, hi = [16.0, 20.0, 500.0, 16.0], [1.0, 0.0, 0.0, 0.0], [256.0, 2000.0, 8192.0, 4096.0]
    x0 += [1.0] * len(present) + [1.0] * len(present)
    lo += [0.02] * 2 * len(present)
    hi += [cap[d] for d in present] + [1.0 / c.eta_mem] * len(present)
    free = np.array([True, True, form.width, form.tokens] + [True] * len(present) + [form.mem] * len(present))
    base = np.array([x0[0], x0[1], 0.0, 0.0] + [1.0] * 2 * len(present))

    def unpack(x: np.ndarray) -> EngineFit:
        v = base.copy()
        v[free] = x
        k = len(present)
        eta = dict(zip(present, map(float, v[4 : 4 + k]), strict=True))
        mem = dict(zip(present, map(float, v[4 + k :]), strict=True))
        return EngineFit(rows[0].engine, *(float(u) for u in v[:4]), eta, mem)

    def resid(x: np.ndarray) -> np.ndarray:
        return np.log(engine_predict_us(a, unpack(x)) / a["measured"])

    sel = np.flatnonzero(free)
    best = least_squares(resid, np.array(x0)[sel], bounds=(np.array(lo)[sel], np.array(hi)[sel]))
    return unpack(best.x)


def engine_held_out(rows: list[Row], key: str, form: Form = RECOMMENDED) -> np.ndarray:
    """Each ``key`` group of one engine's rows predicted by a fit on its other rows, aligned with ``rows``
    (NaN for a row of a dtype the other groups lack: nothing to predict it with)."""
    out = np.full(len(rows), np.nan)
    for value in sorted({getattr(r, key) for r in rows}):
        idx = [i for i, r in enumerate(rows) if getattr(r, key) == value]
        f = fit_engine([r for r in rows if getattr(r, key) != value], form)
        out[idx] = engine_errors([rows[i] for i in idx], f)
    return out


def hbm_fraction(rows: list[Row]) -> np.ndarray:
    """Bytes of the experts the model's touched count routes to, per measured second, over HBM peak."""
    a = arrays(rows, PerfConfig(eta_mem=1.0))
    return a["touched"] * a["params"] * a["bytes"] / (a["measured"] * 1e-6) / a["bw"]


def beyond_hbm(rows: list[Row]) -> set[tuple[str, str, str]]:
    """The (engine, model, dtype) cells with a row faster than reading its touched experts at HBM peak."""
    return {(r.engine, r.model, r.dtype) for r, f in zip(rows, hbm_fraction(rows), strict=True) if f > 1.0}


def engine_rows(rows: list[Row], engine: str) -> list[Row]:
    """The rows the per-engine fit of ``engine`` uses (``beyond_hbm`` cells left out)."""
    out = beyond_hbm(rows)
    return [r for r in rows if r.engine == engine and (r.engine, r.model, r.dtype) not in out]


def fit_engines(rows: list[Row], form: Form = RECOMMENDED) -> dict[str, EngineFit]:
    return {e: fit_engine(engine_rows(rows, e), form) for e in sorted({r.engine for r in rows})}


def _pct(e: np.ndarray) -> str:
    return f"{np.abs(e).mean() * 100:5.1f}"


@dataclass(frozen=True)
class Evaluated:
    """One engine's rows, their fit and its errors (aligned with ``rows``)."""

    rows: list[Row]
    fit: EngineFit
    in_sample: np.ndarray
    held: dict[str, np.ndarray]  # "gpu", "model": leave-one-out

    def part(self, dtype: str | None) -> tuple[np.ndarray, np.ndarray]:
        sel = np.array([dtype is None or r.dtype == dtype for r in self.rows])
        return self.in_sample[sel], self.held["gpu"][sel]


def evaluate(rows: list[Row], engine: str, form: Form = RECOMMENDED) -> Evaluated:
    mine = engine_rows(rows, engine)
    f = fit_engine(mine, form)
    held = {key: engine_held_out(mine, key, form) for key in ("gpu", "model")}
    return Evaluated(mine, f, engine_errors(mine, f), held)


def _ok(e: np.ndarray) -> np.ndarray:
    return e[~np.isnan(e)]


WITHIN = 0.15
"""A dtype cell prices an engine (``engine_data``) only where its fit is within this mean error in sample and
on a GPU it did not see."""


def engine_data(rows: list[Row]) -> dict[str, object]:
    """What ``src/toposched/data/moe_engines.json`` holds (``perf/moe_engines.py`` reads it): each engine's
    recommended fit, its dtype cells within ``WITHIN`` (the others listed with their errors and left to the
    pooled term) and the newest engine version its tables measured (the fit prices that version on)."""
    out: dict[str, object] = {}
    for e in sorted({r.engine for r in rows}):
        ev = evaluate(rows, e)
        coefficients = ev.fit.coefficients()
        left: dict[str, str] = {}
        for d in list(ev.fit.eta_moe):
            ins, held = (np.abs(part).mean() for part in (ev.part(d)[0], _ok(ev.part(d)[1])))
            if max(ins, held) > WITHIN:
                left[d] = f"{ins:.1%} in sample, {held:.1%} on a held-out GPU"
                for key in ("eta_moe", "mem_moe"):
                    del coefficients[key][d]  # type: ignore[attr-defined]
        newest = max({r.version for r in rows if r.engine == e}, key=Version)
        out[e] = {"from_version": newest, **coefficients, "left_out": left}
    source = "benchmarks/moe_tables.py --write: aiconfigurator-core 0.12.0's fused-MoE tables, fitted per engine"
    return {"source": source, "engines": out}


def per_engine_main(rows: list[Row], as_json: bool = False) -> int:
    engines = sorted({r.engine for r in rows})
    if as_json:
        fits = fit_engines(rows)
        print(json.dumps({e: f.coefficients() for e, f in fits.items()} | {"engine_table": ENGINE_TABLE}))
        return 0
    print("per engine: each engine's rows fitted on their own (log-ratio least squares, GEMM coefficients held)")
    gpus = sorted({r.gpu for r in rows})
    print("\nrows per engine and dtype (" + ", ".join(gpus) + "; '-': none measured, no figure fitted):")
    for e in engines:
        for d in DTYPES:
            n = [sum(r.engine == e and r.dtype == d and r.gpu == g for r in rows) for g in gpus]
            print(f"   {e:<7} {d:<10} " + " ".join(f"{k:>5}" if k else "    -" for k in n))
    print("\nforms, mean abs error % (in sample / leave-one-GPU-out / leave-one-model-out):")
    done: dict[str, Evaluated] = {}
    for form in FORMS:
        cells = []
        for e in engines:
            ev = evaluate(rows, e, form)
            done.update({e: ev} if form is RECOMMENDED else {})
            cells.append(f"{e} {_pct(ev.in_sample)} /{_pct(_ok(ev.held['gpu']))} /{_pct(_ok(ev.held['model']))}")
        print(f"   {form.label:<38} " + "   ".join(cells))
    fits = {e: ev.fit for e, ev in done.items()}
    frac = hbm_fraction(rows)
    print("\nleft out: cells faster than reading the touched experts at HBM peak (fewer experts routed):")
    for cell in sorted(beyond_hbm(rows)):
        sel = [i for i, r in enumerate(rows) if (r.engine, r.model, r.dtype) == cell]
        e = engine_errors([rows[i] for i in sel], fits[cell[0]])
        print(f"   {' '.join(cell):<30} up to {frac[sel].max():.2f}x HBM peak; " + summary("by the fit", e))
    print(f"\nrecommended form ({RECOMMENDED.label}), per engine:")
    for e, ev in done.items():
        print(f"   {e}: " + ", ".join(f"{k} {v}" for k, v in ev.fit.coefficients().items()))
        print("      " + summary("in sample", ev.in_sample))
        for key in ("gpu", "model"):
            print("      " + summary(f"leave-one-{key}-out", _ok(ev.held[key])))
        for d in DTYPES:
            ins, held = ev.part(d)
            if len(ins):
                print("      " + summary(f"dtype {d} (held-out GPU {_pct(_ok(held)).strip()} %)", ins))
            else:
                print(f"      dtype {d:<34} no rows: not fitted")
        for band, lo, hi in (("T <= 32", 1, 32), ("64 <= T <= 512", 64, 512), ("T >= 1024", 1024, 1 << 30)):
            sel = np.array([lo <= r.tokens <= hi for r in ev.rows])
            print("      " + summary(band, ev.in_sample[sel]))
        for key in ("gpu", "model"):
            for value in sorted({getattr(r, key) for r in ev.rows}):
                sel = np.array([getattr(r, key) == value for r in ev.rows])
                print("      " + summary(f"{key} {value}", ev.in_sample[sel]))
    print("\nrecommended coefficients (eta_moe x the dense GEMM efficiency, mem_moe x eta_mem; '-': no rows):")
    fields = [
        "moe_tile_m",
        "moe_layer_us",
        "moe_n_half",
        *(f"{k}[{d}]" for k in ("eta_moe", "mem_moe") for d in DTYPES),
    ]
    print(f"   {'field':<20}" + "".join(f"{e:>10}" for e in engines))
    for name in fields:
        k, _, d = name.rstrip("]").partition("[")
        vals = [getattr(fits[e], k).get(d) if d else getattr(fits[e], k) for e in engines]
        print(f"   {name:<20}" + "".join(f"{v:>10.3g}" if v is not None else f"{'-':>10}" for v in vals))
    c = PerfConfig()
    widths = (192, 1536, 14336)  # n = I / tp: Qwen3-235B at TP 8 and TP 1, Mixtral-8x7B at TP 1
    print(
        "\nthe grouped GEMM's fraction of the dtype's peak, eta x eta_moe x n/(n + moe_n_half), at n = "
        + ", ".join(map(str, widths))
        + ":"
    )
    for e in engines:
        f = fits[e]
        for d, eta in f.eta_moe.items():
            dense = c.eta_flops if d == "bfloat16" else c.eta_flops_fp8
            print(f"   {e:<7} {d:<10} " + " ".join(f"{dense * eta * n / (n + f.moe_n_half):6.3f}" for n in widths))
    print("\nwithin 15 % (mean abs error in sample / leave-one-GPU-out), each engine and its dtypes:")
    for e, ev in done.items():
        for d in (None, *DTYPES):
            ins, held = ev.part(d)
            if len(ins):
                a, b = np.abs(ins).mean() * 100, np.abs(_ok(held)).mean() * 100
                verdict = "yes" if max(a, b) <= 15 else "no"
                print(f"   {e:<7} {d or 'all':<10} {verdict:<4} {a:5.1f} / {b:5.1f} %")
    versions = {e: sorted({r.version for r in rows if r.engine == e}) for e in engines}
    print("\nengines without a table, and the versions behind each table:")
    for name, table in ENGINE_TABLE.items():
        print(f"   {name or 'None/unknown':<22} -> {table:<7} (tables {', '.join(versions.get(table, []))}; "
              f"MoE serving anchors {MOE_ANCHOR_VERSIONS[table]})")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the fitted coefficients as JSON")
    ap.add_argument("--per-engine", action="store_true", help="only the per-engine fits (with --json: theirs)")
    ap.add_argument("--write", action="store_true", help=f"write the per-engine fits to {DATA.name} and stop")
    args = ap.parse_args(argv)
    rows = load()
    if args.write:
        DATA.write_text(json.dumps(engine_data(rows), indent=1, sort_keys=True) + "\n")
        print(f"wrote {DATA}")
        return 0
    if args.per_engine:
        return per_engine_main(rows, as_json=args.json)
    x = fit(rows)
    if args.json:
        print(json.dumps(dict(zip(NAMES, x, strict=True))))
        return 0
    print(f"{len(rows)} fused-MoE rows ({TABLE.name}: aiconfigurator-core 0.12.0)\n")
    baselines = (("PerfConfig's defaults", PerfConfig()), ("the shipped profile", active_config("H100-SXM", "fp8")))
    for label, c in baselines:
        print(f"{label} (moe_tile_m {c.moe_tile_m:.3g}, moe_layer_us {c.moe_layer_us:.3g}):")
        print("   " + summary("in sample", errors(rows, (c.moe_tile_m, c.moe_layer_us))))
    for label, with_eta in (("moe_tile_m, moe_layer_us", False), ("+ eta_moe, eta_moe_fp8 (not in the model)", True)):
        xe = fit(rows, with_eta)
        names = NAMES_ETA if with_eta else NAMES
        print(f"\nfitted {label}: " + ", ".join(f"{n} {v:.3g}" for n, v in zip(names, xe, strict=True)))
        print("   " + summary("in sample", errors(rows, xe)))
        for key in ("gpu", "engine"):
            print("   " + summary(f"leave-one-{key}-out", _held_out(rows, key, with_eta)))
    print("\nin sample, by group (moe_tile_m, moe_layer_us fitted):")
    gemm_tables.print_by_group(rows, ("gpu", "engine", "dtype"), lambda part: errors(part, x), 44)
    bands = (("T <= 32 (decode)", 1, 32), ("64 <= T <= 512", 64, 512), ("T >= 1024 (prefill)", 1024, 1 << 30))
    gemm_tables.print_bands(rows, "tokens", bands, lambda part: errors(part, x), 44)
    for experts in sorted({r.experts for r in rows}):
        print("   " + summary(f"{experts} experts", errors([r for r in rows if r.experts == experts], x)))
    print()
    return per_engine_main(rows)


if __name__ == "__main__":
    sys.exit(main())
