"""Engine memory settings (``MemoryConfig``) and the engines' defaults that size an instance's memory:
vLLM's batch defaults, SGLang's ``mem_fraction_static`` and chunked prefill, TensorRT-LLM's free-memory
fraction, and the constants fitted to the published vLLM v0.19 memory profiles. ``workload/memory.py``
applies them (``estimate_memory``).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from toposched.errors import InfeasibleError

GIB = 1024**3
MIB = 1024**2

Engine = Literal["vllm", "sglang", "trtllm"]
ENGINES: tuple[Engine, ...] = get_args(Engine)

# ---- constants fitted to the published vLLM v0.19 memory profiles (anchors-train.json,
# `memory_profile_rank0`); benchmarks/memory_anchors.py prints the fit and its leave-one-out errors.
FIT_NON_TORCH_TP1_GIB = 0.25
"""Mean logged non-torch memory of the TP=1 runs (CUDA context, cuBLAS workspace)."""
FIT_NON_TORCH_MULTI_GIB = 2.08
"""Mean logged non-torch memory of the TP>1 runs (adds NCCL and custom all-reduce buffers)."""
FIT_SAMPLER_BYTES_PER_LOGIT = 14.7
"""Sampler warm-up peak per (max_num_seqs x padded vocab) logit: fp32 logits, their sort values
and int64 indices (top-k/top-p), least squares over the dense runs' logged activation peaks."""
FIT_PROFILE_BASE_GIB = 0.05
"""Intercept of that least-squares fit (small buffers alive through the profile run)."""
FIT_CUDAGRAPH_BASE_GIB = 0.48
"""CUDA-graph estimate: intercept of the least-squares fit on the logged ``cudagraph_gib``."""
FIT_CUDAGRAPH_PER_LAYER_MIB = 15.1
"""CUDA-graph estimate: slope per decoder layer on the GPU."""

TRTLLM_FREE_FRACTION = 0.9
"""TensorRT-LLM's default ``--kv_cache_free_gpu_memory_fraction`` (trtllm-serve-options.json)."""


class MemoryConfig(BaseModel):
    """Engine memory settings; defaults are vLLM 0.33.0's on an H100/H200-class GPU (API server)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Engine = "vllm"
    """Whose sizing rule: ``vllm`` (profile run), ``sglang`` (mem_fraction_static) or ``trtllm`` (free fraction)."""
    gpu_memory_utilization: float = Field(0.92, gt=0.0, le=1.0)
    """vLLM: fraction of total GPU memory this instance may use (``CacheConfig`` default 0.92)."""
    mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0)
    """SGLang: weights + KV pool over GPU memory; None = SGLang's default rule for the GPU."""
    kv_cache_free_gpu_memory_fraction: float = Field(TRTLLM_FREE_FRACTION, gt=0.0, le=1.0)
    """TensorRT-LLM: share of the memory free after weights, activations and buffers that the KV pool takes."""
    block_size: int = Field(16, ge=1, le=1024)
    """Tokens per KV block (vLLM ``CacheConfig.DEFAULT_BLOCK_SIZE = 16``, engines.md §1.1)."""
    max_num_batched_tokens: int = Field(8192, ge=1)
    """Tokens in the profiling forward pass (vLLM 0.33 ``get_batch_defaults``: 8192 for the API
    server on >= 70 GiB non-A100 GPUs; ``vllm_batch_defaults`` gives the other tiers)."""
    max_num_seqs: int = Field(1024, ge=1)
    """Rows of the sampler warm-up (vLLM 0.33 default 1024 on H100/H200/B200, 256 elsewhere)."""
    non_torch_bytes: int = Field(round(FIT_NON_TORCH_TP1_GIB * GIB), ge=0)
    """CUDA context and cuBLAS workspace at TP=1 (fitted, see FIT_NON_TORCH_TP1_GIB)."""
    comm_buffer_bytes: int = Field(round((FIT_NON_TORCH_MULTI_GIB - FIT_NON_TORCH_TP1_GIB) * GIB), ge=0)
    """Extra non-torch memory with tp*pp > 1: NCCL and custom all-reduce buffers (fitted)."""
    sampler_bytes_per_logit: float = Field(FIT_SAMPLER_BYTES_PER_LOGIT, ge=0.0, le=64.0)
    """Sampler warm-up bytes per logit (max_num_seqs x padded vocab), fitted."""
    profile_base_bytes: int = Field(round(FIT_PROFILE_BASE_GIB * GIB), ge=0)
    """Constant part of the profiled activation peak (fitted)."""
    deduct_cudagraph: bool = True
    """vLLM >= 0.21 deducts its CUDA-graph estimate from the KV pool; v0.19 (the anchors) did not."""
    cudagraph_bytes: int | None = Field(None, ge=0)
    """A known CUDA-graph size (vLLM logs "Estimated CUDA graph memory"); None = the fitted rule."""
    cudagraph_base_bytes: int = Field(round(FIT_CUDAGRAPH_BASE_GIB * GIB), ge=0)
    """Fitted rule: base + per layer x decoder layers on the GPU."""
    cudagraph_per_layer_bytes: int = Field(round(FIT_CUDAGRAPH_PER_LAYER_MIB * MIB), ge=0)
    """Fitted rule: bytes per decoder layer on the GPU."""
    checkpoint_batched_tokens: int = Field(2048, ge=1)
    """Token cap used by the activation-checkpointing fallback (chunked prefill's 2048 chunk)."""
    allow_int4_kv: bool = False
    """Whether the int4 KV fallback may be offered (DESIGN.md: only if the request allows it)."""


