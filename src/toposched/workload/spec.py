"""Model specs: the architecture numbers of a Hugging Face ``config.json``, and parameter counts.

A ``ModelSpec`` is one model's architecture (dense GQA/MHA, MoE with routed and shared experts,
DeepSeek's MLA attention) and the dtypes it is served with; ``workload/hf_config.py`` reads a
``config.json`` into one. Parameter counts follow the Hugging Face module layout (embeddings counted
twice unless tied; DeepSeek-V3's multi-token-prediction layer is not counted, as vLLM does not load
it for plain decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

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
    unquantized: frozenset[tuple[int, str]] = frozenset()
    """(layer, projection) pairs a quantised checkpoint keeps at 16 bits (``quantization_config``'s
    ``ignore`` / ``modules_to_not_convert`` / ``ignored_layers``); projection is one of
    ``LINEAR_NAMES`` (``workload/hf_config.py``). Empty for 16-bit checkpoints."""
    fp8_block: bool = False
    """FP8 weights scaled per block (``quantization_config.weight_block_size``: DeepSeek-V3's 128 x 128), not
    per tensor. Serving a 16-bit checkpoint in FP8 (``--weight-dtype fp8``) quantises it per tensor."""

    def linear_at_16_bits(self, layer: int, projection: str) -> bool:
        """Whether a quantised checkpoint keeps this projection of ``layer`` in 16 bits."""
        return (layer, projection) in self.unquantized

    def with_dtypes(self, weight_dtype: WeightDtype | None = None, kv_dtype: KvDtype | None = None) -> ModelSpec:
        """A copy served with other dtypes (``None`` keeps the current one; another weight dtype is quantised
        from the checkpoint per tensor, so it drops the block scaling)."""
        weight = weight_dtype or self.weight_dtype
        return replace(
            self,
            weight_dtype=weight,
            kv_dtype=kv_dtype or self.kv_dtype,
            fp8_block=self.fp8_block and weight == self.weight_dtype,
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
