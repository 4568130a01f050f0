"""Reading a Hugging Face ``config.json`` into a ``ModelSpec`` (``workload/spec.py``).

Three families are understood, recognised by the keys present (``model_type`` only refines them):

* dense decoder-only GQA/MHA models (Llama, Qwen2, Mistral, Qwen3);
* MoE models with routed experts (Mixtral: ``num_local_experts``; Qwen3-MoE: ``num_experts``);
* DeepSeek-V2/V3: MLA attention (``kv_lora_rank``: one latent cached per token and layer), routed
  plus shared experts, the first ``first_k_dense_replace`` layers dense.

Unknown keys are ignored. Every key that is used is checked (a positive integer within a sane
bound, KV heads that divide the attention heads, true/false flags); a missing or bad one raises
``SpecError`` naming the key and the file, never a silent default. The weight dtype and the
projections a quantised checkpoint keeps at 16 bits come from ``quantization_config``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from toposched.errors import InputError, SpecError
from toposched.inputs import load_json, read_text
from toposched.workload.dtypes import WeightDtype
from toposched.workload.spec import ActivationDtype, MlaSpec, ModelSpec, MoeSpec

# Upper bounds on the architecture numbers config.json parsing uses. Real models stay far below
# (Llama-3.1-405B: hidden 16,384, 126 layers, 128 heads; DeepSeek-V3: 256 experts, 163,840
# positions; Gemma: vocabulary 262,144); the bounds keep a damaged or hostile file from turning
# into a silent absurd answer or a loop over 10^12 layers.
_MAX_WIDTH = 1 << 20  # hidden and intermediate sizes, head and latent dims
_MAX: dict[str, int] = {
    "hidden_size": _MAX_WIDTH,
    "num_hidden_layers": 4096,
    "num_attention_heads": 16384,
    "num_key_value_heads": 16384,
    "head_dim": 65536,
    "intermediate_size": _MAX_WIDTH,
    "moe_intermediate_size": _MAX_WIDTH,
    "shared_expert_intermediate_size": _MAX_WIDTH,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 30,
    "n_routed_experts": 65536,
    "num_local_experts": 65536,
    "num_experts": 65536,
    "num_experts_per_tok": 65536,
    "n_shared_experts": 1024,
    "first_k_dense_replace": 4096,
    "moe_layer_freq": 4096,
    "decoder_sparse_step": 4096,
    "q_lora_rank": 65536,
    "kv_lora_rank": 65536,
    "qk_nope_head_dim": 65536,
    "qk_rope_head_dim": 65536,
    "v_head_dim": 65536,
}
_DEFAULT_MAX_POSITIONS = 4096


def _shown(value: object) -> str:
    """A config value as an error message shows it: repr, at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(cfg: Mapping[str, Any], key: str, source: str, *, default: int | None = None, minimum: int = 1) -> int:
    """``cfg[key]`` as an integer in ``[minimum, _MAX[key]]``; ``default`` when absent or null."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise SpecError(source, key, "missing required key", fix="use the model's Hugging Face config.json")
        return default
    top = _MAX[key]
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= top:
        kind = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise SpecError(
            source,
            key,
            f"expected {kind} (at most {top:,}), got {_shown(value)}",
            fix="use the model's Hugging Face config.json",
        )
    return value


def _present(cfg: Mapping[str, Any], key: str, source: str) -> int | None:
    """An optional feature size (experts, MLA ranks): None when absent, null or 0, else a positive int."""
    value = cfg.get(key)
    if value is None or (value == 0 and isinstance(value, int) and not isinstance(value, bool)):
        return None
    return _int(cfg, key, source)


def _flag(cfg: Mapping[str, Any], key: str, source: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SpecError(source, key, f"expected true or false, got {_shown(value)}")
    return value


def _text(cfg: Mapping[str, Any], key: str, source: str) -> str | None:
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 200:
        raise SpecError(source, key, f"expected a short string, got {_shown(value)}")
    return value


LINEAR_NAMES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder-layer projections a quantisation ignore list can name (Hugging Face Llama/Qwen names)."""
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_IGNORE_KEYS = ("ignore", "modules_to_not_convert", "ignored_layers")
_MAX_IGNORE = 1 << 16


