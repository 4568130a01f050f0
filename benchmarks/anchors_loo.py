"""Leave-one-out and leave-one-source-out accuracy of the latency model on the published measurements:
the TensorRT-LLM/NIM anchors (anchors-train.json) and the vLLM/SGLang serving rows
(anchors-train-engines.json, set up by ``engines_eval.load``).

    .venv/bin/python benchmarks/anchors_loo.py                   # in-sample table, LOO, leave-one-group-out
    .venv/bin/python benchmarks/anchors_loo.py --write-profile   # also rewrite data/profiles/default.json
    .venv/bin/python benchmarks/anchors_loo.py --quick           # in-sample only (no refits)
    .venv/bin/python benchmarks/anchors_loo.py --anchors-only    # anchors-train.json alone (the old fit)
    .venv/bin/python benchmarks/anchors_loo.py --per-engine      # experiment: host costs per engine

Reads the ttft / tpot / throughput anchors, maps their models onto catalog models only where the
architecture is identical (below), turns each into a ``Sample`` as anchors-train.md says they
compare, fits ``PerfConfig`` on all of them and the engine rows (``perf/fitting.fit_config``) and,
for every row, refits without it and predicts it (leave-one-out), then holds out whole groups (a
publication, an engine, a GPU, a weight dtype: the headline). Refits start from the fit on all rows.
All-reduce anchors are compared separately with the link table (``perf/links.py``: measured curves,
alpha-beta beyond them, the two-level all-reduce for the 2-node rows; ``benchmarks/allreduce_fit.py``
for the fit itself).

How a setup becomes a ``Sample`` (no measured figure of the anchor itself enters its setup, except
as stated for QPS rows):
* concurrency rows: ``batch`` = the stated concurrency.
* QPS rows (TensorRT-LLM 0.14 online table): ``batch`` = Little's law, QPS x (TTFT + (OSL - 1) x ITL)
  with the TTFT and ITL published in the same table row (read from the quote). The TPOT anchors at
  QPS rows are therefore compared at a batch derived from their own published ITL (stated in
  docs/cost-model.md).
* ``num_requests`` from the setup (offline and QPS rows; finite runs of identical requests run in
  waves), ``request_rate`` = the QPS of QPS rows (open loop: throughput is the arrivals served).
* FP8 KV where the anchor says so, and for ModelOpt FP8 checkpoints (their notes: they quantize KV).
* ``engine``: the anchor's engine and version as one of ``latency.HOST_LAUNCHED_PREFILL`` /
  ``latency.TENSORRT_ENGINES`` (``_engine``): TensorRT-LLM 0.14 (Triton backend) and 0.15
  (``trtllm-bench`` TensorRT engine) run TensorRT engines, so does NIM 1.8's TensorRT-LLM profile;
  TensorRT-LLM 1.0 with ``--backend pytorch`` and 0.21 ``trtllm-serve`` of DeepSeek-R1 (a model only
  its PyTorch backend runs: ``tensorrt_llm/_torch/models/modeling_deepseekv3.py``) are
  ``tensorrt-llm-pytorch``.
* offline rows (all requests queued): ``batch`` = the saturated batch, min(TensorRT-LLM's build
  default ``max_batch_size`` 2048, KV tokens / (ISL + OSL)) with the KV pool 0.9 x (GPU memory -
  weights per GPU - 2 GiB) (``kv_cache_free_gpu_mem_fraction`` 0.9-0.95; weights = parameters x
  bytes per parameter / TP).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from toposched.perf import get_gpu
from toposched.perf.calibrate import fit_profile, leave_group_out, leave_one_out
from toposched.perf.coefficients import PerfConfig
from toposched.perf.fitting import DEFAULT_FIELDS, OPERATOR_FIELDS, engine_fitter, pooled_fitter
from toposched.perf.links import get_link, two_level_link
from toposched.perf.profile import save_profile
from toposched.perf.sample_predict import predict_sample
from toposched.perf.samples import Sample
from toposched.workload.catalog import resolve_model
from toposched.workload.dtypes import parse_kv_dtype, parse_weight_dtype, weight_format
from toposched.workload.memory import kv_bytes_per_token_per_layer

ANCHORS = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "data" / "anchors-train.json"
PROFILE = Path(__file__).resolve().parents[1] / "src" / "toposched" / "data" / "profiles" / "default.json"

# Anchor model -> catalog model, only where the architecture is identical.
MODEL_MAP = {
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",  # TRT-LLM display name "LLaMA v3.1 8B"
    "nvidia/Llama-3.1-8B-Instruct-FP8": "llama-3.1-8b",  # ModelOpt FP8 of the same architecture
    "meta-llama/Llama-3.1-70B": "llama-3.1-70b",
    "meta-llama/Llama-3.3-70B-Instruct": "llama-3.3-70b",  # = Llama-3.1-70B architecture
    "mistralai/Mixtral-8x7B-v0.1": "mixtral-8x7b",
    "mistralai/Mixtral-8x22B-v0.1": "mixtral-8x22b",
    "nvidia/Qwen3-235B-A22B-FP8": "qwen3-235b-a22b",
    "deepseek-ai/DeepSeek-R1": "deepseek-v3",  # DeepSeek-R1 = DeepSeek-V3 architecture
}
GPU_MAP = (  # (pattern in the anchor's GPU text, GPU table key)
    ("H200", "H200"),
    ("H100", "H100-SXM"),  # NIM's "2 x H100 80G" does not say SXM/PCIe: assumed SXM (HBM3 80GB)
    ("A100-SXM4-80GB", "A100-SXM-80GB"),
    ("L40S", "L40S"),
)
OFFLINE_MAX_BATCH = 2048  # TensorRT-LLM BuildConfig default max_batch_size
KV_FRACTION = 0.9
RESERVE_BYTES = 2 * 2**30
PERF_KINDS = ("ttft", "tpot", "throughput")


def _weight_dtype(text: str) -> str:
    return "fp8" if text.lower().startswith("fp8") else "bf16"


def _gpu(text: str) -> str | None:
    return next((key for pat, key in GPU_MAP if pat in text), None)


def _engine(engine: str, version: str) -> str:
    """The anchor's engine as the cost model names it (module docstring)."""
    text = f"{engine} {version}".lower()
    if text.startswith("nvidia-nim"):
        return "nvidia-nim"
    if "pytorch" in text or "trtllm-serve" in text:
        return "tensorrt-llm-pytorch"
    return "tensorrt-llm"


