"""The cost model's MoE term against NVIDIA's measured fused-MoE tables (aiconfigurator-core 0.12.0).

    .venv/bin/python benchmarks/moe_tables.py            # fits and errors by GPU / engine / dtype / tokens
    .venv/bin/python benchmarks/moe_tables.py --json     # the fitted coefficients as one JSON object

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
    T_mem   = touched x 3 h I / tp x bytes / (eta_mem x BW),   T_cmp = rows x 2 x 3 h I / tp / (eta x peak)
    T       = (T_mem^p + T_cmp^p)^(1/p) + 2 gemm_us(dtype) + moe_layer_us

Fitted: ``moe_tile_m`` (token rows a touched expert costs at least: a grouped-GEMM tile) and
``moe_layer_us`` (routing, permute and unpermute per layer), the two MoE coefficients the shipped profile
fitted on the serving rows before (9.9 and 26 us). Reported beside them: a grouped-GEMM efficiency of
its own per dtype (``eta_moe``/``eta_moe_fp8``, as a fraction of the dense GEMM efficiency of the dtype),
which the model does not have, to show what it would add. Log-ratio least squares over every row, engines
pooled; leave-one-GPU-out and leave-one-engine-out refit without the held-out group.
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
from scipy.optimize import least_squares

from toposched.perf import get_gpu
from toposched.perf.coefficients import PerfConfig
from toposched.perf.latency import roofline
from toposched.perf.profile import active_config

TABLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "data" / "aiconfigurator_moe.csv"
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


def load(path: Path = TABLE) -> list[Row]:
    with path.open(newline="") as f:
        rows = [
            Row(
                r["gpu"],
                r["engine"],
                r["dtype"],
                *(int(r[k]) for k in ("tokens", "hidden", "inter", "experts", "topk", "tp")),
                float(r["latency_ms"]) * 1e3,
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
    touched = row.experts * (1.0 - (1.0 - row.topk / row.experts) ** row.tokens)
    params = 3.0 * row.hidden * row.inter / row.tp
    mem = touched * params * WEIGHT_BYTES[row.dtype] / (g.hbm_bandwidth * c.eta_mem)
    rows = touched * max(row.tokens * row.topk / touched, tile)
    cmp = rows * 2.0 * params / (peak * eta)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the fitted coefficients as JSON")
    args = ap.parse_args(argv)
    rows = load()
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
    for key in ("gpu", "engine", "dtype"):
        for value in sorted({getattr(r, key) for r in rows}):
            print("   " + summary(f"{key} {value}", errors([r for r in rows if getattr(r, key) == value], x)))
    for band, lo, hi in (
        ("T <= 32 (decode)", 1, 32),
        ("64 <= T <= 512", 64, 512),
        ("T >= 1024 (prefill)", 1024, 1 << 30),
    ):
        print("   " + summary(band, errors([r for r in rows if lo <= r.tokens <= hi], x)))
    for experts in sorted({r.experts for r in rows}):
        print("   " + summary(f"{experts} experts", errors([r for r in rows if r.experts == experts], x)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
