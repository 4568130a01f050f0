"""The per-GPU HBM estimator: weights, KV bytes per token, capacity, fallbacks, degrees."""

from __future__ import annotations

import pytest

from tests.workload.builders import make_spec
from toposched.errors import InfeasibleError
from toposched.workload.catalog import resolve_model
from toposched.workload.fallbacks import capacity_fallbacks, first_fit
from toposched.workload.memory import estimate_memory
from toposched.workload.memory_config import GIB, MemoryConfig
from toposched.workload.parallel import check_degrees, stage_layers, valid_tps

H100 = 80 * GIB
H200 = 141 * GIB


def test_llama_31_70b_kv_bytes_per_token() -> None:
    spec = resolve_model("llama-3.1-70b")
    est = estimate_memory(spec, gpu_memory_bytes=H100, tp=4)
    assert est.kv_bytes_per_token_model == 327_680
    assert est.kv_bytes_per_token_per_gpu == 81_920
    assert estimate_memory(spec, gpu_memory_bytes=H100, tp=8).kv_bytes_per_token_per_gpu == 40_960


def test_kv_heads_replicated_when_tp_exceeds_them() -> None:
    spec = resolve_model("llama-3.1-70b")  # 8 KV heads
    tp16 = estimate_memory(spec, gpu_memory_bytes=H100, tp=16)
    assert tp16.kv_bytes_per_token_per_gpu == 40_960  # still one head per rank, not half of one
    tp8 = estimate_memory(spec, gpu_memory_bytes=H100, tp=8)
    # replicated K/V projections: tp=16 holds more than half of tp=8's attention weights
    assert tp16.stages[0].weights.attention > tp8.stages[0].weights.attention / 2


def test_deepseek_v3_mla_latent_not_sharded() -> None:
    spec = resolve_model("deepseek-v3")
    for tp in (1, 8):
        est = estimate_memory(spec, gpu_memory_bytes=H200, tp=tp)
        assert est.kv_bytes_per_token_per_gpu == 70_272
    assert estimate_memory(spec, gpu_memory_bytes=H200, tp=8).kv_bytes_per_token_model == 70_272
    fp8 = estimate_memory(spec.with_dtypes(kv_dtype="fp8"), gpu_memory_bytes=H200, tp=8)
    assert fp8.kv_bytes_per_token_per_gpu == 35_136


def test_qwen3_235b_kv_bytes_per_token() -> None:
    est = estimate_memory(resolve_model("qwen3-235b-a22b"), gpu_memory_bytes=H200, tp=4)
    assert est.kv_bytes_per_token_model == 192_512
    assert est.kv_bytes_per_token_per_gpu == 192_512 // 4


def test_llama_3_70b_weights_at_tp8_match_vllm_log() -> None:
    # vllm-ascend #2235: "Loading model weights took 16.4610 GB" (GiB) per rank at tp=8
    est = estimate_memory(resolve_model("llama-3-70b"), gpu_memory_bytes=H100, tp=8)
    assert abs(est.weights_bytes_per_gpu / GIB - 16.461) / 16.461 < 0.03


def test_llama_3_8b_weights_at_tp1_and_tp2_match_vllm_log() -> None:
    # vLLM PR #10511: "model weights take 14.96GiB" (tp=1), "7.48GiB" (tp=2)
    spec = resolve_model("llama-3-8b")
    assert estimate_memory(spec, gpu_memory_bytes=H100, tp=1).weights_bytes_per_gpu / GIB == pytest.approx(
        14.96, rel=0.01
    )
    assert estimate_memory(spec, gpu_memory_bytes=H100, tp=2).weights_bytes_per_gpu / GIB == pytest.approx(
        7.48, rel=0.01
    )


