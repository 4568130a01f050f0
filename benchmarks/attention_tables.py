"""The cost model's attention term against NVIDIA's measured attention tables (aiconfigurator-core 0.12.0).

    .venv/bin/python benchmarks/attention_tables.py           # fits, errors per phase / GPU / engine / band
    .venv/bin/python benchmarks/attention_tables.py --json    # the recommended coefficients as one JSON object

``tests/data/reference/data/aiconfigurator_attention.csv`` (``benchmarks/aic_extract.py``, whose docstring
says what a row measures) holds 17,328 latencies of one layer's attention kernel measured by
aiconfigurator's collectors inside vLLM, SGLang and TensorRT-LLM on A100-SXM4-80GB, H100-SXM and H200:
the per-GPU head shapes of the catalog's non-MLA models at TP 1-8 (head_dim 128), BF16 attention math
with a BF16 or FP8 KV cache, prefill (``context``: ``b`` prompts of ``s`` tokens, causal, nothing cached)
and decode (``generation``: ``b`` sequences attending to ``L`` tokens each, the new one included). With
``w`` = q heads x head_dim and ``kv`` = KV heads per GPU, the model today (``perf/latency.py``) charges

    prefill  2 b s^2 w / (eta_attn x BF16 peak)
    decode   b L kv head_dim 2 bytes / (eta_mem x BW) + 4 b L w / (eta_attn x BF16 peak)

with ``eta_attn`` 0.5 (not fitted) and ``eta_mem`` the GEMM tables' 0.805, no fixed cost. Fitted here
(log-ratio least squares, engines pooled; prefill first, decode with the prefill's ``eta_attn`` held):

    prefill  2 b s (s + attn_s_half) w / (eta_attn x peak) + attn_us
    decode   b L kv head_dim 2 bytes / (eta_kv x BW) + 4 b L w / (eta_attn x peak)
             + attn_us_decode + b kv attn_seq_ns

``attn_s_half`` is the efficiency curve ``eta(s) = eta_attn s / (s + attn_s_half)`` written as work: every
query token costs ``attn_s_half`` more keys, so a pass's attention stays a sum over its chunks. The
flat form (``attn_s_half`` 0) and the decode form without ``attn_seq_ns`` (a cost per sequence and KV
head: each (sequence, KV head) is a work item of the decode kernel) are fitted and reported beside;
``attn_us`` and ``attn_us_decode`` are fixed costs per kernel call (one layer). A100 TensorRT-LLM 1.0's
generation rows are left out of the fit and reported beside: at long contexts they read the KV cache at
up to 1.6x the A100's HBM bandwidth, so they do not read ``L`` tokens per sequence. Leave-one-GPU-out and
leave-one-engine-out refit without the held-out group.

Result (2-core AMD EPYC VM, 2026-12-07, 2 s): today's form misses the context rows by 59.7 % and the
generation rows by 69.1 % on average. A flat ``eta_attn`` with a fixed cost cannot follow the prompt
(43.5 %: at 8,192+ tokens the kernels reach 3-7x the FLOP efficiency they reach at 256); the curve,
``eta_attn`` 0.653, ``attn_s_half`` 1,113 tokens, ``attn_us`` 14.9, leaves 19.8 % (leave-one-GPU-out
21.5 %, leave-one-engine-out 23.5 %); the decode form, ``eta_kv`` 0.775, ``attn_us_decode`` 11.1,
``attn_seq_ns`` 17.7, leaves 23.0 % (24.3 %, 27.4 %; without ``attn_seq_ns`` 29.2 %, 31.2 %, 33.0 %). Worst left: SGLang
context (31.8 %; 51 % on A100, whose SGLang kernel reaches more at short prompts than the others), A100
context (31.7 %; fitted alone A100 wants ``attn_s_half`` 572, Hopper 1,370-1,440) and TensorRT-LLM's
decode over an FP8 KV cache (55.7 %: its kernel's floor is about 6 us, not 11). TensorRT-LLM's context
rows with an FP8 KV cache reach up to 0.83 of BF16 peak, the rows with a BF16 cache of every engine at
most 0.68.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gemm_tables  # the benchmark next to this one
import numpy as np
from scipy.optimize import least_squares

from toposched.perf import get_gpu
from toposched.perf.coefficients import PerfConfig

TABLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "data" / "aiconfigurator_attention.csv"
NAMES = ("eta_attn", "attn_s_half", "attn_us", "eta_kv", "attn_us_decode", "attn_seq_ns")
X0 = (0.6, 500.0, 10.0, 0.8, 10.0, 10.0)
LO = (0.05, 0.0, 0.0, 0.05, 0.0, 0.0)
HI = (1.5, 1e5, 1000.0, 1.5, 1000.0, 1e4)
KV_BYTES = {"bfloat16": 2.0, "fp8": 1.0}
CONTEXT_BANDS = (("s <= 256", 1, 256), ("512 <= s <= 2048", 512, 2048), ("s >= 4096", 4096, 1 << 30))
DECODE_BANDS = (("L <= 256", 1, 256), ("1024 <= L <= 4096", 1024, 4096), ("L >= 16384", 16384, 1 << 30))


@dataclass(frozen=True)
class Row:
    gpu: str
    engine: str
    phase: str  # context | generation
    kernel: str
    kv_dtype: str
    q_heads: int
    kv_heads: int
    head_dim: int
    batch: int
    isl: int
    step: int
    measured_us: float

    @property
    def tokens(self) -> int:
        """Tokens each sequence attends to: the prompt (context) or the cached tokens and the new one."""
        return self.isl + self.step


def _row(r: dict[str, str]) -> Row:
    ints = {k: int(r[k]) for k in ("q_heads", "kv_heads", "head_dim", "batch", "isl", "step")}
    text = {k: r[k] for k in ("gpu", "engine", "phase", "kernel", "kv_dtype")}
    return Row(**text, **ints, measured_us=float(r["latency_ms"]) * 1e3)  # type: ignore[arg-type]


def load(path: Path = TABLE) -> list[Row]:
    with path.open(newline="") as f:
        rows = [_row(r) for r in csv.DictReader(f)]
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def left_out(row: Row) -> bool:
    """A100 TensorRT-LLM 1.0's generation rows (module docstring)."""
    return row.phase == "generation" and row.gpu.startswith("A100") and row.engine == "trtllm"


