"""Leave-one-group-out: the latency model refitted without a whole family of anchors, then predicting them.

    .venv/bin/python benchmarks/anchors_lgo.py

``anchors_loo.py`` holds out one anchor at a time, so the other rows of the same model or engine stay in
the fit and can carry it. This holds out a family at once (every DeepSeek-R1 row, every NIM 1.8 row,
every TensorRT-LLM 1.0 row, every L40S row, every TP=8 row), refits ``PerfConfig`` on the rest
(``perf/fitting.fit_config``) and prints what the family's rows are predicted at, with the fitted
coefficients that move most: a coefficient that collapses when one family is out rests on that family.
"""

from __future__ import annotations

from collections.abc import Callable

from anchors_loo import load_samples

from toposched.perf.fitting import fit_config
from toposched.perf.sample_predict import relative_errors
from toposched.perf.samples import Sample

FAMILIES: dict[str, Callable[[Sample], bool]] = {
    "DeepSeek-R1 (TRT-LLM 0.21 PyTorch backend)": lambda s: "dsr1" in s.source,
    "NIM 1.8": lambda s: "nim18" in s.source,
    "TensorRT-LLM 1.0": lambda s: "trt10" in s.source,
    "L40S": lambda s: "l40s" in s.source,
    "every TP=8 row": lambda s: s.tp == 8,
}


def main() -> None:
    samples, _skipped, _ids = load_samples()
    full = fit_config(samples)
    print(
        f"all {len(samples)} rows: comm_scale {full.comm_scale:.2f}, prefill_kernel_factor "
        f"{full.prefill_kernel_factor:.2f}, mla_layer_us {full.mla_layer_us:.1f}"
    )
    for family, member in FAMILIES.items():
        held = [s for s in samples if member(s)]
        cfg = fit_config([s for s in samples if not member(s)])
        print(
            f"\nwithout {family} ({len(held)} rows): comm_scale {cfg.comm_scale:.2f}, prefill_kernel_factor "
            f"{cfg.prefill_kernel_factor:.2f}, mla_layer_us {cfg.mla_layer_us:.1f}"
        )
        for s in held:
            errors = ", ".join(f"{k} {100 * v:+.0f}%" for k, v in relative_errors(s, cfg).items())
            print(f"  {s.source[:48]:48} {errors}")


if __name__ == "__main__":
    main()
