"""Extract the operator tables the cost model is checked against from NVIDIA's aiconfigurator-core wheel.

    pip download --no-deps aiconfigurator-core==0.12.0 -d /tmp/aic     # 82 MB wheel, Apache-2.0
    pip install --target /tmp/pa pyarrow                               # to read its parquet tables
    PYTHONPATH=/tmp/pa .venv/bin/python benchmarks/aic_extract.py /tmp/aic/aiconfigurator_core-0.12.0-*.whl

aiconfigurator-core ships per-GPU, per-engine tables of operator latencies measured on the GPU
(``aiconfigurator_core/systems/data/<gpu>/gemm/<engine>/<version>/gemm_perf.parquet``: one GEMM
``m x k`` by ``k x n`` per row, its dtype, the kernel the engine uses and the latency in ms). This
script keeps a grid of them small enough to vendor (``tests/data/reference/data/aiconfigurator_gemm.csv``,
which ``benchmarks/gemm_tables.py`` and its test read; nothing at test time needs the wheel or pyarrow):

* GPUs A100-SXM4-80GB (``A100-SXM-80GB`` in the CSV), H100-SXM (80 GB HBM3), H200 (``H200-SXM``): the GPUs
  of the serving anchors that have tables (the wheel's L40S folder has no GEMM table);
* dtypes ``bfloat16``, ``fp8`` (per-tensor scaled) and ``fp8_block`` (128 x 128 block scales: DeepSeek,
  Qwen3 FP8 checkpoints);
* every engine table present (vLLM, SGLang, TensorRT-LLM; one version each, the newest);
* ``m`` (tokens) at powers of two from 1 to 16,384 and ``n``, ``k`` in {1,024, 2,048, 4,096, 8,192,
  16,384} (the shard shapes of 8B-405B models at TP 1-8 lie in that range);
* where an engine has several kernels for one dtype and shape (vLLM's three FP8 block kernels), the
  fastest (what its kernel selection aims for).

and the fused MoE layer's tables (``.../moe/<engine>/<version>/moe_perf.parquet``: the experts' grouped
GEMMs with their routing permutes, one MoE layer per row) into ``aiconfigurator_moe.csv``
(``benchmarks/moe_tables.py``): the expert shapes of the catalog's MoE models (Mixtral-8x7B and 8x22B,
Qwen3-235B-A22B, DeepSeek-V3/R1), expert TP 1-8 without expert parallelism, tokens spread evenly over
the experts (``balanced``), the same GPUs and dtypes, for each engine the newest version whose table
has those shapes, the fastest kernel per row.

and the attention kernels' tables (``.../attention/<engine>/<version>/context_attention_perf.parquet`` and
``generation_attention_perf.parquet``; one version each on these GPUs) into ``aiconfigurator_attention.csv``
(``benchmarks/attention_tables.py``). What a row is, from the wheel's own code (``sdk/models/llama.py``,
``sdk/operations/attention.py``) and its engine (``sdk/engine.py``'s single-op evaluation):

* one attention kernel call of one layer: the models build ``ContextAttention``/``GenerationAttention``
  with ``scale_factor = num_layers`` and the heads one GPU holds after TP (``num_heads // tp_size`` query
  heads, ``num_kv_heads_per_gpu`` KV heads), so ``num_heads``/``num_key_value_heads`` are per GPU;
* ``context``: ``batch_size`` prompts of ``isl`` tokens each, causal, nothing cached before (``step``
  0), in the engine's own attention kernel (``kernel``: ``vllm_flash_attn_fa3`` and SGLang's ``fa3`` on
  Hopper, ``vllm_flash_attn`` and SGLang's ``flash_attention`` on A100, TensorRT-LLM's attention op through
  its PyTorch flow, ``torch_flow``). The wheel's engine charges 13.2 us on top of every context row
  (queried on A100, H100 and H200, every engine, 32/8 and 8/1 heads, 1-16 prompts of 16-4,096 tokens: the
  same each time; 39.6 us with QK-norm on H100), its RoPE and KV-cache-write memory ops (``operations/attention.py``:
  "QK-norm, apply-RoPE, KV-write"): for the wheel a row is the attention kernel without them. Its SOL for
  a context row (H100, vLLM) is ``2 b isl^2 (q heads x head_dim)`` FLOPs and ``b isl (2 q + 2 kv heads) head_dim x 2``
  bytes (Q, K, V read, O written);
* ``generation``: ``batch_size`` sequences decoding one token (``isl`` 1) over ``step`` tokens already
  cached, i.e. attending to ``step + 1`` tokens (``step`` is 2^k - 1; the engine's query at context ``s``
  is within 2.5 % of the ``step = s - 1`` row); no memory op is added; its SOL is the KV read,
  ``b (step + 1) kv heads head_dim x 2 x bytes``, and ``4 b (step + 1) (q heads x head_dim)`` FLOPs;
* kept: head_dim 128, no sliding window, beam 1, BF16 attention math (``attn_dtype``), KV cache BF16 or
  FP8 where the table has it (TensorRT-LLM and vLLM context on Hopper, every Hopper generation table);
  the (q heads, kv heads) per GPU of the catalog's non-MLA models at TP 1, 2, 4, 8 (``ATTN_HEADS``) that
  the table has: none has 7/1, 14/2, 20/5, 28/4 or 40/10 (Qwen2.5-7B at TP 1-4, Phi-4 at TP 1-2), no
  context table and no vLLM generation table 128/8 (Llama-3.1-405B at TP 1), A100's none of 5/1, 6/1,
  10/2, 20/4 and A100 SGLang's and TensorRT-LLM's generation tables none of 12/2, 24/4, 40/8, 48/8;
  batch 1-256 (context) and 1-1,024 (generation) at powers of four, prompts of 16-16,384 tokens
  (``ISLS``), contexts of 16-65,536 tokens (``STEPS``); one kernel per table and shape.
"""

