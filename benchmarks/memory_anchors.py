"""Weights and KV capacity predicted by workload/memory.py against the published anchors.

Reads ``reference/data/anchors-train.json`` (70 published measurements; this script uses the 34
``weights`` and ``kv_capacity`` ones), predicts each with ``estimate_memory`` under the anchor's own
setup (engine, TP, dtypes, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens, the GPU total
the engine reported), and prints per-anchor errors, the mean absolute error and the worst case per kind.

The constants memory.py fits (non-torch memory at TP=1 and TP>1, the sampler's bytes per logit and
the profile intercept, the CUDA-graph rule) are re-fitted here from the anchors' logged
``memory_profile_rank0`` components, first on all runs (in-sample) and then leaving out each model in
turn (all its runs: one vLLM log = one weights and one KV anchor): the leave-one-model-out errors are
the accuracy claim.

    .venv/bin/python benchmarks/memory_anchors.py [--anchors PATH] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toposched.inputs import load_json, read_text
from toposched.perf.hardware import get_gpu
from toposched.workload.catalog import resolve_model
from toposched.workload.dtypes import KvDtype, WeightDtype
from toposched.workload.memory import estimate_memory, moe_workspace, padded_vocab
from toposched.workload.memory_config import GIB, MIB, MemoryConfig, vllm_batch_defaults
from toposched.workload.spec import ModelSpec

DEFAULT_ANCHORS = Path(__file__).resolve().parents[1] / "tests/data/reference/data/anchors-train.json"

# Anchor model -> (catalog model, weight dtype override). The RedHatAI FP8-dynamic checkpoint is
# Qwen2.5-7B-Instruct with compressed-tensors FP8 channel-wise weights and only lm_head ignored.
MODELS: dict[str, tuple[str, WeightDtype | None]] = {
    "Qwen/Qwen2.5-7B-Instruct": ("qwen2.5-7b", None),
    "RedHatAI/Qwen2.5-7B-Instruct-fp8-dynamic": ("qwen2.5-7b", "fp8"),
    "Qwen/Qwen3-8B": ("qwen3-8b", None),
    "Qwen/Qwen3-30B-A3B": ("qwen3-30b-a3b", None),
    "Qwen/Qwen2.5-72B-Instruct": ("qwen2.5-72b", None),
    "meta-llama/Llama-3.1-8B-Instruct": ("llama-3.1-8b", None),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": ("mixtral-8x7b", None),
    "deepseek-ai/DeepSeek-V2-Lite-Chat": ("deepseek-v2-lite", None),
    "microsoft/phi-4": ("phi-4", None),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": ("deepseek-r1-distill-qwen-14b", None),
}
SKIPPED: dict[str, str] = {
    "moonshotai/Kimi-Dev-72B": "config.json not known exactly (a Qwen2.5-72B fine-tune; not added to the catalog)",
    "openai/gpt-oss-20b": "MXFP4 experts and the sliding-window/sink hybrid KV allocator are not modelled",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": "multimodal checkpoint (vision tower) and chunked-local attention",
    "Qwen/QwQ-32B": "QwQ-32B config not in the catalog; the SGLang run is on an NVIDIA L4, not in the GPU table",
}
GPUS = {"H100": "H100-SXM", "RTX 4090": "RTX-4090"}


@dataclass(frozen=True)
class Run:
    """One engine start-up (a log): its anchors share the setup and the memory profile."""

    key: str
    spec: ModelSpec
    setup: dict[str, Any]
    total_bytes: int
    profile: dict[str, float] | None
    anchors: tuple[dict[str, Any], ...]
    v019: bool


def _gpu_total(setup: dict[str, Any]) -> int:
    reported = setup.get("gpu_memory_total_gib_reported")
    if reported:
        return round(float(reported) * GIB)
    name = next((v for k, v in GPUS.items() if k in str(setup.get("gpu", ""))), None)
    if name is None:
        raise ValueError(f"no GPU for {setup.get('gpu')}")
    return get_gpu(name).usable_memory_bytes


def load_runs(path: Path) -> tuple[list[Run], list[tuple[str, str]]]:
    """Group the weights/KV anchors by run; return the runs and (anchor id, reason) skipped."""
    anchors = load_json(read_text(path, what="anchors"), source=str(path))
    runs: dict[str, list[dict[str, Any]]] = {}
    skipped: list[tuple[str, str]] = []
    for a in anchors:
        if a["kind"] not in ("weights", "kv_capacity"):
            continue
        model = a["setup"]["model"]
        if model in SKIPPED:
            skipped.append((a["id"], SKIPPED[model]))
            continue
        runs.setdefault(a["source"] + "|" + str(a["setup"].get("kv_dtype")), []).append(a)
    out = []
    for key, group in runs.items():
        setup = group[0]["setup"]
        name, wdtype = MODELS[setup["model"]]
        kv: KvDtype | None = "fp8" if str(setup.get("kv_dtype", "")).startswith("fp8") else None
        if str(setup.get("weight_dtype", "")).startswith("fp8"):
            wdtype = "fp8"
        spec = resolve_model(name, weight_dtype=wdtype, kv_dtype=kv)
        profile = next((a["published_secondary"].get("memory_profile_rank0") for a in group), None)
        v019 = "v0.19" in group[0]["engine_version"]
        out.append(Run(key, spec, setup, _gpu_total(setup), profile, tuple(group), v019))
    return out, skipped


def _config(run: Run, consts: dict[str, float]) -> MemoryConfig:
    s = run.setup
    tokens, seqs = vllm_batch_defaults(run.total_bytes, str(s.get("gpu", "")))
    return MemoryConfig(
        gpu_memory_utilization=s.get("gpu_memory_utilization") or 0.92,
        max_num_seqs=s.get("max_num_seqs") or seqs,
        max_num_batched_tokens=s.get("max_num_batched_tokens") or tokens,
        # v0.19 (and V0) did not deduct the CUDA-graph estimate (anchors-train.md); 0.33 does
        deduct_cudagraph=False,
        non_torch_bytes=round(consts["non_torch_tp1"] * GIB),
        comm_buffer_bytes=round((consts["non_torch_multi"] - consts["non_torch_tp1"]) * GIB),
        sampler_bytes_per_logit=consts["sampler_bytes_per_logit"],
        profile_base_bytes=round(consts["profile_base"] * GIB),
        cudagraph_base_bytes=round(consts["cudagraph_base"] * GIB),
        cudagraph_per_layer_bytes=round(consts["cudagraph_per_layer"] * GIB),
    )


def _least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Slope and intercept of y = a x + b."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return a, my - a * mx


def fit(runs: list[Run]) -> dict[str, float]:
    """The constants from the runs' logged memory profiles (vLLM v0.19 runs only)."""
    prof = [r for r in runs if r.profile and r.v019]
    tp1 = [r.profile["non_torch_gib"] for r in prof if r.setup["tp"] == 1 and r.profile]
    multi = [r.profile["non_torch_gib"] for r in prof if r.setup["tp"] > 1 and r.profile]
    xs, ys = [], []
    for r in prof:
        assert r.profile is not None
        s = r.setup
        tokens = s["max_num_batched_tokens"]
        hidden = tokens * r.spec.hidden_size * 2
        ws = moe_workspace(r.spec, range(r.spec.num_layers), tp=s["tp"], ep=1, tokens=tokens)
        xs.append(min(s["max_num_seqs"], tokens) * padded_vocab(r.spec.vocab_size))
        ys.append(r.profile["peak_activation_gib"] * GIB - hidden - ws)
    slope, intercept = _least_squares(xs, ys)
    g_slope, g_base = _least_squares(
        [float(r.spec.num_layers) for r in prof], [r.profile["cudagraph_gib"] for r in prof if r.profile]
    )
    return {
        "non_torch_tp1": statistics.fmean(tp1),
        "non_torch_multi": statistics.fmean(multi),
        "sampler_bytes_per_logit": slope,
        "profile_base": intercept / GIB,
        "cudagraph_base": g_base,
        "cudagraph_per_layer": g_slope,
    }


