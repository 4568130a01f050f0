"""Capacity fallbacks, in the order DESIGN.md gives them, with the bytes each one saves.

1. FP8 KV cache, 2. INT8 KV cache, 3. INT4 KV cache (only when the request allows it),
4. activation checkpointing, modelled as capping the batched tokens of one forward pass
(chunked prefill) so the transient activation peak shrinks. Queueing, the last resort, is the
solver's business. Each step is applied on top of the previous ones; ``saves_bytes`` is what that
step alone frees per GPU for the requested sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toposched.workload.dtypes import KvDtype, kv_element_bytes
from toposched.workload.memory import MemoryEstimate, estimate_memory
from toposched.workload.memory_config import MemoryConfig
from toposched.workload.spec import ModelSpec


@dataclass(frozen=True)
class Fallback:
    """One capacity fallback and its effect on one GPU."""

    name: str
    description: str
    saves_bytes: int
    kv_tokens_capacity: int
    fits: bool


_KV_STEPS: tuple[tuple[KvDtype, str], ...] = (
    ("fp8", "FP8 KV cache (--kv-cache-dtype fp8)"),
    ("int8", "INT8 KV cache (int8_per_token_head)"),
    ("int4", "INT4 KV cache (int4_per_token_head; only if the request allows it)"),
)


def capacity_fallbacks(
    spec: ModelSpec,
    *,
    gpu_memory_bytes: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    max_model_len: int | None = None,
    num_seqs: int = 1,
    config: MemoryConfig | None = None,
) -> tuple[Fallback, ...]:
    """The fallbacks that apply to this instance, in order, each on top of the ones before."""
    cfg = config or MemoryConfig()
    base = estimate_memory(
        spec, gpu_memory_bytes=gpu_memory_bytes, tp=tp, pp=pp, ep=ep,
        max_model_len=max_model_len, num_seqs=num_seqs, config=cfg,
    )  # fmt: skip
    demand_tokens = num_seqs * math.ceil(base.max_model_len / cfg.block_size) * cfg.block_size
    out: list[Fallback] = []
    current_spec, current = spec, base
    current_elem = kv_element_bytes(spec.kv_dtype, spec.activation_dtype)
    for kv_dtype, description in _KV_STEPS:
        elem = kv_element_bytes(kv_dtype, spec.activation_dtype)
        if elem >= current_elem or (kv_dtype == "int4" and not cfg.allow_int4_kv):
            continue
        next_spec = current_spec.with_dtypes(kv_dtype=kv_dtype)
        nxt = estimate_memory(
            next_spec, gpu_memory_bytes=gpu_memory_bytes, tp=tp, pp=pp, ep=ep,
            max_model_len=max_model_len, num_seqs=num_seqs, config=cfg,
        )  # fmt: skip
        saved = (current.kv_bytes_per_token_per_gpu - nxt.kv_bytes_per_token_per_gpu) * demand_tokens
        out.append(Fallback(kv_dtype + "-kv", description, saved, nxt.kv_tokens_capacity, nxt.fits))
        current_spec, current, current_elem = next_spec, nxt, elem
    if cfg.checkpoint_batched_tokens < cfg.max_num_batched_tokens:
        ckpt_cfg = cfg.model_copy(update={"max_num_batched_tokens": cfg.checkpoint_batched_tokens})
        nxt = estimate_memory(
            current_spec, gpu_memory_bytes=gpu_memory_bytes, tp=tp, pp=pp, ep=ep,
            max_model_len=max_model_len, num_seqs=num_seqs, config=ckpt_cfg,
        )  # fmt: skip
        out.append(
            Fallback(
                "activation-checkpointing",
                f"cap batched tokens at {cfg.checkpoint_batched_tokens} (chunked prefill)",
                current.activation_bytes - nxt.activation_bytes,
                nxt.kv_tokens_capacity,
                nxt.fits,
            )
        )
    return tuple(out)


def first_fit(base: MemoryEstimate, fallbacks: tuple[Fallback, ...]) -> Fallback | None:
    """The first fallback after which the instance fits (``None`` if it already fits or never does)."""
    if base.fits:
        return None
    return next((f for f in fallbacks if f.fits), None)