def test_capacity_follows_vllm_block_rule() -> None:
    cfg = MemoryConfig(gpu_memory_utilization=0.9, cudagraph_bytes=0)
    est = estimate_memory(resolve_model("llama-3.1-70b"), gpu_memory_bytes=H100, tp=4, config=cfg)
    block = 16 * 81_920
    assert est.budget_bytes == -(-H100 * 9 // 10)
    assert est.kv_tokens_capacity == est.kv_budget_bytes // block * 16
    assert est.kv_tokens_capacity % 16 == 0
    assert est.max_concurrent_seqs == est.kv_tokens_capacity // 131_072


def test_weight_dtypes_scale_the_quantised_body_only() -> None:
    spec = resolve_model("llama-3.1-70b")
    bf16 = estimate_memory(spec, gpu_memory_bytes=H100, tp=2).stages[0].weights
    fp8 = estimate_memory(spec.with_dtypes("fp8"), gpu_memory_bytes=H100, tp=2).stages[0].weights
    int4 = estimate_memory(spec.with_dtypes("int4"), gpu_memory_bytes=H100, tp=2).stages[0].weights
    assert fp8.mlp == pytest.approx(bf16.mlp / 2, rel=1e-6)
    assert int4.mlp == pytest.approx(bf16.mlp * (0.5 + 2.5 / 128) / 2, rel=1e-6)
    assert fp8.embedding == bf16.embedding and fp8.lm_head == bf16.lm_head  # stay bf16


def test_expert_parallel_spreads_whole_experts() -> None:
    spec = resolve_model("mixtral-8x7b")
    ep1 = estimate_memory(spec, gpu_memory_bytes=H100, tp=8, ep=1).stages[0].weights
    ep8 = estimate_memory(spec, gpu_memory_bytes=H100, tp=8, ep=8).stages[0].weights
    assert ep8.experts == pytest.approx(ep1.experts, rel=1e-6)  # 8 experts / 8 ranks = 1/8 each way
    qwen = resolve_model("qwen3-235b-a22b")
    q = estimate_memory(qwen, gpu_memory_bytes=H200, tp=4, ep=4).stages[0].weights
    assert q.experts == pytest.approx(94 * 32 * 3 * 4096 * 1536 * 2, rel=1e-9)
    assert q.replicated >= 94 * 128 * 4096 * 2  # routers on every rank


def test_pipeline_stages_follow_vllm_split() -> None:
    assert [len(r) for r in stage_layers(61, 4)] == [15, 15, 16, 15]
    assert [len(r) for r in stage_layers(80, 3)] == [27, 27, 26]
    est = estimate_memory(resolve_model("llama-3.1-405b"), gpu_memory_bytes=H100, tp=8, pp=2)
    first, last = est.stages
    assert first.weights.embedding > 0 and first.weights.lm_head == 0
    assert last.weights.lm_head > 0 and last.weights.embedding == 0
    assert est.kv_bytes_per_token_per_gpu == 63 * 1 * 256 * 2


def test_invalid_degrees_name_the_problem() -> None:
    spec = resolve_model("llama-3.1-70b")
    with pytest.raises(InfeasibleError, match="tp=3 does not divide the 64 attention heads"):
        check_degrees(spec, 3)
    with pytest.raises(InfeasibleError, match="pp=81"):
        check_degrees(spec, 1, 81)
    with pytest.raises(InfeasibleError, match="dense"):
        check_degrees(spec, 8, 1, ep=8)
    with pytest.raises(InfeasibleError, match="KV heads"):
        check_degrees(make_spec(num_attention_heads=12, num_key_value_heads=3), 2)
    assert valid_tps(spec, limit=128) == [1, 2, 4, 8, 16, 32, 64]


def test_does_not_fit_reports_why() -> None:
    est = estimate_memory(resolve_model("llama-3.1-70b"), gpu_memory_bytes=H100, tp=1)
    assert not est.fits and est.kv_tokens_capacity == 0
    assert "over the" in est.reasons[0]
    short = estimate_memory(resolve_model("llama-3.1-70b"), gpu_memory_bytes=H100, tp=2)
    assert not short.fits and "fewer than 1 x 131072" in short.reasons[0]


def test_fallbacks_in_order_with_savings() -> None:
    spec = resolve_model("llama-3.1-70b")
    cfg = MemoryConfig(allow_int4_kv=True)
    fbs = capacity_fallbacks(spec, gpu_memory_bytes=H100, tp=2, max_model_len=49_152, config=cfg)
    assert [f.name for f in fbs] == ["fp8-kv", "int4-kv", "activation-checkpointing"]
    # fp8 halves 163,840 B/token for the 65,536 tokens of one max-length sequence
    assert fbs[0].saves_bytes == (163_840 - 81_920) * 49_152
    assert fbs[1].saves_bytes == (81_920 - 40_960) * 49_152
    assert fbs[0].kv_tokens_capacity < fbs[1].kv_tokens_capacity < fbs[2].kv_tokens_capacity
    assert fbs[2].saves_bytes > 0
    base = estimate_memory(spec, gpu_memory_bytes=H100, tp=2, max_model_len=49_152, config=cfg)
    assert not fbs[0].fits and fbs[1].fits
    assert first_fit(base, fbs) is fbs[1]
    no_int4 = capacity_fallbacks(spec, gpu_memory_bytes=H100, tp=2)
    assert [f.name for f in no_int4] == ["fp8-kv", "activation-checkpointing"]
    int8 = capacity_fallbacks(spec.with_dtypes(kv_dtype="fp8"), gpu_memory_bytes=H100, tp=2)
    assert [f.name for f in int8] == ["activation-checkpointing"]  # int8 saves nothing over fp8


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"max_model_len": 0}, "max_model_len=0"),
        ({"max_model_len": -4096}, "max_model_len=-4096"),
        ({"num_seqs": 0}, "num_seqs=0"),
        ({"gpu_memory_bytes": 0}, "gpu_memory_bytes=0"),
    ],
)
def test_lengths_below_one_are_refused_not_defaulted(kwargs: dict[str, int], phrase: str) -> None:
    # the baseline read max_model_len=0 as "the model's context" and a negative one as fitting
    with pytest.raises(InfeasibleError, match=phrase):
        estimate_memory(
            resolve_model("llama-3.1-70b"),
            gpu_memory_bytes=kwargs.get("gpu_memory_bytes", H100),
            tp=4,
            max_model_len=kwargs.get("max_model_len"),
            num_seqs=kwargs.get("num_seqs", 1),
        )