from __future__ import annotations

import csv
import io
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "data"
OUT = DATA / "aiconfigurator_gemm.csv"
MOE_OUT = DATA / "aiconfigurator_moe.csv"
ATTN_OUT = DATA / "aiconfigurator_attention.csv"
ATTN_PATH = re.compile(
    r"aiconfigurator_core/systems/data/([^/]+)/attention/([^/]+)/([^/]+)/(context|generation)_attention_perf\.parquet$"
)
ATTN_HEADS = {(4, 1), (5, 1), (6, 1), (7, 1), (8, 1), (8, 2), (10, 2), (12, 2), (14, 2), (16, 1), (16, 2), (16, 4)}
ATTN_HEADS |= {(20, 4), (20, 5), (24, 4), (28, 4), (32, 2), (32, 4), (32, 8), (40, 8), (40, 10), (48, 8), (64, 4)}
ATTN_HEADS |= {(64, 8), (128, 8)}
"""(q heads, kv heads) per GPU of the catalog's non-MLA models at TP 1, 2, 4, 8 (head_dim 128)."""
BATCHES = {1, 4, 16, 64, 256, 1024}
ISLS = {16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384}
STEPS = {4**i - 1 for i in range(2, 9)}
MOE_SHAPES = {(4096, 14336, 8, 2), (6144, 16384, 8, 2), (4096, 1536, 128, 8), (7168, 2048, 256, 8)}
"""(hidden, expert intermediate, experts, experts per token) of the catalog's MoE models."""
MOE_PATH = re.compile(r"aiconfigurator_core/systems/data/([^/]+)/moe/([^/]+)/([^/]+)/moe_perf\.parquet$")
GPUS = {"a100_sxm": "A100-SXM-80GB", "h100_sxm": "H100-SXM", "h200_sxm": "H200-SXM"}
DTYPES = ("bfloat16", "fp8", "fp8_block")
MS = {2**i for i in range(15)}
NK = {1024, 2048, 4096, 8192, 16384}
PATH = re.compile(r"aiconfigurator_core/systems/data/([^/]+)/gemm/([^/]+)/([^/]+)/gemm_perf\.parquet$")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    import pandas as pd  # pyarrow underneath; only this script needs it

    wheel = zipfile.ZipFile(argv[0])
    newest: dict[tuple[str, str], tuple[str, str]] = {}
    for name in wheel.namelist():
        m = PATH.search(name)
        if m and m.group(1) in GPUS:
            key = (m.group(1), m.group(2))
            if key not in newest or _version_key(m.group(3)) > _version_key(newest[key][0]):
                newest[key] = (m.group(3), name)
    rows: list[tuple[str, str, str, str, int, int, int, float]] = []
    for (gpu, engine), (version, name) in sorted(newest.items()):
        table = pd.read_parquet(io.BytesIO(wheel.read(name)))
        table = table[table.gemm_dtype.isin(DTYPES) & table.m.isin(MS) & table.n.isin(NK) & table.k.isin(NK)]
        best = table.groupby(["gemm_dtype", "m", "n", "k"], as_index=False)["latency"].min()
        for r in best.itertuples(index=False):
            rows.append((GPUS[gpu], engine, version, str(r.gemm_dtype), int(r.m), int(r.n), int(r.k), float(r.latency)))
        print(f"{gpu} {engine} {version}: {len(best)} rows", file=sys.stderr)
    with OUT.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gpu", "engine", "version", "dtype", "m", "n", "k", "latency_ms"])
        for row in sorted(rows):
            w.writerow([*row[:7], f"{row[7]:.6g}"])
    print(f"wrote {OUT} ({len(rows)} rows)", file=sys.stderr)
    _moe(wheel, pd)
    _attention(wheel, pd)
    return 0


