"""Per-GPU HBM estimator: weights, KV cache, activation peak and workspace for (tp, pp, ep).

The rules follow vLLM (reference/engines.md §1.4):

* budget = ceil(total GPU memory x ``gpu_memory_utilization``) (default 0.92);
* KV budget = budget - weights - activation peak - non-torch memory - CUDA-graph estimate;
* one KV block per layer = block_size x kv_heads_per_rank x (k + v head dims) x dtype bytes, with
  kv_heads_per_rank = max(1, kv_heads // tp) (replicated when tp > KV heads); MLA caches one latent
  of kv_lora_rank + qk_rope_head_dim per layer, not sharded by tp;
* tokens that fit = (KV budget // bytes per block over this GPU's layers) x block_size.

With pipeline parallelism every stage is computed and the worst one is reported (most weight bytes,
fewest KV tokens). Everything here is a pure function of its arguments (no I/O), so a placement
solver can call ``estimate_memory`` many times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from toposched.errors import InfeasibleError
from toposched.workload.dtypes import KvDtype, activation_bytes, kv_element_bytes, weight_format
from toposched.workload.parallel import check_degrees, partition_ranges
from toposched.workload.spec import ModelSpec

GIB = 1024**3

# vLLM pads the vocabulary of VocabParallelEmbedding / ParallelLMHead to a multiple of 64
# (vllm/model_executor/layers/vocab_parallel_embedding.py, DEFAULT_VOCAB_PADDING_SIZE = 64).
VOCAB_PADDING = 64


class MemoryConfig(BaseModel):
    """Engine memory settings; defaults are vLLM's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_memory_utilization: float = Field(0.92, gt=0.0, le=1.0)
    """Fraction of total GPU memory this instance may use (vLLM default 0.92, engines.md §1.1)."""
    block_size: int = Field(16, ge=1, le=1024)
    """Tokens per KV block (vLLM ``CacheConfig.DEFAULT_BLOCK_SIZE = 16``, engines.md §1.1)."""
    max_num_batched_tokens: int = Field(8192, ge=1)
    """Tokens in the profiling forward pass that sets the activation peak (vLLM's serving default)."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences sampled per step; sizes the fp32 logits buffer (vLLM ``max_num_seqs`` default)."""
    non_torch_bytes: int = Field(round(1.79 * GIB), ge=0)
    """CUDA context, cuBLAS workspace: "non_torch_memory 1.79GiB" at TP=1 (vLLM PR #10511 log)."""
    comm_buffer_bytes: int = Field(round(1.79 * GIB), ge=0)
    """Extra non-torch memory with tp*pp > 1 (NCCL, custom all-reduce): 3.58 - 1.79 GiB (PR #10511)."""
    cudagraph_bytes: int = Field(round(0.5 * GIB), ge=0)
    """CUDA-graph pool reserve. Assumption: no figure in reference/; vLLM's "Graph capturing
    finished ... took" log line is typically 0.3-1 GiB."""
    checkpoint_batched_tokens: int = Field(2048, ge=1)
    """Token cap used by the activation-checkpointing fallback (chunked prefill's 2048 chunk)."""
    allow_int4_kv: bool = False
    """Whether the int4 KV fallback may be offered (DESIGN.md: only if the request allows it)."""


@dataclass(frozen=True)
class WeightBreakdown:
    """Weight bytes on one GPU, by what they are."""

    embedding: int
    lm_head: int
    attention: int
    mlp: int  # dense MLPs and shared experts
    experts: int  # routed experts held by this GPU
    replicated: int  # norms, routers, MLA down-projections: on every tp rank

    @property
    def total(self) -> int:
        """Sum of all parts."""
        return self.embedding + self.lm_head + self.attention + self.mlp + self.experts + self.replicated


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's GPU (all tp ranks of a stage are alike)."""

    stage: int
    layers: int
    weights: WeightBreakdown
    activation_bytes: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    kv_tokens_capacity: int


@dataclass(frozen=True)
class MemoryEstimate:
    """What one instance of ``spec`` at (tp, pp, ep) needs per GPU, and what KV capacity is left."""

    model: str
    tp: int
    pp: int
    ep: int
    weight_dtype: str
    kv_dtype: str
    gpu_memory_bytes: int
    budget_bytes: int
    weights_bytes_per_gpu: int
    activation_bytes: int
    workspace_bytes: int
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_token_model: int
    kv_budget_bytes: int
    kv_tokens_capacity: int
    max_model_len: int
    num_seqs: int
    max_concurrent_seqs: int
    fits: bool
    reasons: tuple[str, ...]
    stages: tuple[StageMemory, ...]

    @property
    def gpus(self) -> int:
        """GPUs one instance uses."""
        return self.tp * self.pp

    def concurrent_seqs(self, seq_len: int, block_size: int = 16) -> int:
        """Sequences of ``seq_len`` tokens whose KV fits at once (whole blocks per sequence)."""
        blocks = math.ceil(seq_len / block_size)
        return self.kv_tokens_capacity // (blocks * block_size) if blocks else 0


