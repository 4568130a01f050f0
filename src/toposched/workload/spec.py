"""Model specs: the architecture numbers of a Hugging Face ``config.json``, and parameter counts.

Three families are understood, recognised by the keys present (``model_type`` only refines them):

* dense decoder-only GQA/MHA models (Llama, Qwen2, Mistral, Qwen3);
* MoE models with routed experts (Mixtral: ``num_local_experts``; Qwen3-MoE: ``num_experts``);
* DeepSeek-V2/V3: MLA attention (``kv_lora_rank``: one latent cached per token and layer), routed
  plus shared experts, the first ``first_k_dense_replace`` layers dense.

Unknown keys are ignored; a missing required key raises ``SpecError`` naming the key. Parameter
counts follow the Hugging Face module layout (embeddings counted twice unless tied; DeepSeek-V3's
multi-token-prediction layer is not counted, as vLLM does not load it for plain decoding).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from toposched.errors import InputError, SpecError
from toposched.workload.dtypes import KvDtype, WeightDtype

ActivationDtype = Literal["bf16", "fp16"]


@dataclass(frozen=True)
class MoeSpec:
    """Mixture-of-experts numbers; all experts are SwiGLU MLPs (gate, up, down)."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    dense_layers: frozenset[int] = frozenset()
    router_bias: bool = False

    @property
    def expert_params(self) -> int:
        """Parameters of one hidden-size-independent expert factor (multiply by hidden size)."""
        return 3 * self.expert_intermediate_size


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class AttentionParams:
    """Attention weights of one layer at tp=1, by how tensor parallelism treats them."""

    q_and_o: int  # query and output projections: split over tp
    kv: int  # K/V projections: split over tp while tp <= KV heads, replicated beyond
    replicated: int  # MLA down-projections (ReplicatedLinear in vLLM): on every tp rank
    bias: int  # projection biases (Qwen2): split like their projections


