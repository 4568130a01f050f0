"""Compare ``toposched estimate`` with the published measurements of perf-anchors.md section 3.1.

    .venv/bin/python benchmarks/estimate_anchors.py          # predicted vs measured, errors
    .venv/bin/python benchmarks/estimate_anchors.py --fit    # also refit the one global parameter

Predictions use the active calibration profile (the shipped ``data/profiles/default.json``, fitted
on reference/data/anchors-train.json by ``benchmarks/anchors_loo.py``; two NIM rows here are also
anchors there, the vLLM nightly rows are not). The NIM rows are predicted as a TensorRT engine, the
vLLM rows as vLLM (``engine=``: whether a prefill pays the host-launch cost). ``--fit`` refits
only ``step_overhead_ms`` on these decode anchors, from the profile's other coefficients, with
leave-one-out errors.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from toposched.perf import PerfConfig, get_gpu, get_link, predict_latency
from toposched.perf.latency import resolve_config
from toposched.workload import resolve_model


@dataclass(frozen=True)
class Anchor:
    label: str
    model: str
    weight_dtype: str
    gpu: str
    tp: int
    batch: int
    input_len: int
    output_len: int
    metric: str  # "tpot" (ITL), "step" (e2e / output_len), "ttft"
    measured_ms: float
    source: str

    @property
    def engine(self) -> str:
        """The engine as the cost model names it (``latency.prefill_launched_from_host``)."""
        return "nvidia-nim" if self.source.startswith("NIM") else "vllm"


ANCHORS = (
    Anchor("Llama-3.3-70B FP8 TP2 H100, 5000/500, conc 1", "llama-3.3-70b", "fp8", "H100-SXM", 2, 1, 5000, 500,
           "tpot", 18.58, "NIM 1.8.0 (TRT-LLM) ITL, perf-anchors §3.1"),
    Anchor("Llama-3.3-70B FP8 TP2 H100, 500/2000, conc 1", "llama-3.3-70b", "fp8", "H100-SXM", 2, 1, 500, 2000,
           "tpot", 18.91, "NIM 1.8.0 (TRT-LLM) ITL, perf-anchors §3.1"),
    Anchor("Llama-3-70B BF16 TP4 H200, batch 8, 32/128", "llama-3-70b", "bf16", "H200", 4, 8, 32, 128,
           "step", 2077.53 / 128, "vLLM nightly build 9515 e2e / 128, perf-anchors §3.1"),
    Anchor("Llama-3.1-8B BF16 TP1 H200, batch 8, 32/128", "llama-3.1-8b", "bf16", "H200", 1, 8, 32, 128,
           "step", 833.4 / 128, "vLLM nightly build 9515 e2e / 128, perf-anchors §3.1"),
    Anchor("Mixtral-8x7B BF16 TP2 H200, batch 8, 32/128", "mixtral-8x7b", "bf16", "H200", 2, 8, 32, 128,
           "step", 1917.4 / 128, "vLLM nightly build 9515 e2e / 128, perf-anchors §3.1"),
    Anchor("Llama-3.3-70B FP8 TP2 H100, 5000/500, conc 1", "llama-3.3-70b", "fp8", "H100-SXM", 2, 1, 5000, 500,
           "ttft", 406.77, "NIM 1.8.0 TTFT (client side), perf-anchors §3.1"),
    Anchor("Llama-3.3-70B FP8 TP2 H100, 500/2000, conc 1", "llama-3.3-70b", "fp8", "H100-SXM", 2, 1, 500, 2000,
           "ttft", 47.77, "NIM 1.8.0 TTFT (client side), perf-anchors §3.1"),
)  # fmt: skip


def predict(a: Anchor, overhead_ms: float | None = None) -> float:
    """The model's figure for the anchor's metric, in ms (the profile's overhead unless given)."""
    spec = resolve_model(a.model, weight_dtype=a.weight_dtype)  # type: ignore[arg-type]
    gpu = get_gpu(a.gpu)
    cfg: PerfConfig = resolve_config(spec, gpu, None, a.engine)
    if overhead_ms is not None:
        cfg = cfg.model_copy(update={"step_overhead_ms": overhead_ms})
    r = predict_latency(spec, gpu, tp=a.tp, link=get_link(gpu.native_link), batch=a.batch,
                        input_len=a.input_len, output_len=a.output_len, config=cfg, engine=a.engine)  # fmt: skip
    if a.metric == "tpot":
        return r.tpot_ms
    if a.metric == "step":
        return r.e2e_ms / a.output_len
    return r.ttft_ms


def fit_overhead(anchors: list[Anchor]) -> float:
    """Least-squares overhead (ms) for relative errors; every decode metric moves 1:1 with it."""
    num = den = 0.0
    for a in anchors:
        gap = a.measured_ms - predict(a, 0.0)
        num += gap / a.measured_ms**2
        den += 1 / a.measured_ms**2
    return num / den


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit step_overhead_ms and show leave-one-out errors")
    args = parser.parse_args(argv)
    decode = [a for a in ANCHORS if a.metric != "ttft"]
    if args.fit:
        fitted = fit_overhead(decode)
        print(f"fitted step_overhead_ms = {fitted:.2f} (profile: see data/profiles/default.json)")
        print("leave-one-out (overhead fitted on the other decode anchors):")
        for a in decode:
            o = fit_overhead([b for b in decode if b is not a])
            p = predict(a, o)
            err = 100 * (p / a.measured_ms - 1)
            print(f"  {a.label:48s} overhead {o:5.2f} ms  predicted {p:7.2f}  error {err:+6.1f} %")
        print()
    print(f"{'anchor':48s} {'metric':6s} {'measured':>9s} {'predicted':>9s} {'error':>8s}")
    worst = 0.0
    for a in ANCHORS:
        p = predict(a)
        err = 100 * (p / a.measured_ms - 1)
        worst = max(worst, abs(err)) if a.metric != "ttft" else worst
        print(f"{a.label:48s} {a.metric:6s} {a.measured_ms:9.2f} {p:9.2f} {err:+7.1f} %")
    print(f"worst decode error {worst:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
