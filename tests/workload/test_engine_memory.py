"""Engine-aware KV sizing: vLLM 0.33's profile rule, SGLang's mem_fraction_static, usable memory,
FP8 checkpoints that keep modules in 16 bits."""

from __future__ import annotations

import math

import pytest

from tests.workload.builders import make_spec
from toposched.perf.hardware import get_gpu
from toposched.workload.catalog import resolve_model
from toposched.workload.memory import estimate_memory, padded_vocab
from toposched.workload.memory_config import GIB, MemoryConfig, sglang_default_mem_fraction, vllm_batch_defaults

H100_REPORTED = round(79.19 * GIB)
# the published vLLM v0.19 runs (anchors-train.json): utilisation 0.95, 1024 seqs, 8192 tokens, and
# v0.19 did not yet deduct the CUDA-graph estimate
V019 = MemoryConfig(gpu_memory_utilization=0.95, max_num_seqs=1024, max_num_batched_tokens=8192, deduct_cudagraph=False)


def test_in_sample_vllm_anchors_qwen_7b_tp1_and_llama_8b_tp2() -> None:
    """IN-SAMPLE check: these two runs are among the anchors the fitted constants (non-torch memory,
    sampler bytes per logit, profile intercept) were fitted to; the accuracy claim is the
    leave-one-out table of benchmarks/memory_anchors.py, not this test."""
    qwen = estimate_memory(resolve_model("qwen2.5-7b"), gpu_memory_bytes=H100_REPORTED, tp=1,
                           max_model_len=8192, config=V019)  # fmt: skip
    assert qwen.weights_bytes_per_gpu / GIB == pytest.approx(14.25, rel=0.01)  # "Model loading took 14.25 GiB"
    assert qwen.kv_tokens_capacity == pytest.approx(1_096_000, rel=0.02)  # "GPU KV cache size: 1,096,000 tokens"
    llama = estimate_memory(resolve_model("llama-3.1-8b"), gpu_memory_bytes=H100_REPORTED, tp=2,
                            max_model_len=8192, config=V019)  # fmt: skip
    assert llama.weights_bytes_per_gpu / GIB == pytest.approx(7.51, rel=0.01)
    assert llama.kv_tokens_capacity == pytest.approx(1_044_688, rel=0.02)


def test_tp_does_not_shrink_the_sampler_peak() -> None:
    spec = resolve_model("qwen2.5-7b")
    acts = [estimate_memory(spec, gpu_memory_bytes=H100_REPORTED, tp=tp, config=V019).activation_bytes for tp in (1, 4)]
    # compute_logits gathers the whole vocabulary on every rank: the sampler warm-up is not / tp
    assert acts[0] == acts[1]
    assert acts[1] > V019.sampler_bytes_per_logit * 1024 * padded_vocab(spec.vocab_size)
    fewer = estimate_memory(
        spec, gpu_memory_bytes=H100_REPORTED, tp=4, config=V019.model_copy(update={"max_num_seqs": 512})
    )
    assert acts[1] - fewer.activation_bytes == pytest.approx(
        V019.sampler_bytes_per_logit * 512 * padded_vocab(spec.vocab_size), rel=1e-6
    )


def test_non_torch_memory_grows_with_a_second_gpu() -> None:
    spec = resolve_model("qwen2.5-7b")
    tp1 = estimate_memory(spec, gpu_memory_bytes=H100_REPORTED, tp=1, config=V019)
    tp2 = estimate_memory(spec, gpu_memory_bytes=H100_REPORTED, tp=2, config=V019)
    assert tp1.non_torch_bytes == V019.non_torch_bytes
    assert tp2.non_torch_bytes == V019.non_torch_bytes + V019.comm_buffer_bytes > tp1.non_torch_bytes


def test_cudagraph_estimate_is_deducted_by_default_in_vllm_033() -> None:
    spec = resolve_model("llama-3.1-8b")
    new = estimate_memory(
        spec, gpu_memory_bytes=H100_REPORTED, tp=1, config=V019.model_copy(update={"deduct_cudagraph": True})
    )
    old = estimate_memory(spec, gpu_memory_bytes=H100_REPORTED, tp=1, config=V019)
    assert new.cudagraph_bytes == old.cudagraph_bytes > 0
    assert old.kv_budget_bytes - new.kv_budget_bytes == new.cudagraph_bytes
    fixed = V019.model_copy(update={"deduct_cudagraph": True, "cudagraph_bytes": GIB})
    assert estimate_memory(spec, gpu_memory_bytes=H100_REPORTED, tp=1, config=fixed).kv_budget_bytes == (
        old.kv_budget_bytes - GIB
    )
    assert MemoryConfig().deduct_cudagraph  # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 by default