def padded_vocab(vocab: int) -> int:
    """Vocabulary rounded up to vLLM's padding multiple."""
    return math.ceil(vocab / VOCAB_PADDING) * VOCAB_PADDING


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    """KV heads each tp rank caches: ``max(1, kv_heads // tp)``; MLA's single latent is not split."""
    if spec.mla is not None:
        return 1
    return max(1, spec.num_kv_heads // tp)


def kv_bytes_per_token_per_layer(spec: ModelSpec, tp: int, kv_dtype: KvDtype | None = None) -> float:
    """KV-cache bytes one token costs on one GPU for one layer."""
    elem = kv_element_bytes(kv_dtype or spec.kv_dtype, spec.activation_dtype)
    return kv_heads_per_rank(spec, tp) * spec.kv_state_dims * elem


def stage_weights(spec: ModelSpec, layers: range, *, first: bool, last: bool, tp: int, ep: int) -> WeightBreakdown:
    """Weight bytes on one GPU of a stage holding ``layers``."""
    wb = weight_format(spec.weight_dtype).bytes_per_param
    ab = activation_bytes(spec.activation_dtype)
    vocab_shard = math.ceil(padded_vocab(spec.vocab_size) / tp) * spec.hidden_size
    embedding = vocab_shard * ab if first else 0.0
    # A tied lm_head shares the embedding on one stage; with pp > 1 the last stage keeps its own copy.
    holds_head = last and (not spec.tie_word_embeddings or not first)
    lm_head = vocab_shard * ab if holds_head else 0.0
    a = spec.attention_params()
    kv_share = kv_heads_per_rank(spec, tp) / spec.num_kv_heads if spec.num_kv_heads else 0.0
    attn_layer = (a.q_and_o / tp + a.kv * kv_share) * wb + a.bias / tp * ab
    attention = mlp = experts = 0.0
    replicated = spec.hidden_size * ab if last else 0.0  # final norm
    for layer in layers:
        attention += attn_layer
        replicated += a.replicated * wb + spec.norm_params(layer) * ab
        if spec.moe is not None and spec.is_moe_layer(layer):
            per_rank_experts = math.ceil(spec.moe.num_experts / ep)
            experts += per_rank_experts * spec.expert_params() / (tp // ep) * wb
            mlp += spec.shared_expert_params() / tp * wb
            replicated += spec.router_params() * ab
        else:
            mlp += spec.dense_mlp_params() / tp * wb
    return WeightBreakdown(
        embedding=round(embedding),
        lm_head=round(lm_head),
        attention=round(attention),
        mlp=round(mlp),
        experts=round(experts),
        replicated=round(replicated),
    )


def activation_peak(spec: ModelSpec, layers: range, *, last: bool, tp: int, tokens: int, num_seqs: int) -> int:
    """Transient activation peak of a forward pass over ``tokens`` batched tokens on one GPU.

    Per token: the residual and hidden states (2h) plus the larger of the attention tensors
    (q, k, v, output) and the MLP intermediates (gate_up and act: 3 x intermediate / tp; fused MoE:
    top_k x (3 x expert intermediate / tp + h)). The last stage adds fp32 logits for ``num_seqs``
    sampled rows. Checked against vLLM PR #10511: Llama-3-8B TP1 "activation peak 1.26GiB" versus
    0.90 GiB from this formula at 8192 tokens (docs/estimator.md).
    """
    ab = activation_bytes(spec.activation_dtype)
    h = spec.hidden_size
    kvh = kv_heads_per_rank(spec, tp)
    attn = 2 * spec.attention_width / tp + kvh * spec.kv_state_dims
    widest = 0.0
    has_dense = any(not spec.is_moe_layer(i) for i in layers)
    if has_dense:
        widest = 3 * spec.intermediate_size / tp
    if spec.moe is not None and any(spec.is_moe_layer(i) for i in layers):
        m = spec.moe
        moe = m.experts_per_token * (3 * m.expert_intermediate_size / tp + h)
        moe += 3 * m.shared_intermediate_size / tp
        widest = max(widest, moe)
    per_token = (2 * h + max(attn, widest)) * ab
    logits = num_seqs * padded_vocab(spec.vocab_size) / tp * 4 if last else 0
    return round(per_token * tokens + logits)


def estimate_memory(
    spec: ModelSpec,
    *,
    gpu_memory_bytes: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    max_model_len: int | None = None,
    num_seqs: int = 1,
    config: MemoryConfig | None = None,
    layer_partition: tuple[int, ...] | None = None,
) -> MemoryEstimate:
    """Per-GPU memory of one instance and the KV tokens that fit; raises only on invalid degrees,
    lengths or memory sizes (``InfeasibleError`` naming the value; a 0 length is not "the default").

    ``layer_partition`` gives the layers per pipeline stage (as ``VLLM_PP_LAYER_PARTITION`` does);
    by default layers are split the way vLLM's ``get_pp_indices`` does.

    ``fits`` is true when every stage's KV budget holds ``num_seqs`` sequences of ``max_model_len``
    tokens (vLLM refuses to start when one max-length sequence does not fit).
    """
    check_degrees(spec, tp, pp, ep)
    if max_model_len is not None and max_model_len < 1:
        raise InfeasibleError(f"max_model_len={max_model_len} must be at least 1")
    if num_seqs < 1:
        raise InfeasibleError(f"num_seqs={num_seqs} must be at least 1")
    if gpu_memory_bytes < 1:
        raise InfeasibleError(f"gpu_memory_bytes={gpu_memory_bytes} must be positive")
    cfg = config or MemoryConfig()
    seq_len = max_model_len or spec.max_position_embeddings
    budget = math.ceil(gpu_memory_bytes * cfg.gpu_memory_utilization)
    workspace = cfg.non_torch_bytes + cfg.cudagraph_bytes + (cfg.comm_buffer_bytes if tp * pp > 1 else 0)
    tokens = min(cfg.max_num_batched_tokens, max(seq_len, 1) * cfg.max_num_seqs)
    per_layer_kv = kv_bytes_per_token_per_layer(spec, tp)
    ranges = partition_ranges(spec.num_layers, pp, layer_partition)
    stages = []
    for i, layers in enumerate(ranges):
        first, last = i == 0, i == pp - 1
        weights = stage_weights(spec, layers, first=first, last=last, tp=tp, ep=ep)
        act = activation_peak(spec, layers, last=last, tp=tp, tokens=tokens, num_seqs=cfg.max_num_seqs)
        kv_budget = budget - weights.total - act - workspace
        block_bytes = cfg.block_size * per_layer_kv * len(layers)
        capacity = int(kv_budget // block_bytes) * cfg.block_size if kv_budget > 0 and block_bytes else 0
        stages.append(StageMemory(i, len(layers), weights, act, round(per_layer_kv * len(layers)), kv_budget, capacity))
    worst = max(stages, key=lambda s: s.weights.total)
    capacity = min(s.kv_tokens_capacity for s in stages)
    seq_tokens = math.ceil(seq_len / cfg.block_size) * cfg.block_size
    reasons: list[str] = []
    if min(s.kv_budget_bytes for s in stages) <= 0:
        need = max(s.weights.total + s.activation_bytes for s in stages) + workspace
        reasons.append(
            f"weights + activations + workspace need {need / GIB:.1f} GiB per GPU, "
            f"over the {budget / GIB:.1f} GiB budget"
        )
    elif capacity < num_seqs * seq_tokens:
        reasons.append(f"KV cache holds {capacity} tokens per GPU, fewer than {num_seqs} x {seq_len} (max model len)")
    return MemoryEstimate(
        model=spec.name,
        tp=tp,
        pp=pp,
        ep=ep,
        weight_dtype=spec.weight_dtype,
        kv_dtype=spec.kv_dtype,
        gpu_memory_bytes=gpu_memory_bytes,
        budget_bytes=budget,
        weights_bytes_per_gpu=worst.weights.total,
        activation_bytes=max(s.activation_bytes for s in stages),
        workspace_bytes=workspace,
        kv_bytes_per_token_per_gpu=max(s.kv_bytes_per_token for s in stages),
        kv_bytes_per_token_model=spec.kv_bytes_per_token(kv_element_bytes(spec.kv_dtype, spec.activation_dtype)),
        kv_budget_bytes=min(s.kv_budget_bytes for s in stages),
        kv_tokens_capacity=capacity,
        max_model_len=seq_len,
        num_seqs=num_seqs,
        max_concurrent_seqs=capacity // seq_tokens if seq_tokens else 0,
        fits=not reasons,
        reasons=tuple(reasons),
        stages=tuple(stages),
    )