def _moe(wheel: zipfile.ZipFile, pd: Any) -> None:
    found: dict[tuple[str, str], list[tuple[str, Any]]] = {}
    for name in wheel.namelist():
        m = MOE_PATH.search(name)
        if not m or m.group(1) not in GPUS:
            continue
        table = pd.read_parquet(io.BytesIO(wheel.read(name)))
        shape = list(zip(table.hidden_size, table.inter_size, table.num_experts, table.topk, strict=True))
        table = table[
            pd.Series([s in MOE_SHAPES for s in shape], index=table.index)
            & table.moe_dtype.isin(DTYPES)
            & (table.moe_ep_size == 1)
            & table.moe_tp_size.isin([1, 2, 4, 8])
            & (table.distribution == "balanced")
        ]
        if len(table):
            found.setdefault((m.group(1), m.group(2)), []).append((m.group(3), table))
    keys = ["moe_dtype", "num_tokens", "hidden_size", "inter_size", "num_experts", "topk", "moe_tp_size"]
    rows = []
    for (gpu, engine), versions in sorted(found.items()):
        version, table = max(versions, key=lambda v: _version_key(v[0]))
        best = table.groupby(keys, as_index=False)["latency"].min()
        for r in best.itertuples(index=False):
            shape = (int(r.num_tokens), int(r.hidden_size), int(r.inter_size), int(r.num_experts), int(r.topk))
            rows.append((GPUS[gpu], engine, version, str(r.moe_dtype), *shape, int(r.moe_tp_size), float(r.latency)))
        print(f"{gpu} {engine} {version}: {len(best)} MoE rows", file=sys.stderr)
    with MOE_OUT.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["gpu", "engine", "version", "dtype", "tokens", "hidden", "inter", "experts", "topk", "tp", "latency_ms"]
        )
        for row in sorted(rows):
            w.writerow([*row[:10], f"{row[10]:.6g}"])
    print(f"wrote {MOE_OUT} ({len(rows)} rows)", file=sys.stderr)


def _attention(wheel: zipfile.ZipFile, pd: Any) -> None:
    newest: dict[tuple[str, str, str], tuple[str, str]] = {}
    for name in wheel.namelist():
        m = ATTN_PATH.search(name)
        if m and m.group(1) in GPUS:
            table = (m.group(1), m.group(2), m.group(4))
            if table not in newest or _version_key(m.group(3)) > _version_key(newest[table][0]):
                newest[table] = (m.group(3), name)
    rows: list[tuple[Any, ...]] = []
    for (gpu, engine, phase), (version, name) in sorted(newest.items()):
        t = pd.read_parquet(io.BytesIO(wheel.read(name)))
        window = t.window_size == 0 if "window_size" in t else True
        heads = pd.Series(
            [h in ATTN_HEADS for h in zip(t.num_heads, t.num_key_value_heads, strict=True)], index=t.index
        )
        lengths = t.isl.isin(ISLS) if phase == "context" else (t.isl == 1) & t.step.isin(STEPS)
        t = t[
            window
            & heads
            & lengths
            & (t.head_dim == 128)
            & (t.beam_width == 1)
            & (t.attn_dtype == "bfloat16")
            & t.kv_cache_dtype.isin(["bfloat16", "fp8"])
            & t.batch_size.isin(BATCHES)
        ]
        for r in t.itertuples(index=False):
            shape = (int(r.num_heads), int(r.num_key_value_heads), int(r.head_dim), int(r.batch_size), int(r.isl))
            rows.append((GPUS[gpu], engine, version, phase, str(r.kernel_source), str(r.kv_cache_dtype), *shape,
                         int(r.step), float(r.latency)))  # fmt: skip
        print(f"{gpu} {engine} {version} {phase}: {len(t)} attention rows", file=sys.stderr)
    header = ["gpu", "engine", "version", "phase", "kernel", "kv_dtype", "q_heads", "kv_heads", "head_dim"]
    with ATTN_OUT.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*header, "batch", "isl", "step", "latency_ms"])
        for row in sorted(rows):
            w.writerow([*row[:12], f"{row[12]:.6g}"])
    print(f"wrote {ATTN_OUT} ({len(rows)} rows)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