def _ct_weight_bits(quant: Mapping[str, Any], source: str) -> tuple[int, str] | None:
    """compressed-tensors: (num_bits, type) of the first config group's weights, if given."""
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping):
        return None
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            continue
        bits, kind = weights.get("num_bits"), weights.get("type", "int")
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 16 or not isinstance(kind, str):
            raise SpecError(
                source, "quantization_config.config_groups.weights", f"expected num_bits 1-16, got {_shown(bits)}"
            )
        return bits, kind.lower()
    return None


def _dtype_of(cfg: Mapping[str, Any], source: str) -> tuple[ActivationDtype, WeightDtype]:
    torch_dtype = _text(cfg, "torch_dtype", source) or _text(cfg, "dtype", source) or "bfloat16"
    act: ActivationDtype = "fp16" if torch_dtype in ("float16", "half", "fp16") else "bf16"
    quant = cfg.get("quantization_config")
    if quant is None:
        return act, act
    if not isinstance(quant, Mapping):
        raise SpecError(source, "quantization_config", f"expected an object, got {_shown(quant)}")
    method = quant.get("quant_method") or ""
    if not isinstance(method, str) or len(method) > 200:
        raise SpecError(source, "quantization_config.quant_method", f"expected a short string, got {_shown(method)}")
    method = method.lower()
    if method in ("fp8", "fbgemm_fp8", "modelopt"):
        return act, "fp8"
    if method == "compressed-tensors" and quant.get("bits") is None:
        found = _ct_weight_bits(quant, source)
        if found is not None:
            ct_bits, ct_kind = found
            if ct_bits > 8:
                return act, act  # counted at 16 bits: never an underestimate
            if ct_bits == 8 and ct_kind == "float":
                return act, "fp8"
            return act, "int4" if ct_bits <= 4 else "int8"  # rounded up to a stored width
    if method in ("awq", "gptq", "compressed-tensors"):
        key = "bits" if quant.get("bits") is not None else "w_bit"
        bits = quant.get(key)
        if bits is None:
            return act, "int4"
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
            raise SpecError(
                source, f"quantization_config.{key}", f"expected weight bits from 1 to 8, got {_shown(bits)}"
            )
        # Below 4 bits is counted as int4: an upper bound on the weight bytes, never an underestimate.
        return act, "int4" if bits <= 4 else "int8"
    return act, act


def _module_names(layer: int, projection: str) -> tuple[str, ...]:
    """The Hugging Face names of one decoder-layer projection (and its fused vLLM name)."""
    block = "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    fused = [f for f, parts in _FUSED.items() if projection in parts]
    names = [f"model.layers.{layer}.{block}.{projection}"]
    names += [f"model.layers.{layer}.{block}.{f}" for f in fused]
    return tuple(names)


def _pattern_matches(entry: str, name: str) -> bool:
    """A compressed-tensors ``re:`` entry, matched with ``re.match`` as compressed-tensors does."""
    try:
        return re.match(entry[3:], name) is not None
    except re.error:
        return False


def _unquantized_of(cfg: Mapping[str, Any], num_layers: int, source: str) -> frozenset[tuple[int, str]]:
    """(layer, projection) pairs the checkpoint's ignore list keeps at 16 bits.

    Meta's Llama-3.1-405B-FP8 (``fbgemm_fp8``) lists ``modules_to_not_convert``; compressed-tensors
    lists ``ignore`` (names or ``re:`` patterns); vLLM's fp8 config reads ``ignored_layers``.
    Embeddings, lm_head and norms are 16-bit in every case (workload/dtypes.py) and need no entry.
    """
    quant = cfg.get("quantization_config")
    if not isinstance(quant, Mapping):
        return frozenset()
    entries: list[str] = []
    for key in _IGNORE_KEYS:
        value = quant.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) > _MAX_IGNORE or not all(isinstance(v, str) for v in value):
            raise SpecError(
                source, f"quantization_config.{key}", f"expected a list of module names, got {_shown(value)}"
            )
        entries += [v for v in value if v and len(v) <= 500]
    if not entries:
        return frozenset()
    plain = {e for e in entries if not e.startswith("re:")}
    patterns = [e for e in entries if e.startswith("re:")]
    out: set[tuple[int, str]] = set()
    for layer in range(num_layers):
        for projection in LINEAR_NAMES:
            names = _module_names(layer, projection)
            if any(n in plain for n in names) or any(_pattern_matches(p, n) for p in patterns for n in names):
                out.add((layer, projection))
    return frozenset(out)


