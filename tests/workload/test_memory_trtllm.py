"""TensorRT-LLM's KV rule: a fraction of the memory free after weights and buffers, not of the total."""

from __future__ import annotations

import math

import pytest

from toposched.errors import InfeasibleError
from toposched.workload.catalog import resolve_model
from toposched.workload.memory import estimate_memory
from toposched.workload.memory_config import (
    GIB,
    TRTLLM_FREE_FRACTION,
    MemoryConfig,
    trtllm_fraction_for,
    trtllm_kv_budget,
)

H100 = round(79.19 * GIB)


def test_the_pool_is_a_share_of_what_is_free_after_weights_activations_and_buffers() -> None:
    spec = resolve_model("llama-3.1-70b")
    cfg = MemoryConfig(engine="trtllm", max_num_seqs=8)
    est = estimate_memory(spec, gpu_memory_bytes=H100, tp=4, max_model_len=8192, num_seqs=8, config=cfg)
    free = H100 - est.weights_bytes_per_gpu - est.activation_bytes - est.non_torch_bytes
    assert est.kv_budget_bytes == math.floor(free * TRTLLM_FREE_FRACTION)
    assert est.workspace_bytes == est.non_torch_bytes + est.cudagraph_bytes and est.fits
    # vLLM's rule takes 0.92 of the total first: the same model keeps less KV there
    vllm = estimate_memory(spec, gpu_memory_bytes=H100, tp=4, max_model_len=8192, num_seqs=8,
                           config=MemoryConfig(max_num_seqs=8))  # fmt: skip
    assert vllm.kv_budget_bytes < est.kv_budget_bytes


def test_a_larger_fraction_gives_a_larger_pool_until_cuda_graphs_no_longer_fit() -> None:
    spec = resolve_model("llama-3.1-8b")
    pools = []
    for fraction in (0.5, 0.9, 0.999):
        cfg = MemoryConfig(engine="trtllm", max_num_seqs=8, kv_cache_free_gpu_memory_fraction=fraction)
        est = estimate_memory(spec, gpu_memory_bytes=H100, tp=1, max_model_len=8192, num_seqs=8, config=cfg)
        pools.append(est)
    assert pools[0].kv_budget_bytes < pools[1].kv_budget_bytes < pools[2].kv_budget_bytes
    assert pools[1].fits and not pools[2].fits
    assert "CUDA graphs need" in pools[2].reasons[-1]


def test_the_launch_fraction_inverts_the_rule() -> None:
    free = 40 * GIB
    for kv in (1, 7 * GIB, 30 * GIB, free):
        fraction = trtllm_fraction_for(kv, free)
        assert trtllm_kv_budget(free, fraction) <= kv or fraction == 0.001
        assert kv - trtllm_kv_budget(free, fraction) <= free / 1000 + 1 or fraction == 0.001
    assert trtllm_fraction_for(free * 2, free) == 1.0
    with pytest.raises(InfeasibleError):
        trtllm_fraction_for(0, free)
    assert trtllm_kv_budget(-5, 0.9) == -5  # nothing free: the shortfall, as the other rules report it


def test_weights_that_do_not_fit_leave_no_pool() -> None:
    cfg = MemoryConfig(engine="trtllm")
    est = estimate_memory(resolve_model("llama-3.1-70b"), gpu_memory_bytes=H100, tp=1, config=cfg)
    assert est.kv_budget_bytes <= 0 and not est.fits and "over the" in est.reasons[0]
