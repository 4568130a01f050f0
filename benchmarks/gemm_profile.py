"""The cost model's GEMM term against measured operator times: Vidur's linear-layer profiles.

    .venv/bin/python benchmarks/gemm_profile.py            # errors of the shipped coefficients, and fits
    .venv/bin/python benchmarks/gemm_profile.py --rows     # every row

Vidur (microsoft/vidur, MLSys'24) profiled the four linear layers of one transformer layer (QKV, O,
gate+up, down) alone, on A100 and H100, at TP 1/2/4/8 and 1-2,048 tokens
(``tests/data/reference/data/vidur_linear_layer_decode_prefill.txt``; Llama-2-7B/70B on H100,
Llama-3-8B/70B on A100, BF16). These are operator measurements from a source the anchors never
saw, so they check the one part of ``perf/latency.py`` that is pure kernel time, the smooth
roofline of the GEMMs:

    T_gemm = (T_mem^p + T_cmp^p)^(1/p),  T_mem = weight bytes / (eta_mem x BW),  T_cmp = FLOPs / (eta_flops x peak)

It prints (1) the error of that term with the shipped profile's BF16 coefficients for each GPU
(what the model charges for these GEMMs inside a pass), (2) the same form fitted on the profiles
themselves, and (3) the form with a fixed cost per GEMM launch, ``gemm_us``, also fitted: how much of
the small-shard inefficiency (TP8, few tokens) a flat efficiency cannot express. Errors are relative
to the measured time; leave-one-GPU-out refits the fitted forms on the other GPU.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from toposched.perf import get_gpu
from toposched.perf.latency import roofline
from toposched.perf.profile import active_config

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "data"
PROFILES = DATA / "vidur_linear_layer_decode_prefill.txt"
GPUS = {"h100": "H100-SXM", "a100": "A100-SXM-80GB"}
GEMMS_PER_LAYER = 4  # QKV, O, gate+up, down


@dataclass(frozen=True)
class Row:
    gpu: str
    model: str
    tp: int
    tokens: int
    params: float  # parameters of the layer's four GEMMs on one GPU
    measured_us: float


def load(path: Path = PROFILES) -> list[Row]:
    rows: list[Row] = []
    head = re.compile(r"== (\w+) (\S+) h=(\d+) ffn=(\d+) heads=(\d+) kv=(\d+)")
    line_re = re.compile(r"tp=(\d+) tokens=\s*(\d+): linear=\s*([\d.]+)us")
    gpu = model = ""
    per_layer = 0.0
    for line in path.read_text().splitlines():
        m = head.search(line)
        if m:
            gpu, model = GPUS[m.group(1)], m.group(2)
            h, ffn, heads, kv = (int(m.group(i)) for i in range(3, 7))
            qkv = h * (h + 2 * kv * h // heads)
            per_layer = qkv + h * h + 2 * h * ffn + ffn * h
            continue
        m = line_re.search(line)
        if m:
            tp, tokens, us = int(m.group(1)), int(m.group(2)), float(m.group(3))
            rows.append(Row(gpu, model, tp, tokens, per_layer / tp, us))
    if not rows:
        raise SystemExit(f"{path}: no profile rows found")
    return rows


def predict(row: Row, eta_mem: float, eta_flops: float, p: float, gemm_us: float = 0.0) -> float:
    g = get_gpu(row.gpu)
    mem = row.params * 2 / (g.hbm_bandwidth * eta_mem)  # BF16 weights; activations are small beside them
    cmp = 2 * row.tokens * row.params / (g.bf16_flops * eta_flops)
    return roofline(mem, cmp, p) * 1e6 + GEMMS_PER_LAYER * gemm_us


def errors(rows: list[Row], *args: float) -> np.ndarray:
    return np.array([predict(r, *args) / r.measured_us - 1 for r in rows])


def fit(rows: list[Row], with_launch: bool) -> tuple[float, ...]:
    x0 = [0.8, 0.7, 2.0] + ([2.0] if with_launch else [])
    lo = [0.3, 0.1, 1.0] + ([0.0] if with_launch else [])
    hi = [1.0, 1.0, 16.0] + ([50.0] if with_launch else [])

    def resid(x: np.ndarray) -> np.ndarray:
        return np.log1p(errors(rows, *x))

    return tuple(least_squares(resid, x0, bounds=(lo, hi)).x)


def summary(label: str, e: np.ndarray) -> str:
    a = np.abs(e) * 100
    return f"{label:<44} mean {a.mean():5.1f} %  median {np.median(a):5.1f} %  worst {a.max():5.1f} %  (n={len(a)})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", action="store_true", help="print every row")
    args = ap.parse_args(argv)
    rows = load()
    print(f"{len(rows)} Vidur linear-layer rows ({PROFILES.name})\n")
    print("1. the shipped profile's BF16 coefficients (eta_mem, eta_flops, roofline_p per GPU):")
    shipped: dict[str, tuple[float, float, float]] = {}
    for gpu in sorted({r.gpu for r in rows}):
        c = active_config(gpu, "bf16")
        shipped[gpu] = (c.eta_mem, c.eta_flops, c.roofline_p)
        sub = [r for r in rows if r.gpu == gpu]
        print("   " + summary(f"{gpu} (eta_mem {c.eta_mem:.3f}, eta_flops {c.eta_flops:.3f}, p {c.roofline_p:.2f})",
                            errors(sub, *shipped[gpu])))  # fmt: skip
    bands = (("decode (<= 32 tokens)", 0, 32), ("prefill (>= 512 tokens)", 512, 1 << 30))
    for band, lo, hi in bands:
        sub = [r for r in rows if lo <= r.tokens <= hi]
        e = np.concatenate([errors([r for r in sub if r.gpu == g], *shipped[g]) for g in shipped])
        print("   " + summary(f"  {band}", e))
    print("\n2./3. fitted on the profiles (log-ratio least squares), leave-one-GPU-out beside:")
    for label, launch in (("flat efficiencies", False), ("flat efficiencies + gemm_us per GEMM", True)):
        x = fit(rows, launch)
        names = ["eta_mem", "eta_flops", "p"] + (["gemm_us"] if launch else [])
        coef = ", ".join(f"{n} {v:.3g}" for n, v in zip(names, x, strict=True))
        print(f"   {label}: {coef}")
        print("     " + summary("in sample", errors(rows, *x)))
        held = []
        for gpu in sorted({r.gpu for r in rows}):
            xo = fit([r for r in rows if r.gpu != gpu], launch)
            held.append(errors([r for r in rows if r.gpu == gpu], *xo))
        print("     " + summary("leave-one-GPU-out", np.concatenate(held)))
    if args.rows:
        x = fit(rows, True)
        print("\n   gpu        model                         tp  tokens  measured  shipped  +gemm_us")
        for r in rows:
            a, b = predict(r, *shipped[r.gpu]), predict(r, *x)
            print(f"   {r.gpu:<10} {r.model:<29} {r.tp:>2} {r.tokens:>7} {r.measured_us:>9.1f} {a:>8.1f} {b:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
