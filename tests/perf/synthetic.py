"""Samples whose 'measurements' are the cost model's own figures under given coefficients (fit tests)."""

from __future__ import annotations

from toposched.perf import PerfConfig
from toposched.perf.sample_predict import predict_sample
from toposched.perf.samples import Sample

SETUPS = [
    ("llama-3.1-8b", "H100-SXM", 1, "bf16", 1, 500, 200),
    ("llama-3.1-8b", "H100-SXM", 1, "bf16", 32, 1000, 200),
    ("llama-3.1-70b", "H100-SXM", 4, "bf16", 1, 2000, 100),
    ("llama-3.1-70b", "H100-SXM", 4, "fp8", 64, 1000, 500),
    ("llama-3.1-8b", "A100-SXM-80GB", 1, "bf16", 256, 1000, 1000),
    ("llama-3.1-70b", "H200", 8, "fp8", 8, 4000, 300),
]


def made_by(cfg: PerfConfig, engine: str | None = None, tag: str = "s") -> list[Sample]:
    """One sample per ``SETUPS`` row whose TTFT, TPOT and throughput are the model's under ``cfg``."""
    out = []
    for i, (model, gpu, tp, wdt, batch, isl, osl) in enumerate(SETUPS):
        probe = Sample(source=f"{tag}{i}", model=model, gpu=gpu, engine=engine, tp=tp, weight_dtype=wdt,
                       batch=batch, input_len=isl, output_len=osl, ttft_ms=1.0, tpot_ms=1.0,
                       tokens_per_s=1.0)  # fmt: skip
        out.append(probe.model_copy(update=predict_sample(probe, cfg)))
    return out
