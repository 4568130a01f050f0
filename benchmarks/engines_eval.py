"""The vLLM and SGLang serving rows (anchors-train-engines.json) as samples, and the shipped profile on them.

    .venv/bin/python benchmarks/engines_eval.py [--json]

``load`` turns every row of ``anchors-train-engines.json`` (42 client-side serving measurements of vLLM
0.6-0.11 and SGLang 0.3-0.5.7) that the model can be given without reading the row's own published
outputs into a ``Sample``; ``benchmarks/anchors_loo.py`` fits the shipped profile on them and on
``anchors-train.json`` and holds each publication out (the held-out figures). This prints each row's
error under the shipped profile and the mean and worst absolute error per kind and per engine: **in
sample** since the profile was fitted on these rows (before that, it printed what a profile fitted on
TensorRT-LLM and NIM rows alone made of them: docs/cost-model.md).

How a row becomes a ``Sample`` (``perf/sample_predict.py`` ``predict_sample``, the definitions ``estimate``
prints; the engine is the row's):

* model: the catalog model of the same architecture (Llama-3.1-8B/70B-Instruct; Qwen3-8B; Qwen3-32B;
  Qwen3-235B-A22B for its Instruct-2507; DeepSeek-V3 for DeepSeek-R1-0528; an ``-FP8`` checkpoint as FP8
  weights);
* GPU: ``A100-80GB`` as A100-SXM-80GB (the source does not say SXM or PCIe), ``H100`` as H100-SXM, H200;
* lengths: a fixed length as given; ShareGPT prompts and outputs by their published totals over the
  requests: prompts at their mean length, outputs exponentially distributed around their mean
  (``output_dist="exponential"``: the maximum-entropy distribution given only the mean; a finite run
  ends with its longest outputs decoding at a small batch, ``perf/serving_run.py``); the SGLang v0.3.0
  vs vLLM 0.6.0 README rows publish no totals: **left out** (20 rows), as the issue allows, rather than
  assume a ShareGPT length the source does not give;
* load: a stated concurrency is the batch (a closed loop); all requests at once (an offline run) is the
  saturated batch: the fewest of the requests, the engine's default ``max_num_seqs`` for the GPU
  (``workload/memory_config.py``) and what toposched's memory estimate says the KV cache holds at the
  mean lengths; ``num_requests`` where the row states a number (InferenceX: its harness's 10 x concurrency);
  a closed loop's first ``c`` prompts arrive together (``ServingRun.mean_ttft_ms``);
* the prompt-token budget per pass: the server command's ``--chunked-prefill-size`` /
  ``--max-num-batched-tokens``, else the engine's default for the GPU (``workload/memory_config.py``);
* throughput per GPU times the GPUs; TTFT and TPOT as published (means; the rows that give medians
  only are among those left out).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from toposched.perf import get_gpu
from toposched.perf.latency import resolve_config
from toposched.perf.sample_predict import predict_sample
from toposched.perf.samples import Sample
from toposched.workload.catalog import resolve_model
from toposched.workload.dtypes import parse_weight_dtype
from toposched.workload.memory import estimate_memory
from toposched.workload.memory_config import MemoryConfig, sglang_chunked_prefill, vllm_batch_defaults

ROWS = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "data" / "anchors-train-engines.json"
MODELS = {  # source model -> (catalog model, weight dtype)
    "meta-llama/Llama-3.1-8B-Instruct": ("llama-3.1-8b", "bf16"),
    "meta-llama/Llama-3.1-70B-Instruct": ("llama-3.1-70b", "bf16"),
    "Qwen/Qwen3-8B": ("qwen3-8b", "bf16"),
    "Qwen/Qwen3-8B-FP8": ("qwen3-8b", "fp8"),
    "Qwen/Qwen3-32B": ("qwen3-32b", "bf16"),
    "Qwen/Qwen3-235B-A22B-Instruct-2507": ("qwen3-235b-a22b", "bf16"),
    "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8": ("qwen3-235b-a22b", "fp8"),
    "deepseek-ai/DeepSeek-R1-0528": ("deepseek-v3", "fp8"),
}
GPUS = (("A100", "A100-SXM-80GB"), ("H200", "H200"), ("H100", "H100-SXM"))
KINDS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "throughput": "tokens_per_s"}


def publication(row: dict[str, Any]) -> str:
    """The publication a row comes from (repository and document): the group held out together."""
    ref = row["source_ref"]
    return f"{ref['repository']} {ref.get('path') or ref.get('issue')}"


def _length(value: Any, total: Any, requests: int | None) -> int | None:
    """A fixed length, else the published total over the requests, else None."""
    if isinstance(value, int):
        return value
    if isinstance(total, int | float) and requests:
        return max(1, round(total / requests))
    return None


def _requests(setup: dict[str, Any]) -> int | None:
    """The requests of the run: a number, or the InferenceX harness's ``10 x concurrency``."""
    n = setup.get("num_requests")
    if isinstance(n, int):
        return n
    m = re.match(r"\s*(\d+)\s*x\s*concurrency", str(n or ""))
    if m and isinstance(setup.get("concurrency"), int):
        return int(m.group(1)) * setup["concurrency"]
    return None


