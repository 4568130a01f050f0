"""The cost model's GEMM term against NVIDIA's measured GEMM tables (aiconfigurator-core 0.12.0).

    .venv/bin/python benchmarks/gemm_tables.py             # fits, errors per GPU / engine / dtype / band
    .venv/bin/python benchmarks/gemm_tables.py --json      # the fitted coefficients as one JSON object

``tests/data/reference/data/aiconfigurator_gemm.csv`` (``benchmarks/aic_extract.py`` made it from the
wheel) holds 7,825 GEMM latencies measured by aiconfigurator's collectors inside vLLM, SGLang and
TensorRT-LLM on A100-SXM4-80GB, H100-SXM and H200: BF16, per-tensor FP8 and block-scaled FP8 GEMMs,
1-16,384 tokens, n and k from 1,024 to 16,384. These are operator measurements from a source none of
the serving anchors come from, so the GEMM coefficients of ``PerfConfig`` can be measured on them
instead of being fitted on the 53 serving rows (issue 34: "operator-level efficiency curves instead of
flat efficiencies"). The model's form, per GEMM (``perf/latency.py``):

    T = (T_mem^p + T_cmp^p)^(1/p) + gemm_us(dtype),
    T_mem = weight bytes / (eta_mem x BW),   T_cmp = 2 m (n + n_half(dtype)) k / (eta(dtype) x peak(dtype))

i.e. an efficiency ``eta x n / (n + n_half)`` over the GEMM's output columns ``n`` (on one GPU: a TP
shard's width), ``n_half`` = ``gemm_n_half`` (BF16) or ``gemm_n_half_fp8`` (both FP8 kinds): a flat FP8
efficiency left 23 % error on the FP8 rows, over-pricing wide GEMMs and under-pricing narrow ones by
20-30 % (the report prints the flat fit beside it). ``eta(bfloat16) = eta_flops``, ``eta(fp8) =
eta_flops_fp8`` (FP8 peak on H100/H200; A100 has no FP8 rows) and a fixed cost per kernel for BF16
(``gemm_us``) and FP8 (``gemm_us_fp8``: the FP8 op quantises its activation first). Block-scaled FP8 is
fitted as its own efficiency (``eta_fp8_block``) and reported: the model has one FP8 efficiency. vLLM's
block-scaled FP8 rows are left out of the fit and reported beside it: at up to 512 tokens even the
fastest of its three kernels takes about three times what SGLang's and TensorRT-LLM's take on the same
shapes, which no efficiency shared with them describes.
The fit is log-ratio least squares over the other rows, all engines pooled; leave-one-GPU-out and
leave-one-engine-out refit without the held-out group. Only weight bytes count in ``T_mem``, as in the
model (activations are small beside the weights at the token counts where memory bounds a GEMM).
``PerfConfig``'s defaults are this fit (``tests/perf/test_gemm_tables.py``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from scipy.optimize import least_squares

from toposched.perf import get_gpu
from toposched.perf.coefficients import PerfConfig
from toposched.perf.latency import roofline

T = TypeVar("T")
TABLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "data" / "aiconfigurator_gemm.csv"
NAMES = (
    "eta_mem", "eta_flops", "eta_flops_fp8", "eta_fp8_block", "roofline_p", "gemm_us", "gemm_us_fp8",
    "gemm_n_half", "gemm_n_half_fp8",
)  # fmt: skip
X0 = (0.8, 0.7, 0.6, 0.5, 2.0, 5.0, 5.0, 500.0, 500.0)
LO = (0.3, 0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 0.0, 0.0)
HI = (1.0, 1.0, 1.0, 1.0, 16.0, 100.0, 100.0, 100_000.0, 100_000.0)
FLAT = NAMES.index("gemm_n_half")
"""``NAMES[:FLAT]`` is the form without the width curve (flat efficiencies), fitted beside it."""
WEIGHT_BYTES = {"bfloat16": 2.0, "fp8": 1.0, "fp8_block": 1.0}


@dataclass(frozen=True)
class Row:
    gpu: str
    engine: str
    dtype: str
    m: int
    n: int
    k: int
    measured_us: float


def fitted_rows(rows: list[Row]) -> list[Row]:
    """The rows the fit uses: all but vLLM's block-scaled FP8 (module docstring)."""
    return [r for r in rows if not (r.engine == "vllm" and r.dtype == "fp8_block")]


def load(path: Path = TABLE) -> list[Row]:
    with path.open(newline="") as f:
        rows = [
            Row(r["gpu"], r["engine"], r["dtype"], int(r["m"]), int(r["n"]), int(r["k"]), float(r["latency_ms"]) * 1e3)
            for r in csv.DictReader(f)
        ]
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def predict_us(row: Row, x: tuple[float, ...] | np.ndarray) -> float:
    """The model's time of one GEMM; ``x`` as ``NAMES`` (or ``NAMES[:FLAT]``: no width curve)."""
    eta_mem, eta_bf16, eta_fp8, eta_fp8b, p, gemm_us, gemm_us_fp8 = x[:FLAT]
    n_half, n_half_fp8 = (x[FLAT], x[FLAT + 1]) if len(x) > FLAT else (0.0, 0.0)
    g = get_gpu(row.gpu)
    if row.dtype == "bfloat16":
        peak, eta = g.bf16_flops, eta_bf16
    else:
        peak, eta = (g.fp8_flops or g.bf16_flops), (eta_fp8 if row.dtype == "fp8" else eta_fp8b)
        gemm_us, n_half = gemm_us_fp8, n_half_fp8
    mem = row.n * row.k * WEIGHT_BYTES[row.dtype] / (g.hbm_bandwidth * eta_mem)
    # efficiency eta x n / (n + n_half): the same as charging n_half more output columns
    cmp = 2.0 * row.m * (row.n + n_half) * row.k / (peak * eta)
    return roofline(mem, cmp, p) * 1e6 + gemm_us