def fitted_rows(rows: list[Row]) -> list[Row]:
    return [r for r in rows if not left_out(r)]


def kv_bandwidth_fraction(row: Row) -> float:
    """The HBM bandwidth a generation row's KV read would take: its bytes / (latency x BW)."""
    g = get_gpu(row.gpu)
    kv_bytes = row.batch * row.tokens * row.kv_heads * row.head_dim * 2 * KV_BYTES[row.kv_dtype]
    return kv_bytes / (row.measured_us * 1e-6 * g.hbm_bandwidth)


class _Arrays:
    """The rows as numpy columns (the fits evaluate thousands of rows per iteration)."""

    def __init__(self, rows: list[Row]) -> None:
        gpus = {name: get_gpu(name) for name in {r.gpu for r in rows}}
        self.ctx = np.array([r.phase == "context" for r in rows], dtype=bool)
        self.b = np.array([r.batch for r in rows], dtype=float)
        self.s = np.array([r.tokens for r in rows], dtype=float)
        self.kv = np.array([r.kv_heads for r in rows], dtype=float)
        self.d = np.array([r.head_dim for r in rows], dtype=float)
        self.w = np.array([r.q_heads * r.head_dim for r in rows], dtype=float)
        self.kv_bytes = np.array([KV_BYTES[r.kv_dtype] for r in rows])
        self.peak = np.array([gpus[r.gpu].bf16_flops for r in rows])
        self.bw = np.array([gpus[r.gpu].hbm_bandwidth for r in rows])
        self.us = np.array([r.measured_us for r in rows])

    def predict_us(self, x: Sequence[float] | np.ndarray) -> np.ndarray:
        eta_attn, s_half, attn_us, eta_kv, us_decode, seq_ns = x
        b, s = self.b, self.s
        prefill = 2.0 * b * s * (s + s_half) * self.w / (eta_attn * self.peak) * 1e6 + attn_us
        kv_read = b * s * self.kv * self.d * 2.0 * self.kv_bytes / (eta_kv * self.bw)
        decode = (
            (kv_read + 4.0 * b * s * self.w / (eta_attn * self.peak)) * 1e6 + us_decode + b * self.kv * seq_ns * 1e-3
        )
        out: np.ndarray = np.where(self.ctx, prefill, decode)
        return out


def predict_us(rows: list[Row], x: Sequence[float] | np.ndarray) -> np.ndarray:
    """The model's time per row; ``x`` as ``NAMES``."""
    return _Arrays(rows).predict_us(x)


def errors(rows: list[Row], x: Sequence[float] | np.ndarray) -> np.ndarray:
    a = _Arrays(rows)
    e: np.ndarray = a.predict_us(x) / a.us - 1
    return e


def _least_squares(a: _Arrays, x: list[float], free: list[int]) -> list[float]:
    def resid(v: np.ndarray) -> np.ndarray:
        y = list(x)
        for i, value in zip(free, v, strict=True):
            y[i] = float(value)
        r: np.ndarray = np.log(a.predict_us(y) / a.us)
        return r

    got = least_squares(resid, [X0[i] for i in free], bounds=([LO[i] for i in free], [HI[i] for i in free])).x
    y = list(x)
    for i, value in zip(free, got, strict=True):
        y[i] = float(value)
    return y


def fit(rows: list[Row], curve: bool = True, per_seq: bool = True) -> tuple[float, ...]:
    """Prefill coefficients on the context rows, then decode ones on the generation rows with the prefill's
    ``eta_attn`` held; ``curve`` False fits a flat ``eta_attn`` (``attn_s_half`` 0), ``per_seq`` False
    leaves out ``attn_seq_ns``."""
    x = [X0[0], 0.0, X0[2], X0[3], X0[4], 0.0]
    x = _least_squares(_Arrays([r for r in rows if r.phase == "context"]), x, [0, 1, 2] if curve else [0, 2])
    x = _least_squares(_Arrays([r for r in rows if r.phase == "generation"]), x, [3, 4, 5] if per_seq else [3, 4])
    return tuple(x)


