"""Hostile and damaged config.json files: a clear error naming the key and the file, never a wrong answer.

Issue 13 items 13-15: ``num_key_value_heads`` 0 or negative used to double the KV capacity, KV heads
above the attention heads and ``max_position_embeddings <= 0`` were accepted, and strings, NaN,
infinities or 5,000-digit numbers gave tracebacks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES
from tests.workload.builders import make_config
from toposched.errors import InputError, SpecError
from toposched.workload.catalog import resolve_model
from toposched.workload.hf_config import load_config
from toposched.workload.memory import estimate_memory

CONFIGS = FIXTURES / "model_configs"
H100 = 80 * 1024**3


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    ("overrides", "key", "phrase"),
    [
        ({"num_key_value_heads": 0}, "num_key_value_heads", "positive integer"),
        ({"num_key_value_heads": -8}, "num_key_value_heads", "positive integer"),
        ({"num_key_value_heads": 32}, "num_key_value_heads", "must divide the 16 attention heads"),
        ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide the 16 attention heads"),
        ({"num_key_value_heads": 2.5}, "num_key_value_heads", "positive integer"),
        ({"num_key_value_heads": "4"}, "num_key_value_heads", "positive integer"),
        ({"max_position_embeddings": 0}, "max_position_embeddings", "positive integer"),
        ({"max_position_embeddings": -4096}, "max_position_embeddings", "positive integer"),
        ({"head_dim": 0}, "head_dim", "positive integer"),
        ({"hidden_size": True}, "hidden_size", "positive integer"),
        ({"hidden_size": "x"}, "hidden_size", "positive integer"),
        ({"num_hidden_layers": 10**12}, "num_hidden_layers", "at most 4,096"),
        ({"vocab_size": 10**30}, "vocab_size", "at most"),
        ({"num_attention_heads": 4096, "num_key_value_heads": 4096}, "num_attention_heads", "no head dimension"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "true or false"),
        ({"model_type": ["llama"]}, "model_type", "short string"),
        ({"num_local_experts": 8, "num_experts_per_tok": 9}, "num_experts_per_tok", "only 8 experts"),
        ({"num_local_experts": -1, "num_experts_per_tok": 2}, "num_local_experts", "positive integer"),
        (
            {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "mlp_only_layers": "x"},
            "mlp_only_layers",
            "list",
        ),
        (
            {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "mlp_only_layers": [9]},
            "mlp_only_layers",
            "from 0 to 3",
        ),
        (
            {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "decoder_sparse_step": 0},
            "decoder_sparse_step",
            "positive integer",
        ),
        ({"quantization_config": {"quant_method": "gptq", "bits": "x"}}, "quantization_config.bits", "weight bits"),
        ({"quantization_config": "fp8"}, "quantization_config", "an object"),
        ({"kv_lora_rank": -512}, "kv_lora_rank", "positive integer"),
    ],
)
def test_bad_values_name_the_key_and_the_file(tmp_path: Path, overrides: dict[str, Any], key: str, phrase: str) -> None:
    path = _write(tmp_path, make_config(**overrides))
    with pytest.raises(SpecError) as info:
        load_config(path)
    assert info.value.path == key
    message = str(info.value)
    assert message.startswith(str(path)) and phrase in message, message


def test_text_config_must_be_an_object(tmp_path: Path) -> None:
    path = _write(tmp_path, {"text_config": [1, 2]})
    with pytest.raises(SpecError, match="text_config: expected an object"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ('{"hidden_size": NaN}', "NaN is not a number JSON allows"),
        ('{"hidden_size": Infinity}', "Infinity is not a number JSON allows"),
        ('{"hidden_size": 1e309}', "overflows to infinity"),
        ('{"hidden_size": ' + "9" * 5000 + "}", "digits"),
        ('{"hidden_size": 1, "hidden_size": 2}', "duplicate key 'hidden_size'"),
        ("[" * 100_000 + "]" * 100_000, "nested"),
    ],
)
def test_unreadable_numbers_and_shapes_are_one_input_error(tmp_path: Path, text: str, phrase: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(InputError, match=phrase) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_non_utf8_and_special_files(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "\xff\xfe"}')
    with pytest.raises(InputError, match="not UTF-8"):
        load_config(path)
    with pytest.raises(InputError, match="not a regular file"):
        load_config("/dev/zero")
    with pytest.raises(InputError, match="NUL byte"):
        load_config("a\x00b.json")


def test_kv_heads_zero_no_longer_doubles_the_kv_capacity(tmp_path: Path) -> None:
    # the baseline read 0 KV heads as max(1, 0 // tp) = 1 head per rank: double the capacity at tp=4
    cfg = json.loads((CONFIGS / "Meta-Llama-3.1-70B.json").read_text())
    good = estimate_memory(load_config(_write(tmp_path, cfg)), gpu_memory_bytes=H100, tp=4)
    cfg["num_key_value_heads"] = 0
    with pytest.raises(SpecError, match="num_key_value_heads"):
        load_config(_write(tmp_path, cfg))
    assert good.kv_bytes_per_token_per_gpu == 80 * 2 * 2 * 128 * 2  # 80 layers, 2 KV heads per rank


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.stem)
def test_every_real_config_still_loads(path: Path) -> None:
    spec = load_config(path)
    assert spec.num_kv_heads >= 1 and spec.num_heads % spec.num_kv_heads == 0
    assert spec.params_total > 1e9


@pytest.mark.parametrize("ref", ["", "x" * 5000, "a\x00b", "~no-such-user-xyz/config.json", "/" + "a/" * 3000])
def test_odd_model_references_are_input_errors(ref: str) -> None:
    with pytest.raises(InputError):
        resolve_model(ref)