def _version(text: str) -> str | None:
    """The first version in an anchor's ``engine_version`` text (``v0.21.0rc2 (docker image ...)`` ->
    ``0.21.0rc2``, ``1.0 (doc revision for v1.0)`` -> ``1.0``), a sample's ``engine_version``."""
    m = re.search(r"\bv?(\d+(?:\.\d+)+(?:rc\d+|\.post\d+)?)", text)
    return m.group(1) if m else None


def _model(text: str) -> str | None:
    return MODEL_MAP.get(text.split(" (")[0].strip())


def _qps_row(quote: str, isl: int, osl: int, qps: float) -> tuple[float, float] | None:
    """(TTFT, ITL) in ms from the TensorRT-LLM 0.14 online table row of this QPS in the quote.

    Columns: ... | ISL | OSL | QPS | achieved QPS | TTFT | ITL | total tok/s | output tok/s |; rows
    after the first of a block leave ISL/OSL empty (``||||||16|15|30|11|...``).
    """
    q = f"{qps:g}"
    for pattern in (rf"\|{isl}\|{osl}\|{q}\|[\d.]+\|([\d.]+)\|([\d.]+)\|", rf"\|\|{q}\|[\d.]+\|([\d.]+)\|([\d.]+)\|"):
        m = re.search(pattern, quote)
        if m:
            return float(m.group(1)), float(m.group(2))
    return None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) else None