@dataclass(frozen=True)
class ModelSpec:
    """One model's architecture plus the weight and KV-cache dtypes it is served with."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: MoeSpec | None = None
    mla: MlaSpec | None = None
    activation_dtype: ActivationDtype = "bf16"
    weight_dtype: WeightDtype = "bf16"
    kv_dtype: KvDtype = "auto"
    hf_id: str | None = None
    model_type: str = ""
    published_params: int | None = None

    def with_dtypes(self, weight_dtype: WeightDtype | None = None, kv_dtype: KvDtype | None = None) -> ModelSpec:
        """A copy served with other dtypes (``None`` keeps the current one)."""
        return replace(
            self,
            weight_dtype=weight_dtype or self.weight_dtype,
            kv_dtype=kv_dtype or self.kv_dtype,
        )

    # ---- structure -------------------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has routed experts."""
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def kv_heads_cached(self) -> int:
        """KV "heads" in vLLM's cache spec: the KV heads, or 1 latent for MLA."""
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def kv_state_dims(self) -> int:
        """Cached elements per token, layer and KV head: k + v head dims, or the MLA latent."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.head_dim

    @property
    def attention_width(self) -> int:
        """Query heads x head dim: the width attention FLOPs scale with."""
        if self.mla is not None:
            return self.num_heads * (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim)
        return self.num_heads * self.head_dim

    def attention_params(self) -> AttentionParams:
        """Attention projection weights of one layer (unsharded)."""
        h = self.hidden_size
        if self.mla is not None:
            m = self.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            if m.q_lora_rank:
                q_up, q_down = m.q_lora_rank * self.num_heads * qk, h * m.q_lora_rank
            else:
                q_up, q_down = h * self.num_heads * qk, 0
            kv_down = h * (m.kv_lora_rank + m.qk_rope_head_dim)
            kv_up = m.kv_lora_rank * self.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
            o = self.num_heads * m.v_head_dim * h
            return AttentionParams(q_and_o=q_up + kv_up + o, kv=0, replicated=q_down + kv_down, bias=0)
        q = h * self.num_heads * self.head_dim
        kv = 2 * h * self.num_kv_heads * self.head_dim
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
        return AttentionParams(q_and_o=2 * q, kv=kv, replicated=0, bias=bias)

    def norm_params(self, layer: int) -> int:
        """RMSNorm weights of one layer (two per layer, plus q/k or MLA latent norms)."""
        n = 2 * self.hidden_size
        if self.qk_norm:
            n += 2 * self.head_dim
        if self.mla is not None:
            n += self.mla.kv_lora_rank + (self.mla.q_lora_rank or 0)
        return n

    def dense_mlp_params(self) -> int:
        """A dense SwiGLU MLP: gate, up and down projections."""
        return 3 * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        """One routed expert (0 for a dense model)."""
        return 0 if self.moe is None else self.hidden_size * self.moe.expert_params

    def shared_expert_params(self) -> int:
        """All shared experts of one MoE layer together."""
        return 0 if self.moe is None else 3 * self.hidden_size * self.moe.shared_intermediate_size

    def router_params(self) -> int:
        """The router (gate) of one MoE layer, with DeepSeek's score-correction bias."""
        if self.moe is None:
            return 0
        return self.moe.num_experts * (self.hidden_size + (1 if self.moe.router_bias else 0))

    def embedding_params(self) -> int:
        """Input embedding table."""
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        """Output projection (0 extra when tied to the embedding)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def layer_params(self, layer: int, *, active_only: bool = False) -> int:
        """Parameters of one decoder layer; ``active_only`` counts only the experts a token uses."""
        a = self.attention_params()
        total = a.q_and_o + a.kv + a.replicated + a.bias + self.norm_params(layer)
        if self.moe is not None and self.is_moe_layer(layer):
            experts = self.moe.experts_per_token if active_only else self.moe.num_experts
            total += experts * self.expert_params() + self.shared_expert_params() + self.router_params()
        else:
            total += self.dense_mlp_params()
        return total

    @property
    def params_total(self) -> int:
        """All parameters (embedding, layers, final norm, lm_head)."""
        return self._count(active_only=False)

    @property
    def params_active(self) -> int:
        """Parameters one token touches (equal to the total for dense models)."""
        return self._count(active_only=True)

    def _count(self, *, active_only: bool) -> int:
        layers = sum(self.layer_params(i, active_only=active_only) for i in range(self.num_layers))
        return self.embedding_params() + layers + self.hidden_size + self.lm_head_params()

    def kv_bytes_per_token(self, element_bytes: float) -> int:
        """KV-cache bytes one token costs for the whole model (all layers, all KV heads)."""
        return round(self.num_layers * self.kv_heads_cached * self.kv_state_dims * element_bytes)


# ---- loading config.json ----------------------------------------------------------------------


def _req(cfg: Mapping[str, Any], key: str, source: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise SpecError(source, key, "missing required key", fix="use the model's Hugging Face config.json")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecError(source, key, f"expected a positive integer, got {value!r}")
    return value


def _opt(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key)
    return default if value is None else int(value)


def _dtype_of(cfg: Mapping[str, Any]) -> tuple[ActivationDtype, WeightDtype]:
    torch_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    act: ActivationDtype = "fp16" if torch_dtype in ("float16", "half", "fp16") else "bf16"
    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
    weight: WeightDtype = act
    if method in ("fp8", "fbgemm_fp8", "modelopt"):
        weight = "fp8"
    elif method in ("awq", "gptq", "compressed-tensors") and isinstance(quant, dict):
        bits = quant.get("bits") or quant.get("w_bit") or 4
        weight = "int4" if int(bits) == 4 else "int8"
    return act, weight


def _moe_of(cfg: Mapping[str, Any], num_layers: int, source: str) -> MoeSpec | None:
    if cfg.get("n_routed_experts"):  # DeepSeek-V2/V3
        first_dense = _opt(cfg, "first_k_dense_replace", 0)
        freq = max(1, _opt(cfg, "moe_layer_freq", 1))
        dense = frozenset(i for i in range(num_layers) if i < first_dense or i % freq != 0)
        inter = _req(cfg, "moe_intermediate_size", source)
        shared = _opt(cfg, "n_shared_experts", 0)
        return MoeSpec(
            num_experts=_req(cfg, "n_routed_experts", source),
            experts_per_token=_req(cfg, "num_experts_per_tok", source),
            expert_intermediate_size=inter,
            num_shared_experts=shared,
            shared_intermediate_size=shared * inter,
            dense_layers=dense,
            router_bias=cfg.get("topk_method") == "noaux_tc",
        )
    if cfg.get("num_local_experts"):  # Mixtral: intermediate_size is the expert width
        return MoeSpec(
            num_experts=_req(cfg, "num_local_experts", source),
            experts_per_token=_req(cfg, "num_experts_per_tok", source),
            expert_intermediate_size=_req(cfg, "intermediate_size", source),
        )
    if cfg.get("num_experts"):  # Qwen2-MoE / Qwen3-MoE
        step = max(1, _opt(cfg, "decoder_sparse_step", 1))
        mlp_only = {int(i) for i in cfg.get("mlp_only_layers") or []}
        dense = frozenset(i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0)
        shared_inter = _opt(cfg, "shared_expert_intermediate_size", 0)
        return MoeSpec(
            num_experts=_req(cfg, "num_experts", source),
            experts_per_token=_req(cfg, "num_experts_per_tok", source),
            expert_intermediate_size=_req(cfg, "moe_intermediate_size", source),
            num_shared_experts=1 if shared_inter else 0,
            shared_intermediate_size=shared_inter,
            dense_layers=dense,
        )
    return None


def spec_from_config(cfg: Mapping[str, Any], *, name: str, source: str = "<config>") -> ModelSpec:
    """Build a ModelSpec from a parsed ``config.json`` (no I/O). Unknown keys are ignored."""
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = cfg["text_config"]  # multimodal wrappers keep the language model here
    hidden = _req(cfg, "hidden_size", source)
    layers = _req(cfg, "num_hidden_layers", source)
    heads = _req(cfg, "num_attention_heads", source)
    kv_heads = _opt(cfg, "num_key_value_heads", heads)
    head_dim = _opt(cfg, "head_dim", hidden // heads)
    model_type = str(cfg.get("model_type", ""))
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MlaSpec(
            q_lora_rank=_opt(cfg, "q_lora_rank", 0) or None,
            kv_lora_rank=_req(cfg, "kv_lora_rank", source),
            qk_nope_head_dim=_req(cfg, "qk_nope_head_dim", source),
            qk_rope_head_dim=_req(cfg, "qk_rope_head_dim", source),
            v_head_dim=_req(cfg, "v_head_dim", source),
        )
    act, weight = _dtype_of(cfg)
    return ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_req(cfg, "intermediate_size", source),
        vocab_size=_req(cfg, "vocab_size", source),
        max_position_embeddings=_opt(cfg, "max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe=_moe_of(cfg, layers, source),
        mla=mla,
        activation_dtype=act,
        weight_dtype=weight,
        hf_id=cfg.get("_model_id") if isinstance(cfg.get("_model_id"), str) else None,
        model_type=model_type,
    )


def load_config(path: str | Path, *, name: str | None = None) -> ModelSpec:
    """Read a ``config.json`` (or a model directory holding one) into a ModelSpec."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise InputError(f"{path}: no such file (expected a config.json or a directory holding one)")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{p}: not a readable JSON file ({exc})") from exc
    if not isinstance(cfg, dict):
        raise SpecError(str(p), "", "expected a JSON object at the top level")
    label = name or (p.parent.name if p.name == "config.json" else p.stem)
    return spec_from_config(cfg, name=label, source=str(p))
