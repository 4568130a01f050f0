"""config.json loading and parameter counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from tests.workload.builders import make_config, make_spec
from toposched.errors import InputError, SpecError, UnknownNameError
from toposched.workload.dtypes import parse_kv_dtype, parse_weight_dtype, weight_format
from toposched.workload.hf_config import load_config

CONFIGS = FIXTURES / "model_configs"


def test_dense_counts_match_hand_arithmetic() -> None:
    spec = make_spec()
    h, v, i, layers = 1024, 32000, 4096, 4
    attn = h * h * 2 + 2 * h * 4 * 64  # q + o, k + v with 4 KV heads of 64
    per_layer = attn + 3 * h * i + 2 * h
    assert spec.params_total == 2 * v * h + layers * per_layer + h
    assert spec.params_active == spec.params_total


def test_tied_embeddings_counted_once() -> None:
    assert make_spec().params_total - make_spec(tie_word_embeddings=True).params_total == 32000 * 1024


def test_head_dim_key_wins_over_hidden_over_heads() -> None:
    spec = make_spec(head_dim=128)
    assert spec.head_dim == 128
    assert spec.kv_bytes_per_token(2) == 4 * 4 * 2 * 128 * 2


def test_unknown_keys_are_ignored_and_missing_keys_named(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(make_config(some_future_key={"a": 1}, rope_scaling=None)))
    assert load_config(tmp_path).num_layers == 4  # a model directory works too
    cfg = make_config()
    del cfg["num_attention_heads"]
    path.write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match="num_attention_heads: missing required key") as info:
        load_config(path)
    assert info.value.path == "num_attention_heads"


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_config(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(SpecError, match="JSON object"):
        load_config(arr)


def test_qwen2_counts_qkv_bias_exactly() -> None:
    # perf-anchors.md §5.2: 72,706,203,648 equals the weight-file sum of Qwen2.5-72B-Instruct
    assert load_config(CONFIGS / "Qwen2.5-72B-Instruct.json").params_total == 72_706_203_648


def test_mixtral_total_and_active() -> None:
    spec = load_config(CONFIGS / "Mixtral-8x7B-v0.1.json")
    assert spec.moe is not None and spec.moe.num_experts == 8 and spec.moe.experts_per_token == 2
    assert spec.params_total == 46_702_792_704
    assert spec.params_active == 12_879_925_248


def test_qwen3_moe_all_layers_sparse_with_qk_norm() -> None:
    spec = load_config(CONFIGS / "Qwen3-235B-A22B.json")
    assert spec.qk_norm and spec.moe is not None and not spec.moe.dense_layers
    assert spec.params_total == 235_093_634_560
    assert spec.params_active == 22_190_763_520


def test_deepseek_v3_mla_shared_experts_and_dense_prefix() -> None:
    spec = load_config(CONFIGS / "DeepSeek-V3.json")
    assert spec.mla is not None and spec.mla.kv_lora_rank == 512
    assert spec.moe is not None and spec.moe.dense_layers == frozenset({0, 1, 2})
    assert spec.moe.num_shared_experts == 1 and spec.moe.router_bias
    assert spec.weight_dtype == "fp8"  # quantization_config: fp8 checkpoint
    assert spec.params_total == 671_026_419_200  # MTP layer excluded
    assert spec.params_active == 37_552_297_472


def test_dtype_parsing_and_int4_group_overhead() -> None:
    assert parse_weight_dtype("BF16") == "bf16" and parse_weight_dtype("bfloat16") == "bf16"
    assert parse_kv_dtype("fp8_e5m2") == "fp8" and parse_kv_dtype("AUTO") == "auto"
    with pytest.raises(UnknownNameError, match="did you mean 'int4'"):
        parse_weight_dtype("int44")
    # AWQ/GPTQ: 0.5 B per weight plus an fp16 scale and a 4-bit zero per group of 128
    assert weight_format("int4").bytes_per_param == pytest.approx(0.5 + 2.5 / 128)
    assert weight_format("fp8").bytes_per_param == 1.0