def _saturated_batch(model: str, gpu: str, tp: int, wdt: str, kvd: str | None, isl: int, osl: int) -> int:
    spec = resolve_model(model, weight_dtype=parse_weight_dtype(wdt), kv_dtype=parse_kv_dtype(kvd) if kvd else None)
    g = get_gpu(gpu)
    weights = spec.params_total * weight_format(spec.weight_dtype).bytes_per_param / tp
    pool = KV_FRACTION * (g.memory_bytes - weights - RESERVE_BYTES)
    tokens = pool / (kv_bytes_per_token_per_layer(spec, tp) * spec.num_layers)
    return max(1, min(OFFLINE_MAX_BATCH, int(tokens // (isl + osl))))


HOLD_OUT = ("source", "engine", "gpu", "dtype")
"""The groups held out whole (``leave_group_out``): the publication (a measurement campaign: the
``source`` up to its first comma), the engine as the cost model names it, the GPU, the weight dtype."""


def load_samples(path: Path = ANCHORS) -> tuple[list[Sample], list[str], dict[str, dict[str, str]]]:
    """(samples, skipped anchor ids with why, each sample's groups by ``HOLD_OUT`` kind, by anchor id)."""
    rows = json.loads(path.read_text())
    perf = [r for r in rows if r["kind"] in PERF_KINDS]
    samples: list[Sample] = []
    skipped: list[str] = []
    groups: dict[str, dict[str, str]] = {}
    for r in perf:
        s = r["setup"]
        model, gpu = _model(s["model"]), _gpu(s["gpu"])
        if model is None or gpu is None:
            skipped.append(f"{r['id']}: model {s['model']!r} / GPU {s['gpu']!r} not in the catalog")
            continue
        tp = _int(s.get("tp")) or 1
        wdt = _weight_dtype(str(s.get("weight_dtype")))
        kvd = "fp8" if str(s.get("kv_dtype", "")).lower().startswith("fp8") else None
        if kvd is None and "modelopt" in str(s.get("weight_dtype")).lower():
            kvd = "fp8"  # ModelOpt FP8 checkpoints quantize the KV cache to FP8 too (the anchor's notes)
        isl, osl = int(s["input_len"]), int(s["output_len"])
        qps = s.get("request_rate_qps")
        conc = _int(s.get("concurrency")) or _int(s.get("batch"))
        if conc is not None:
            batch = conc
        elif isinstance(qps, int | float):
            row = _qps_row(r["quote"], isl, osl, qps)
            if row is None:
                skipped.append(f"{r['id']}: no TTFT/ITL in the quoted table row for Little's law")
                continue
            ttft, itl = row
            batch = max(1, round(qps * (ttft + (osl - 1) * itl) / 1e3))
        elif "offline" in str(s.get("concurrency", "")):
            batch = _saturated_batch(model, gpu, tp, wdt, kvd, isl, osl)
        else:
            skipped.append(f"{r['id']}: load not stated")
            continue
        value = float(r["published_value"])
        unit = r["unit"].lower()
        if r["kind"] == "throughput" and "per gpu" in unit:
            value *= int(s.get("num_gpus") or tp)
        measured = {"ttft": "ttft_ms", "tpot": "tpot_ms", "throughput": "tokens_per_s"}[r["kind"]]
        samples.append(
            Sample(
                source=r["id"],
                model=model,
                gpu=gpu,
                engine=_engine(r["engine"], str(r.get("engine_version", ""))),
                engine_version=_version(str(r.get("engine_version", ""))),
                tp=tp,
                weight_dtype=wdt,
                kv_dtype=kvd,
                link=get_gpu(gpu).native_link,
                batch=batch,
                request_rate=float(qps) if conc is None and isinstance(qps, int | float) else None,
                num_requests=_int(s.get("num_requests")),
                input_len=isl,
                output_len=osl,
                **{measured: value},
            )
        )
        last = samples[-1]
        groups[r["id"]] = {"source": r["source"].split(",")[0], "engine": str(last.engine), "gpu": gpu, "dtype": wdt}
    return samples, skipped, groups


def _kind(s: Sample) -> str:
    return "ttft" if s.ttft_ms is not None else "tpot" if s.tpot_ms is not None else "throughput"


def _measured(s: Sample) -> float:
    return float(s.ttft_ms or s.tpot_ms or s.tokens_per_s or 0.0)


def _allreduce_rows(path: Path = ANCHORS) -> list[tuple[str, float, float]]:
    """(anchor id, published busbw, predicted busbw) with the link table's fit for the anchor's link."""
    out = []
    for r in json.loads(path.read_text()):
        if r["kind"] != "allreduce":
            continue
        s = r["setup"]
        n, size, nodes = int(s["num_gpus"]), float(s["message_size_bytes"]), int(s.get("nodes") or 1)
        text = f"{s['gpu']} {s.get('interconnect', '')} {r['id']}".lower()
        inside = "nvlink-bridge" if "bridge" in text else "nvlink3" if "a100" in text else "nvlink4"
        # 2-node rows: NVSwitch inside each node, RoCE 400G (one NIC per GPU) between them
        link = two_level_link("roce-400", inside, n // nodes) if nodes > 1 else get_link(inside)
        t_us = link.allreduce_us(size, n)
        out.append(
            (f"{r['id']} [{link.name}]", float(r["published_value"]), size / (t_us * 1e-6) * 2 * (n - 1) / n / 1e9)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="in-sample fit only, no leave-one-out")
    parser.add_argument("--write-profile", action="store_true", help=f"write {PROFILE.name} (runs fit_profile)")
    parser.add_argument(
        "--anchors-only",
        action="store_true",
        help="fit and validate on anchors-train.json alone, without the vLLM/SGLang rows (not with --write-profile)",
    )
    parser.add_argument(
        "--per-engine",
        action="store_true",
        help="an experiment: pooled coefficients plus host costs per engine (fitting.fit_engine_configs)",
    )
    args = parser.parse_args(argv)
    if (args.anchors_only or args.per_engine) and args.write_profile:
        parser.error("the shipped profile is fitted on both sets, pooled: --write-profile alone")
    samples, skipped, groups = load_samples()
    if not args.anchors_only:
        import engines_eval  # the benchmark next to this one

        extra, left = engines_eval.load()
        rows = {r["id"]: r for r in json.loads(engines_eval.ROWS.read_text())}
        for e in extra:
            source = engines_eval.publication(rows[e.source])
            groups[e.source] = {"source": source, "engine": str(e.engine), "gpu": e.gpu, "dtype": str(e.weight_dtype)}
        samples += extra
        skipped += [f"(engines) {why}" for why in left]
    print(f"{len(samples)} anchors used; skipped {len(skipped)}" + "".join(f"\n  skipped {s}" for s in skipped))
    t0 = time.perf_counter()
    fitter = (engine_fitter if args.per_engine else pooled_fitter)(warm=samples)  # refits start from the fit on all
    priced = fitter(samples)
    print(f"fit on all anchors in {time.perf_counter() - t0:.1f} s:")
    engines = sorted({str(s.engine) for s in samples}) if args.per_engine else []
    print(f"  {'':20s} {'pooled':>9s} " + " ".join(f"{e[:12]:>12s}" for e in engines))
    for f in (*OPERATOR_FIELDS, *DEFAULT_FIELDS):  # the operator-measured ones are not fitted here
        pooled = getattr(priced(samples[0].model_copy(update={"engine": None})), f)
        own = [getattr(priced(samples[0].model_copy(update={"engine": e})), f) for e in engines]
        print(f"  {f:20s} {pooled:9.4f} " + " ".join(f"{v:12.4f}" for v in own)
              + f"   (uncalibrated {getattr(PerfConfig(), f):g})")  # fmt: skip
    loo = dict((s.source, e) for s, e in leave_one_out(samples, fitter=fitter)) if not args.quick else {}
    print(f"\n{'anchor':48s} {'batch':>5s} {'published':>10s} {'in-sample':>10s} {'err':>7s} {'LOO err':>8s}")
    for s in samples:
        kind = _kind(s)
        key = {"ttft": "ttft_ms", "tpot": "tpot_ms", "throughput": "tokens_per_s"}[kind]
        pred = predict_sample(s, priced(s))[key]
        loo_txt = f"{100 * loo[s.source][kind]:+7.1f}%" if s.source in loo else ""
        print(f"{s.source:48s} {s.batch:5d} {_measured(s):10.2f} {pred:10.2f} {100 * (pred / _measured(s) - 1):+6.1f}% "
              f"{loo_txt}")  # fmt: skip
    if loo:
        print("\nleave-one-out (refit without the anchor, then predict it):")
        for kind in PERF_KINDS:
            errs = [abs(e[kind]) for e in loo.values() if kind in e]
            worst = max(((abs(e[kind]), sid) for sid, e in loo.items() if kind in e), default=(0.0, "-"))
            print(f"  {kind:10s} n={len(errs):2d}  mean abs {100 * sum(errs) / len(errs):5.1f} %   "
                  f"worst {100 * worst[0]:5.1f} % ({worst[1]})")  # fmt: skip
        print(f"  total time {time.perf_counter() - t0:.1f} s")
    print("\nall-reduce anchors vs the link table (not refitted here; 2-node rows: perf.links.two_level_link):")
    for label, pub, pred in _allreduce_rows():
        print(f"  {label:56s} published {pub:7.2f} GB/s  predicted {pred:7.2f}  {100 * (pred / pub - 1):+6.1f} %")
    if not args.quick:
        print("\nleave-one-group-out (refit without every anchor of the group, then predict them):")
        trained = {s.source for s in load_samples()[0]}
        sets = (
            ((" (anchors-train)", lambda sid: sid in trained), (" (engine rows)", lambda sid: sid not in trained))
            if not args.anchors_only
            else ()
        )
        for by in HOLD_OUT:
            held = leave_group_out(samples, lambda s, by=by: groups[s.source][by], fitter=fitter)
            count = len({groups[s.source][by] for s in samples})
            print(f"  by {by} ({count} groups; {len(samples) - len(held)} anchors in a group of all, left out):")
            for kind in PERF_KINDS:
                errs = [(abs(e[kind]), s.source) for s, e in held if kind in e]
                for label, keep in (("", lambda _s: True), *sets):
                    part = [(e, sid) for e, sid in errs if keep(sid)]
                    if part and (not label or len(part) < len(errs)):
                        worst, mean = max(part), sum(e for e, _ in part) / len(part)
                        print(f"    {kind + label:22s} n={len(part):2d}  mean abs {100 * mean:5.1f} %"
                              f"   worst {100 * worst[0]:5.1f} % ({worst[1]})")  # fmt: skip
    if args.write_profile:
        profile = fit_profile(
            samples, name="default",
            source=f"published measurements: reference/data/anchors-train.json and anchors-train-engines.json "
                   f"({len(samples)} ttft/tpot/throughput rows; benchmarks/anchors_loo.py --write-profile)",
            progress=print, scoped=False,  # the shipped profile prices every setup: a catch-all entry
            fields=DEFAULT_FIELDS,  # the GEMM term's coefficients are measured on operator tables
            per_group=False,  # one pooled entry: the fit the held-out figures above measure
        )  # fmt: skip
        save_profile(profile, PROFILE)
        print(f"wrote {PROFILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