def test_sglang_has_no_activation_deduction() -> None:
    spec = resolve_model("qwen2.5-7b")
    cfg = MemoryConfig(engine="sglang", mem_fraction_static=0.85)
    est = estimate_memory(spec, gpu_memory_bytes=H100_REPORTED, tp=2, config=cfg)
    assert est.activation_bytes == 0 and est.engine == "sglang"
    free_before_load = H100_REPORTED - est.non_torch_bytes
    assert est.kv_budget_bytes == math.floor(free_before_load * 0.85) - est.weights_bytes_per_gpu
    # vLLM's sampler warm-up grows with max_num_seqs; SGLang's pool does not
    more = cfg.model_copy(update={"max_num_seqs": 4096})
    assert estimate_memory(spec, gpu_memory_bytes=H100_REPORTED, tp=2, config=more).kv_tokens_capacity == (
        est.kv_tokens_capacity
    )
    v = estimate_memory(spec, gpu_memory_bytes=H100_REPORTED, tp=2, config=V019)
    v_more = estimate_memory(
        spec, gpu_memory_bytes=H100_REPORTED, tp=2, config=V019.model_copy(update={"max_num_seqs": 4096})
    )
    assert v_more.kv_tokens_capacity < v.kv_tokens_capacity


def test_sglang_default_mem_fraction_follows_memory_hook() -> None:
    # H100 as reported: 81,091 MiB; reserved = 512 + 8192 x 1.5 + 1/8 x 1024 + 256 x 2 = 13,440 MiB
    assert sglang_default_mem_fraction(H100_REPORTED, tp=1) == round((79.19 * 1024 - 13_440) / (79.19 * 1024), 3)
    # a 24 GiB card: chunked prefill 4096, graph bs 48, no 10 GiB floor
    assert sglang_default_mem_fraction(24 * GIB, tp=2) == round((24 * 1024 - (512 + 6144 + 256 + 96)) / (24 * 1024), 3)
    assert sglang_default_mem_fraction(H100_REPORTED, tp=8) < sglang_default_mem_fraction(H100_REPORTED, tp=1)


def test_vllm_batch_defaults_by_gpu() -> None:
    assert vllm_batch_defaults(H100_REPORTED, "H100-SXM") == (8192, 1024)
    assert vllm_batch_defaults(80 * GIB, "A100-SXM-80GB") == (2048, 256)  # A100s keep the small tier
    assert vllm_batch_defaults(get_gpu("B200").usable_memory_bytes, "B200") == (16384, 1024)
    assert vllm_batch_defaults(48 * 10**9, "L40S") == (2048, 256)


def test_usable_memory_is_the_reported_total() -> None:
    h100 = get_gpu("H100-SXM")
    assert h100.usable_memory_bytes == H100_REPORTED < h100.memory_bytes
    l40s = get_gpu("L40S")
    assert l40s.reported_memory_bytes is None and l40s.usable_memory_bytes == l40s.memory_bytes


FP8_LIST = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.0.self_attn.o_proj",
    "model.layers.3.mlp.down_proj",
    "lm_head",
]


def test_fp8_modules_not_converted_are_counted_at_16_bits() -> None:
    plain = make_spec(quantization_config={"quant_method": "fbgemm_fp8"})
    kept = make_spec(quantization_config={"quant_method": "fbgemm_fp8", "modules_to_not_convert": FP8_LIST})
    assert plain.weight_dtype == kept.weight_dtype == "fp8"
    assert kept.unquantized == {(0, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")} | {(3, "down_proj")}
    w_plain = estimate_memory(plain, gpu_memory_bytes=H100_REPORTED).weights_bytes_per_gpu
    w_kept = estimate_memory(kept, gpu_memory_bytes=H100_REPORTED).weights_bytes_per_gpu
    a = kept.attention_params()
    # each listed projection costs one more byte per parameter (16 bits instead of 8)
    assert w_kept - w_plain == a.q_and_o + a.kv + kept.hidden_size * kept.intermediate_size
    # at tp=2 the kept q/o projections are split like the quantised ones
    half = estimate_memory(kept, gpu_memory_bytes=H100_REPORTED, tp=2).stages[0].weights.attention
    half_plain = estimate_memory(plain, gpu_memory_bytes=H100_REPORTED, tp=2).stages[0].weights.attention
    assert half - half_plain == (a.q_and_o + a.kv) // 2


def test_compressed_tensors_fp8_with_ignore_patterns() -> None:
    quant = {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}, "targets": ["Linear"]}},
        "ignore": ["lm_head", "re:.*self_attn.*"],
    }
    spec = make_spec(quantization_config=quant)
    assert spec.weight_dtype == "fp8"  # the baseline read this checkpoint as int4
    assert {layer for layer, _ in spec.unquantized} == set(range(spec.num_layers))
    assert {p for _, p in spec.unquantized} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    int8 = make_spec(quantization_config={**quant, "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}})
    assert int8.weight_dtype == "int8"
    # a bf16 checkpoint quantised online (--weight-dtype fp8) has no ignore list: everything is fp8
    assert resolve_model("llama-3.1-8b", weight_dtype="fp8").unquantized == frozenset()