def predict(run: Run, consts: dict[str, float]) -> list[dict[str, Any]]:
    """Predicted vs published for each anchor of ``run``."""
    s = run.setup
    cfg = _config(run, consts)
    est = estimate_memory(run.spec, gpu_memory_bytes=run.total_bytes, tp=s["tp"], pp=s.get("pp") or 1,
                          max_model_len=s.get("max_model_len"), config=cfg)  # fmt: skip
    rows = []
    for a in run.anchors:
        pred = est.weights_bytes_per_gpu / GIB if a["kind"] == "weights" else float(est.kv_tokens_capacity)
        pub = float(a["published_value"])
        rows.append({"id": a["id"], "kind": a["kind"], "predicted": pred, "published": pub,
                     "error": (pred - pub) / pub, "activation_gib": est.activation_bytes / GIB,
                     "non_torch_gib": est.non_torch_bytes / GIB, "cudagraph_gib": est.cudagraph_bytes / GIB,
                     "profile": run.profile})  # fmt: skip
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean absolute and worst error per kind."""
    out = {}
    for kind in ("weights", "kv_capacity"):
        errs = [abs(r["error"]) for r in rows if r["kind"] == kind]
        if errs:
            out[kind] = {"n": len(errs), "mean_abs": statistics.fmean(errs), "worst": max(errs)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--anchors", type=Path, default=DEFAULT_ANCHORS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    runs, skipped = load_runs(args.anchors)
    consts = fit(runs)
    base = MemoryConfig()
    shipped = {
        "non_torch_tp1": base.non_torch_bytes / GIB,
        "non_torch_multi": (base.non_torch_bytes + base.comm_buffer_bytes) / GIB,
        "sampler_bytes_per_logit": base.sampler_bytes_per_logit,
        "profile_base": base.profile_base_bytes / GIB,
        "cudagraph_base": base.cudagraph_base_bytes / GIB,
        "cudagraph_per_layer": base.cudagraph_per_layer_bytes / GIB,
    }
    with_shipped = [row for r in runs for row in predict(r, shipped)]
    in_sample = [row for r in runs for row in predict(r, consts)]
    loo: list[dict[str, Any]] = []
    for r in runs:
        # hold out every run of the same model (the Qwen2.5-7B runs differ only in TP or dtypes)
        held = fit([o for o in runs if o.spec.name != r.spec.name])
        loo.extend(predict(r, held))
    shipped_summary, in_summary, loo_summary = summary(with_shipped), summary(in_sample), summary(loo)
    doc = {"constants": consts, "shipped_constants": shipped, "shipped": shipped_summary,
           "in_sample": in_summary, "leave_one_out": loo_summary,
           "anchors": [{k: v for k, v in row.items() if k != "profile"} for row in loo],
           "skipped": [{"id": i, "reason": why} for i, why in skipped]}  # fmt: skip
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print("fitted constants (all runs): " + ", ".join(f"{k}={v:.4g}" for k, v in consts.items()))
    print(f"(cudagraph: base GiB + per-layer GiB; sampler: bytes per logit; {MIB} B = 1 MiB)")
    print(f"{'anchor':48} {'published':>12} {'LOO pred':>12} {'LOO err':>8} {'in-sample':>9}")
    for row, ins in zip(loo, in_sample, strict=True):
        print(f"{row['id']:48} {row['published']:12.6g} {row['predicted']:12.6g} {row['error']:+8.1%} "
              f"{ins['error']:+9.1%}")  # fmt: skip
    print("components (logged vs predicted GiB, first anchor of each run):")
    seen = set()
    for row in in_sample:
        p = row["profile"]
        if p and row["id"][3:] not in seen:
            seen.add(row["id"][3:])
            print(f"  {row['id'][3:]:45} activation {p['peak_activation_gib']:.2f}/{row['activation_gib']:.2f}  "
                  f"non-torch {p['non_torch_gib']:.2f}/{row['non_torch_gib']:.2f}  "
                  f"cudagraph {p['cudagraph_gib']:.2f}/{row['cudagraph_gib']:.2f}")  # fmt: skip
    blocks = (("shipped consts", shipped_summary), ("in-sample", in_summary), ("leave-one-out", loo_summary))
    for label, block in blocks:
        for kind, v in block.items():
            print(f"{label:14} {kind:12} n={v['n']:2d} mean abs {v['mean_abs']:.1%} worst {v['worst']:.1%}")
    for i, why in skipped:
        print(f"skipped {i}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
