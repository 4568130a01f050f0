"""Builders for small test models (no catalog, no files)."""

from __future__ import annotations

from typing import Any

from toposched.workload.hf_config import spec_from_config
from toposched.workload.spec import ModelSpec


def make_config(**overrides: Any) -> dict[str, Any]:
    """A small Llama-style config.json as a dict; keyword arguments replace or add keys."""
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 4096,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


def make_spec(name: str = "tiny", **overrides: Any) -> ModelSpec:
    """A ModelSpec from ``make_config(**overrides)``."""
    return spec_from_config(make_config(**overrides), name=name)