def errors(rows: list[Row], x: tuple[float, ...] | np.ndarray) -> np.ndarray:
    return np.array([predict_us(r, x) / r.measured_us - 1 for r in rows])


def fit(rows: list[Row], curve: bool = True) -> tuple[float, ...]:
    """Log-ratio least squares of the model's form; ``curve=False`` fits flat efficiencies (``NAMES[:FLAT]``)."""
    size = len(NAMES) if curve else FLAT

    def resid(x: np.ndarray) -> np.ndarray:
        return np.log1p(errors(rows, x))

    return tuple(float(v) for v in least_squares(resid, X0[:size], bounds=(LO[:size], HI[:size])).x)


def summary(label: str, e: np.ndarray, width: int = 40) -> str:
    a = np.abs(e) * 100
    p90 = np.percentile(a, 90)
    return f"{label:<{width}} mean {a.mean():5.1f} %  median {np.median(a):5.1f} %  p90 {p90:5.1f} %  (n={len(a)})"


def held_out(
    rows: list[T], key: str, fit: Callable[[list[T]], Any], errors: Callable[[list[T], Any], np.ndarray]
) -> np.ndarray:
    """Each group of ``key`` predicted by a fit on the other groups (``benchmarks/moe_tables.py`` too)."""
    out = []
    for value in sorted({getattr(r, key) for r in rows}):
        x = fit([r for r in rows if getattr(r, key) != value])
        out.append(errors([r for r in rows if getattr(r, key) == value], x))
    return np.concatenate(out)


def print_by_group(rows: list[T], keys: Sequence[str], errs: Callable[[list[T]], np.ndarray], width: int = 40) -> None:
    """One summary line per value of each of ``keys`` (``moe_tables.py`` and ``attention_tables.py`` too)."""
    for key in keys:
        for value in sorted({getattr(r, key) for r in rows}):
            part = [r for r in rows if getattr(r, key) == value]
            print("   " + summary(f"{key} {value}", errs(part), width))


def print_bands(
    rows: list[T],
    attr: str,
    bands: Sequence[tuple[str, int, int]],
    errs: Callable[[list[T]], np.ndarray],
    width: int = 40,
) -> None:
    """One summary line per band ``(label, lo, hi)`` of ``attr`` (tokens)."""
    for band, lo, hi in bands:
        print("   " + summary(band, errs([r for r in rows if lo <= getattr(r, attr) <= hi]), width))


def wants_json(argv: list[str] | None, doc: str | None, what: str) -> bool:
    """The table benchmarks' one option: ``--json`` prints ``what`` as one JSON object instead of the report."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help=f"print {what} as JSON")
    return bool(ap.parse_args(argv).json)


def main(argv: list[str] | None = None) -> int:
    as_json = wants_json(argv, __doc__, "the fitted coefficients")
    every = load()
    rows = fitted_rows(every)
    x = fit(rows)
    if as_json:
        print(json.dumps(dict(zip(NAMES, x, strict=True))))
        return 0
    print(f"{len(every)} GEMM rows ({TABLE.name}: aiconfigurator-core 0.12.0), {len(rows)} fitted\n")
    print("fitted on all rows: " + ", ".join(f"{n} {v:.3f}" for n, v in zip(NAMES, x, strict=True)))
    print("   " + summary("in sample", errors(rows, x)))
    for key in ("gpu", "engine"):
        print("   " + summary(f"leave-one-{key}-out", held_out(rows, key, fit, errors)))
    flat = fit(rows, curve=False)
    named = ", ".join(f"{n} {v:.3f}" for n, v in zip(NAMES[:FLAT], flat, strict=True))
    print(f"flat efficiencies (no width curve): {named}")
    print("   " + summary("in sample", errors(rows, flat)))
    for key in ("gpu", "engine"):
        held = held_out(rows, key, lambda part: fit(part, curve=False), errors)
        print("   " + summary(f"leave-one-{key}-out", held))
    for dtype in ("bfloat16", "fp8", "fp8_block"):
        part = [r for r in rows if r.dtype == dtype]
        both = summary(f"dtype {dtype}: flat / curve", errors(part, flat)) + " / " + summary("", errors(part, x), 0)
        print("   " + both)
    print("\nin sample, by group:")
    print_by_group(rows, ("gpu", "engine", "dtype"), lambda part: errors(part, x))
    bands = (("m <= 32 (decode)", 1, 32), ("64 <= m <= 512", 64, 512), ("m >= 1024 (prefill)", 1024, 1 << 30))
    print_bands(rows, "m", bands, lambda part: errors(part, x))
    left = [r for r in every if r not in set(rows)]
    print("   " + summary("left out: vLLM block FP8, m <= 512", errors([r for r in left if r.m <= 512], x)))
    print("   " + summary("left out: vLLM block FP8, m >= 1024", errors([r for r in left if r.m >= 1024], x)))
    print("\nthe model's defaults (PerfConfig; eta_fp8_block = its FP8 efficiency) on the fitted rows:")
    c = PerfConfig()
    model = (c.eta_mem, c.eta_flops, c.eta_flops_fp8, c.eta_flops_fp8, c.roofline_p, c.gemm_us, c.gemm_us_fp8,
             c.gemm_n_half, c.gemm_n_half_fp8)  # fmt: skip
    for gpu in sorted({r.gpu for r in rows}):
        print("   " + summary(gpu, errors([r for r in rows if r.gpu == gpu], model)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