def _budget(setup: dict[str, Any], engine: str, gpu: str) -> int:
    """The prompt-token budget per pass: the server command's flag, else the engine's default for the GPU."""
    command = " ".join(str(v) for k, v in setup.items() if "command" in k)
    m = re.search(r"--(?:chunked-prefill-size|max-num-batched-tokens)[= ](\d+)", command)
    if m:
        return int(m.group(1))
    memory = get_gpu(gpu).usable_memory_bytes
    return sglang_chunked_prefill(memory) if engine == "sglang" else vllm_batch_defaults(memory, gpu)[0]


def _saturated(spec_name: str, wdt: str, gpu: str, tp: int, engine: str, isl: int, osl: int, requests: int) -> int:
    """The batch of an offline run: requests, the engine's default max_num_seqs, what the KV cache holds."""
    g = get_gpu(gpu)
    spec = resolve_model(spec_name, weight_dtype=parse_weight_dtype(wdt))
    memory = g.usable_memory_bytes
    tokens, seqs = vllm_batch_defaults(memory, g.name)
    if engine == "sglang":
        tokens = sglang_chunked_prefill(memory)
    config = MemoryConfig(engine=engine, max_num_seqs=seqs, max_num_batched_tokens=tokens)
    held = estimate_memory(
        spec, gpu_memory_bytes=memory, tp=tp, max_model_len=isl + osl, num_seqs=1, config=config
    ).kv_tokens_capacity
    return max(1, min(requests, seqs, held // (isl + osl)))


def load(path: Path = ROWS) -> tuple[list[Sample], list[str]]:
    """(the rows as samples, the rows left out with why)."""
    samples: list[Sample] = []
    left: list[str] = []
    for r in json.loads(path.read_text()):
        s, extra = r["setup"], r.get("published_secondary") or {}
        mapped = MODELS.get(s["model"])
        gpu = next((key for pat, key in GPUS if pat in s["gpu"]), None)
        if mapped is None or gpu is None:
            left.append(f"{r['id']}: {s['model']} on {s['gpu'][:20]} is not in the catalog / GPU table")
            continue
        requests = _requests(s)
        count = extra.get("successful_requests") or requests
        isl = _length(s["input_len"], extra.get("total_input_tokens"), count)
        osl = _length(s["output_len"], extra.get("total_generated_tokens"), count)
        if isl is None or osl is None:
            left.append(f"{r['id']}: ShareGPT lengths with no published totals")
            continue
        if isinstance(s.get("output_len"), str) and isinstance(extra.get("total_generated_tokens"), int) and count:
            osl = max(1, round(extra["total_generated_tokens"] / count))  # requested != generated (no --ignore-eos)
        tp = int(s.get("tp") or 1)
        model, wdt = mapped
        engine = r["engine"]
        if isinstance(s.get("concurrency"), int):
            batch = s["concurrency"]
        elif str(s.get("request_rate")) == "inf" and requests:
            batch = _saturated(model, wdt, gpu, tp, engine, isl, osl, requests)
        else:
            left.append(f"{r['id']}: a Poisson rate with no concurrency")
            continue
        value = float(r["published_value"])
        if r["kind"] == "throughput" and "per gpu" in r["unit"].lower():
            value *= int(s.get("num_gpus") or tp)
        if r["kind"] != "throughput" and not re.search(r"\bmean\b", r["unit"]):
            left.append(f"{r['id']}: a median, not a mean")
            continue
        samples.append(
            Sample(
                source=r["id"],
                model=model,
                gpu=gpu,
                engine=engine,
                engine_version=r.get("engine_version"),
                tp=tp,
                weight_dtype=wdt,
                batch=batch,
                num_requests=requests,
                max_batched_tokens=_budget(s, engine, gpu),
                input_len=isl,
                output_len=osl,
                output_dist="exponential" if isinstance(s.get("output_len"), str) else "fixed",
                **{KINDS[r["kind"]]: value},
            )
        )
    return samples, left


def evaluate(samples: list[Sample]) -> list[dict[str, Any]]:
    """Each sample's kind, published and predicted value (shipped profile, the sample's engine)."""
    out = []
    for s in samples:
        kind = next(k for k, key in KINDS.items() if getattr(s, key) is not None)
        config = resolve_config(resolve_model(s.model, weight_dtype=parse_weight_dtype(s.weight_dtype or "bf16")),
                                get_gpu(s.gpu), None, s.engine)  # fmt: skip
        predicted = predict_sample(s, config)[KINDS[kind]]
        published = float(getattr(s, KINDS[kind]))
        out.append({"id": s.source, "engine": s.engine, "kind": kind, "batch": s.batch, "input_len": s.input_len,
                    "output_len": s.output_len, "published": published, "predicted": predicted,
                    "error": predicted / published - 1})  # fmt: skip
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Mean and worst |error| with n, per kind, per engine and kind, and over all rows."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        for key in (row["kind"], f"{row['engine']} {row['kind']}", "all"):
            groups.setdefault(key, []).append(row)
    return {
        key: {
            "n": len(members),
            "mean_abs": sum(abs(m["error"]) for m in members) / len(members),
            "worst": max(members, key=lambda m: abs(m["error"]))["id"],
            "worst_abs": max(abs(m["error"]) for m in members),
            "within_25": sum(abs(m["error"]) <= 0.25 for m in members),
        }
        for key, members in sorted(groups.items())
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    samples, left = load()
    rows = evaluate(samples)
    table = summary(rows)
    if args.json:
        print(json.dumps({"rows": rows, "summary": table, "left_out": left}, indent=1))
        return 0
    print(f"{len(rows)} rows predicted; {len(left)} left out" + "".join(f"\n  left out {w}" for w in left))
    print(f"\n{'row':62s} {'batch':>5s} {'in':>6s} {'out':>5s} {'published':>10s} {'predicted':>10s} {'err':>8s}")
    for row in rows:
        print(f"{row['id'][:62]:62s} {row['batch']:5d} {row['input_len']:6d} {row['output_len']:5d} "
              f"{row['published']:10.2f} {row['predicted']:10.2f} {100 * row['error']:+7.1f}%")  # fmt: skip
    print("\nmean |error| (n, worst, rows within 25 %):")
    for key, s in table.items():
        print(f"  {key:22s} n={s['n']:2d}  mean {100 * s['mean_abs']:6.1f} %  worst {100 * s['worst_abs']:6.1f} % "
              f"({s['worst']})  within 25 %: {s['within_25']}/{s['n']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