def _moe_of(cfg: Mapping[str, Any], num_layers: int, source: str) -> MoeSpec | None:
    moe: MoeSpec | None = None
    routed = _present(cfg, "n_routed_experts", source)
    local = _present(cfg, "num_local_experts", source)
    qwen = _present(cfg, "num_experts", source)
    if routed:  # DeepSeek-V2/V3
        first_dense = _int(cfg, "first_k_dense_replace", source, default=0, minimum=0)
        freq = _int(cfg, "moe_layer_freq", source, default=1)
        dense = frozenset(i for i in range(num_layers) if i < first_dense or i % freq != 0)
        inter = _int(cfg, "moe_intermediate_size", source)
        shared = _int(cfg, "n_shared_experts", source, default=0, minimum=0)
        moe = MoeSpec(
            num_experts=routed,
            experts_per_token=_int(cfg, "num_experts_per_tok", source),
            expert_intermediate_size=inter,
            num_shared_experts=shared,
            shared_intermediate_size=shared * inter,
            dense_layers=dense,
            router_bias=cfg.get("topk_method") == "noaux_tc",
        )
    elif local:  # Mixtral: intermediate_size is the expert width
        moe = MoeSpec(
            num_experts=local,
            experts_per_token=_int(cfg, "num_experts_per_tok", source),
            expert_intermediate_size=_int(cfg, "intermediate_size", source),
        )
    elif qwen:  # Qwen2-MoE / Qwen3-MoE
        step = _int(cfg, "decoder_sparse_step", source, default=1)
        mlp_only = _layer_list(cfg, "mlp_only_layers", num_layers, source)
        dense = frozenset(i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0)
        shared_inter = _int(cfg, "shared_expert_intermediate_size", source, default=0, minimum=0)
        moe = MoeSpec(
            num_experts=qwen,
            experts_per_token=_int(cfg, "num_experts_per_tok", source),
            expert_intermediate_size=_int(cfg, "moe_intermediate_size", source),
            num_shared_experts=1 if shared_inter else 0,
            shared_intermediate_size=shared_inter,
            dense_layers=dense,
        )
    if moe is not None and moe.experts_per_token > moe.num_experts:
        raise SpecError(
            source,
            "num_experts_per_tok",
            f"{moe.experts_per_token} experts per token but the model has only {moe.num_experts} experts",
        )
    return moe