def current_model(c: PerfConfig | None = None) -> tuple[float, ...]:
    """The model today as ``NAMES``: ``eta_attn``, the GEMMs' ``eta_mem`` for the KV read, no fixed costs."""
    c = c or PerfConfig()
    return (c.eta_attn, 0.0, 0.0, c.eta_mem, 0.0, 0.0)


def summary(label: str, e: np.ndarray) -> str:
    return gemm_tables.summary(label, e, width=44)


def by_phase(rows: list[Row], e: np.ndarray) -> dict[str, np.ndarray]:
    """``e`` (one error per row) split into the context and generation rows'."""
    phase = np.array([r.phase for r in rows])
    return {p: e[phase == p] for p in ("context", "generation")}


def held_out(rows: list[Row], key: str, curve: bool = True, per_seq: bool = True) -> dict[str, np.ndarray]:
    """Each ``key`` group predicted by a fit on the others, split by phase."""
    e = gemm_tables.held_out(rows, key, lambda part: fit(part, curve, per_seq), errors)
    order = [r for v in sorted({getattr(r, key) for r in rows}) for r in rows if getattr(r, key) == v]
    return by_phase(order, e)


def _print_phases(label: str, parts: dict[str, np.ndarray], indent: str = "   ") -> None:
    for phase, e in parts.items():
        print(indent + summary(f"{label}, {phase}", e))


def _print_groups(rows: list[Row], x: tuple[float, ...]) -> None:
    for phase, bands in (("context", CONTEXT_BANDS), ("generation", DECODE_BANDS)):
        part = [r for r in rows if r.phase == phase]
        print(f"\nin sample, {phase} rows, by group (recommended fit):")
        gemm_tables.print_by_group(part, ("gpu", "engine", "kv_dtype"), lambda sub: errors(sub, x), 44)
        for engine, kv in sorted({(r.engine, r.kv_dtype) for r in part}):
            sub = [r for r in part if r.engine == engine and r.kv_dtype == kv]
            print("   " + summary(f"{engine}, KV {kv}", errors(sub, x)))
        gemm_tables.print_bands(part, "tokens", bands, lambda sub: errors(sub, x), 44)


def _own_fits(rows: list[Row]) -> None:
    """The recommended form fitted on one GPU or one engine alone: how far their coefficients lie apart."""
    print("\nthe recommended form fitted on one group alone (coefficients; its in-sample error per phase):")
    for key in ("gpu", "engine"):
        for value in sorted({getattr(r, key) for r in rows}):
            part = [r for r in rows if getattr(r, key) == value]
            x = fit(part)
            e = by_phase(part, errors(part, x))
            means = ", ".join(f"{p} {np.abs(v).mean() * 100:.1f} %" for p, v in e.items())
            print(
                f"   {key} {value:<14} "
                + ", ".join(f"{n} {v:.3g}" for n, v in zip(NAMES, x, strict=True))
                + f"  ({means})"
            )


def main(argv: list[str] | None = None) -> int:
    as_json = gemm_tables.wants_json(argv, __doc__, "the recommended coefficients")
    every = load()
    rows = fitted_rows(every)
    x = fit(rows)
    if as_json:
        print(json.dumps(dict(zip(NAMES, x, strict=True))))
        return 0
    n_ctx = sum(r.phase == "context" for r in rows)
    print(f"{len(every)} attention rows ({TABLE.name}: aiconfigurator-core 0.12.0), {len(rows)} fitted")
    print(f"({n_ctx} context, {len(rows) - n_ctx} generation)\n")
    c = PerfConfig()
    print(f"the model today (eta_attn {c.eta_attn:.3g}, eta_mem {c.eta_mem:.3g} for the KV read, no fixed cost):")
    _print_phases("in sample", by_phase(rows, errors(rows, current_model(c))))
    variants = (
        ("flat eta_attn, decode without attn_seq_ns", False, False),
        ("eta(s) curve, decode without attn_seq_ns", True, False),
        ("recommended: eta(s) curve, attn_seq_ns", True, True),
    )
    for label, curve, per_seq in variants:
        xv = fit(rows, curve, per_seq)
        print(f"\nfitted, {label}:\n   " + ", ".join(f"{n} {v:.3g}" for n, v in zip(NAMES, xv, strict=True)))
        _print_phases("in sample", by_phase(rows, errors(rows, xv)))
        for key in ("gpu", "engine"):
            _print_phases(f"leave-one-{key}-out", held_out(rows, key, curve, per_seq))
    _print_groups(rows, x)
    left = [r for r in every if left_out(r)]
    print("\nleft out: A100 TensorRT-LLM 1.0 generation rows (their KV read at up to "
          f"{max(kv_bandwidth_fraction(r) for r in left):.2f}x HBM bandwidth; fitted rows at most "
          f"{max(kv_bandwidth_fraction(r) for r in rows if r.phase == 'generation'):.2f}x):")  # fmt: skip
    print("   " + summary("against the recommended fit", errors(left, x)))
    _own_fits(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