def vllm_batch_defaults(gpu_memory_bytes: int, gpu_name: str = "") -> tuple[int, int]:
    """vLLM 0.33.0's default (max_num_batched_tokens, max_num_seqs) for the OpenAI API server.

    ``vllm/engine/arg_utils.py`` ``get_batch_defaults``: >= 160 GiB: 16384 / 1024; >= 70 GiB and not
    an A100: 8192 / 1024; otherwise 2048 / 256. (The offline ``LLM`` class uses larger token budgets.)
    """
    if gpu_memory_bytes >= 160 * GIB:
        return 16384, 1024
    if gpu_memory_bytes >= 70 * GIB and "a100" not in gpu_name.lower():
        return 8192, 1024
    return 2048, 256


def sglang_chunked_prefill(gpu_memory_bytes: int) -> int:
    """SGLang 0.5.23's default ``chunked_prefill_size`` by GPU memory (memory_hook.py)."""
    mib = gpu_memory_bytes / MIB
    if mib < 20 * 1024:
        return 2048
    if mib < 90 * 1024:
        return 4096 if mib < 60 * 1024 else 8192
    return 8192 if mib < 160 * 1024 else 16384


def _sglang_decode_graph_bs(gpu_memory_bytes: int, tp: int) -> int:
    mib = gpu_memory_bytes / MIB
    if mib < 20 * 1024:
        return 8
    if mib < 35 * 1024:
        return 48 if tp < 4 else 160
    if mib < 60 * 1024:
        return 32 if tp < 4 else 160
    if mib < 160 * 1024:
        return 256 if tp < 4 else 512
    return 512


def sglang_default_mem_fraction(gpu_memory_bytes: int, tp: int = 1, pp: int = 1) -> float:
    """SGLang 0.5.23's default ``mem_fraction_static`` (``handle_gpu_memory_settings``).

    reserved MiB = 512 + max(chunked_prefill_size, 2048) x 1.5 + tp x pp / 8 x 1024 + decode CUDA-graph
    max batch x 2, at least 10 GiB on GPUs above 60 GiB; fraction = round((memory - reserved) / memory, 3).
    Prefill CUDA graphs, DP attention and DeepEP reserves are off by default and not modelled.
    """
    mib = gpu_memory_bytes / MIB
    reserved = 512 + max(sglang_chunked_prefill(gpu_memory_bytes), 2048) * 1.5 + tp * pp / 8 * 1024
    reserved += _sglang_decode_graph_bs(gpu_memory_bytes, tp) * 2
    if mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return max(0.01, round((mib - reserved) / mib, 3))


def trtllm_free_bytes(gpu_memory_bytes: int, weights: int, activations: int, non_torch: int) -> int:
    """Memory TensorRT-LLM finds free when it sizes the KV pool: after the weights, the profiling
    forward's peak and the memory outside PyTorch (CUDA graphs come later, from what the pool leaves)."""
    return gpu_memory_bytes - weights - activations - non_torch


def trtllm_kv_budget(free_bytes: int, fraction: float) -> int:
    """TensorRT-LLM's KV pool: ``fraction`` of the free memory (nothing when nothing is free)."""
    return math.floor(free_bytes * fraction) if free_bytes > 0 else free_bytes


def trtllm_fraction_for(kv_bytes: int, free_bytes: int) -> float:
    """The ``--kv_cache_free_gpu_memory_fraction`` whose pool is at most ``kv_bytes`` (3 decimals, rounded
    down, at least 0.001): how a plan's KV reservation becomes a TensorRT-LLM launch setting."""
    if kv_bytes <= 0 or free_bytes <= 0:
        raise InfeasibleError(f"no KV pool to size: {kv_bytes} KV bytes planned, {free_bytes} bytes free")
    return max(0.001, min(1.0, math.floor(kv_bytes / free_bytes * 1000) / 1000))