def _layer_list(cfg: Mapping[str, Any], key: str, num_layers: int, source: str) -> frozenset[int]:
    value = cfg.get(key)
    if value is None:
        return frozenset()
    if not isinstance(value, list) or len(value) > num_layers:
        raise SpecError(source, key, f"expected a list of at most {num_layers} layer numbers, got {_shown(value)}")
    bad = [i for i in value if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
    if bad:
        raise SpecError(source, key, f"layer numbers go from 0 to {num_layers - 1}; got {_shown(bad[0])}")
    return frozenset(value)


def _attention_shape(cfg: Mapping[str, Any], hidden: int, source: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim), checked against each other."""
    heads = _int(cfg, "num_attention_heads", source)
    kv_heads = _int(cfg, "num_key_value_heads", source, default=heads)
    if kv_heads > heads or heads % kv_heads:
        raise SpecError(
            source,
            "num_key_value_heads",
            f"{kv_heads} KV heads must divide the {heads} attention heads (grouped-query attention)",
            fix="use the model's Hugging Face config.json",
        )
    if cfg.get("head_dim") is None and hidden < heads:
        raise SpecError(
            source,
            "num_attention_heads",
            f"{heads} attention heads leave no head dimension in hidden_size {hidden} (head_dim is not given)",
        )
    head_dim = _int(cfg, "head_dim", source, default=hidden // heads)
    return heads, kv_heads, head_dim


def _block_scaled(cfg: Mapping[str, Any]) -> bool:
    """Whether ``quantization_config`` scales FP8 weights per block (a two-number ``weight_block_size``)."""
    quant = cfg.get("quantization_config")
    block = quant.get("weight_block_size") if isinstance(quant, Mapping) else None
    return isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)


def spec_from_config(cfg: Mapping[str, Any], *, name: str, source: str = "<config>") -> ModelSpec:
    """Build a ModelSpec from a parsed ``config.json`` (no I/O). Unknown keys are ignored.

    Every key used is checked: integers within sane bounds, KV heads dividing the attention heads,
    experts per token at most the experts; ``SpecError`` names the key and ``source`` otherwise.
    """
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = cfg["text_config"]  # multimodal wrappers keep the language model here
        source = f"{source}: text_config"
        if not isinstance(cfg, Mapping):
            raise SpecError(source, "", f"expected an object, got {_shown(cfg)}")
    hidden = _int(cfg, "hidden_size", source)
    layers = _int(cfg, "num_hidden_layers", source)
    heads, kv_heads, head_dim = _attention_shape(cfg, hidden, source)
    model_type = _text(cfg, "model_type", source) or ""
    mla = None
    kv_lora_rank = _present(cfg, "kv_lora_rank", source)
    if kv_lora_rank:
        mla = MlaSpec(
            q_lora_rank=_present(cfg, "q_lora_rank", source),
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", source),
            qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", source),
            v_head_dim=_int(cfg, "v_head_dim", source),
        )
    act, weight = _dtype_of(cfg, source)
    model_id = cfg.get("_model_id")
    return ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_int(cfg, "intermediate_size", source),
        vocab_size=_int(cfg, "vocab_size", source),
        max_position_embeddings=_int(cfg, "max_position_embeddings", source, default=_DEFAULT_MAX_POSITIONS),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", source, False),
        qkv_bias=_flag(cfg, "attention_bias", source, model_type in ("qwen2", "qwen2_moe")),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe=_moe_of(cfg, layers, source),
        mla=mla,
        activation_dtype=act,
        weight_dtype=weight,
        hf_id=model_id if isinstance(model_id, str) and len(model_id) <= 200 else None,
        model_type=model_type,
        unquantized=_unquantized_of(cfg, layers, source) if weight not in ("bf16", "fp16") else frozenset(),
        fp8_block=weight == "fp8" and _block_scaled(cfg),
    )


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):  # a name too long for the OS, or with a NUL byte
        return False


def load_config(path: str | Path, *, name: str | None = None) -> ModelSpec:
    """Read a ``config.json`` (or a model directory holding one) into a ModelSpec.

    The file is read through ``toposched.inputs`` (a bounded regular file, strict UTF-8 JSON
    without duplicate keys, NaN or huge numbers); every error is an ``InputError`` naming it.
    """
    p = Path(path)
    if "\x00" in str(p):
        raise InputError(f"{str(path)[:200]!r}: a path cannot contain a NUL byte", fix="check the path")
    if _is_dir(p):
        p = p / "config.json"
    try:
        exists = p.exists()
    except OSError as exc:
        raise InputError(f"{str(p)[:200]}: cannot be opened: {exc.strerror}", fix="check the path") from None
    if not exists:
        raise InputError(f"{path}: no such file (expected a config.json or a directory holding one)")
    cfg = load_json(read_text(p, what="model config"), source=str(p))
    if not isinstance(cfg, dict):
        raise SpecError(str(p), "", "expected a JSON object at the top level")
    label = name or (p.parent.name if p.name == "config.json" else p.stem)
    return spec_from_config(cfg, name=label, source=str(p))
