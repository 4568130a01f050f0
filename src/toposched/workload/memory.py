"""Per-GPU HBM estimator: weights, KV cache, activation peak and workspace for (tp, pp, ep).

Three engines' sizing rules (``MemoryConfig.engine``), read from their sources (engines.md §1.4, §2;
tests/data/reference/data/trtllm-serve-options.json):

* **vLLM 0.33.0** (``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``,
  ``vllm/utils/mem_utils.py`` ``memory_profiling``, ``vllm/v1/worker/utils.py`` ``request_memory``):
  KV pool = ceil(total x ``gpu_memory_utilization``) - weights - activation peak - non-torch memory
  - CUDA-graph estimate. The CUDA-graph estimate is deducted by default since v0.21
  (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1`` in ``vllm/envs.py``); the v0.19 logs of the
  published anchors predate that (``deduct_cudagraph=False`` reproduces them). The activation peak
  is the profile run's (``gpu_model_runner.py`` ``profile_run``): a forward pass over
  ``max_num_batched_tokens`` tokens, then ``_dummy_sampler_run`` on ``max_num_seqs`` rows of
  full-vocabulary logits (``compute_logits`` gathers the whole vocabulary on every TP rank, so this
  part does not shrink with TP), plus the fused-MoE workspace the forward leaves allocated.
* **SGLang 0.5.23** (``srt/mem_cache/kv_cache_configurator.py`` ``_profile_available_bytes``):
  KV pool = free memory after loading the weights - (free memory before loading) x
  (1 - ``mem_fraction_static``); no activation profiling. The default ``mem_fraction_static``
  follows ``srt/arg_groups/memory_hook.py`` ``handle_gpu_memory_settings``.
* **TensorRT-LLM** (``trtllm-serve --kv_cache_free_gpu_memory_fraction``, default 0.9 "of free memory
  after weights and buffers"): KV pool = fraction x (total - weights - activation peak - non-torch
  memory), a fraction of what is *free* rather than vLLM's fraction of the *total*. The activation
  peak of TensorRT-LLM's profiling forward (over ``max_num_tokens``) is modelled by vLLM's rule below,
  an approximation no TensorRT-LLM measurement has checked yet. CUDA graphs are captured after the
  pool is allocated, so they must fit in the remaining (1 - fraction) share; a plan's KV bytes become a
  launch's fraction through :func:`trtllm_fraction_for`, the inverse of :func:`trtllm_kv_budget`.

Then one KV block per layer = block_size x kv_heads_per_rank x (k + v head dims) x dtype bytes, with
kv_heads_per_rank = max(1, kv_heads // tp) (replicated when tp > KV heads); MLA caches one latent of
kv_lora_rank + qk_rope_head_dim per layer, not sharded by tp; tokens that fit = (KV budget // bytes per
block over this GPU's layers) x block_size.

The constants that are not in either source (non-torch memory, the sampler's bytes per logit, the
CUDA-graph estimate; ``FIT_*`` in ``workload/memory_config.py``, beside ``MemoryConfig``) are fitted
to the published vLLM v0.19 memory profiles in ``reference/data/anchors-train.json``;
``benchmarks/memory_anchors.py`` re-fits them and reports the leave-one-out errors
(docs/estimator.md).

With pipeline parallelism every stage is computed and the worst one is reported (most weight bytes,
fewest KV tokens). Everything here is a pure function of its arguments (no I/O), so a placement
solver can call ``estimate_memory`` many times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toposched.errors import InfeasibleError
from toposched.workload.dtypes import KvDtype, activation_bytes, kv_element_bytes, weight_format
from toposched.workload.memory_config import (
    GIB,
    Engine,
    MemoryConfig,
    sglang_default_mem_fraction,
    trtllm_free_bytes,
    trtllm_kv_budget,
)
from toposched.workload.parallel import check_degrees, partition_ranges
from toposched.workload.spec import ModelSpec

# vLLM pads the vocabulary of VocabParallelEmbedding / ParallelLMHead to a multiple of 64
# (vllm/model_executor/layers/vocab_parallel_embedding.py, DEFAULT_VOCAB_PADDING_SIZE = 64).
VOCAB_PADDING = 64


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
    engine: Engine = "vllm"
    non_torch_bytes: int = 0
    cudagraph_bytes: int = 0
    """The CUDA-graph estimate (deducted only when ``MemoryConfig.deduct_cudagraph``; 0 for SGLang;
    for TensorRT-LLM taken from what the KV pool leaves free)."""

    @property
    def gpus(self) -> int:
        """GPUs one instance uses."""
        return self.tp * self.pp

    def concurrent_seqs(self, seq_len: int, block_size: int = 16) -> int:
        """Sequences of ``seq_len`` tokens whose KV fits at once (whole blocks per sequence)."""
        return seqs_held(self.kv_tokens_capacity, seq_len, block_size)


def seqs_held(kv_tokens: int, seq_len: int, block_size: int = 16) -> int:
    """Sequences of ``seq_len`` tokens that ``kv_tokens`` of KV cache hold at once (whole blocks each)."""
    blocks = math.ceil(seq_len / block_size)
    return kv_tokens // (blocks * block_size) if blocks else 0


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


def _attention_bytes(spec: ModelSpec, layer: int, tp: int, wb: float, ab: float) -> float:
    """One layer's attention projections on one tp rank; 16-bit where the checkpoint keeps them."""
    a = spec.attention_params()
    kv_share = kv_heads_per_rank(spec, tp) / spec.num_kv_heads if spec.num_kv_heads else 0.0

    def width(projection: str) -> float:
        return ab if spec.linear_at_16_bits(layer, projection) else wb

    if spec.mla is not None or not spec.unquantized:
        return (a.q_and_o / tp + a.kv * kv_share) * wb + a.bias / tp * ab
    half_qo, half_kv = a.q_and_o / 2 / tp, a.kv / 2 * kv_share
    return (
        half_qo * (width("q_proj") + width("o_proj")) + half_kv * (width("k_proj") + width("v_proj")) + a.bias / tp * ab
    )


def _dense_mlp_bytes(spec: ModelSpec, layer: int, tp: int, wb: float, ab: float) -> float:
    """One layer's dense MLP (gate, up, down) on one tp rank; 16-bit where the checkpoint keeps them."""
    third = spec.dense_mlp_params() / 3 / tp
    return sum(third * (ab if spec.linear_at_16_bits(layer, p) else wb) for p in ("gate_proj", "up_proj", "down_proj"))


def stage_weights(spec: ModelSpec, layers: range, *, first: bool, last: bool, tp: int, ep: int) -> WeightBreakdown:
    """Weight bytes on one GPU of a stage holding ``layers``.

    Quantised checkpoints keep embeddings, lm_head, norms and routers in 16 bits, and the
    projections their ``quantization_config`` ignore list names (``ModelSpec.unquantized``).
    """
    wb = weight_format(spec.weight_dtype).bytes_per_param
    ab = activation_bytes(spec.activation_dtype)
    vocab_shard = math.ceil(padded_vocab(spec.vocab_size) / tp) * spec.hidden_size
    embedding = vocab_shard * ab if first else 0.0
    # A tied lm_head shares the embedding on one stage; with pp > 1 the last stage keeps its own copy.
    holds_head = last and (not spec.tie_word_embeddings or not first)
    lm_head = vocab_shard * ab if holds_head else 0.0
    a = spec.attention_params()
    attention = mlp = experts = 0.0
    replicated = spec.hidden_size * ab if last else 0.0  # final norm
    for layer in layers:
        attention += _attention_bytes(spec, layer, tp, wb, ab)
        replicated += a.replicated * wb + spec.norm_params(layer) * ab
        if spec.moe is not None and spec.is_moe_layer(layer):
            per_rank_experts = math.ceil(spec.moe.num_experts / ep)
            experts += per_rank_experts * spec.expert_params() / (tp // ep) * wb
            mlp += spec.shared_expert_params() / tp * wb
            replicated += spec.router_params() * ab
        else:
            mlp += _dense_mlp_bytes(spec, layer, tp, wb, ab)
    return WeightBreakdown(
        embedding=round(embedding),
        lm_head=round(lm_head),
        attention=round(attention),
        mlp=round(mlp),
        experts=round(experts),
        replicated=round(replicated),
    )


def moe_workspace(spec: ModelSpec, layers: range, *, tp: int, ep: int, tokens: int) -> int:
    """Fused-MoE buffers the profile forward leaves allocated (vLLM ``fused_moe``): one buffer for
    tokens x top_k x max(2 x I, hidden) (gate_up output, reused for the down output) and one for
    tokens x top_k x I (the activation), I the expert width on this rank. 0 without MoE layers."""
    if spec.moe is None or not any(spec.is_moe_layer(i) for i in layers):
        return 0
    m = spec.moe
    inter = m.expert_intermediate_size / max(1, tp // ep)
    per_token = m.experts_per_token * (max(2 * inter, spec.hidden_size) + inter)
    return round(per_token * tokens * activation_bytes(spec.activation_dtype))


def activation_peak(
    spec: ModelSpec,
    layers: range,
    *,
    last: bool,
    tp: int,
    tokens: int,
    num_seqs: int,
    ep: int = 1,
    config: MemoryConfig | None = None,
) -> int:
    """vLLM's profiled activation peak on one GPU of a stage (``gpu_model_runner.py`` ``profile_run``).

    = a constant + the hidden states of ``tokens`` batched tokens (kept through the sampler run)
      + the fused-MoE workspace + the larger of
        * the forward's transient tensors per token: residual and hidden (2h) plus the larger of the
          attention tensors (q, k, v, output) and the dense MLP intermediates (3 x intermediate / tp);
        * the sampler warm-up (last stage only): ``sampler_bytes_per_logit`` x ``num_seqs`` rows x the
          padded vocabulary. ``compute_logits`` gathers the full vocabulary on every rank: not / tp.
    """
    cfg = config or MemoryConfig()
    ab = activation_bytes(spec.activation_dtype)
    h = spec.hidden_size
    kvh = kv_heads_per_rank(spec, tp)
    attn = 2 * spec.attention_width / tp + kvh * spec.kv_state_dims
    widest = 0.0
    if any(not spec.is_moe_layer(i) for i in layers):
        widest = 3 * spec.intermediate_size / tp
    if spec.moe is not None and any(spec.is_moe_layer(i) for i in layers):
        widest = max(widest, 3 * spec.moe.shared_intermediate_size / tp)
    forward = (2 * h + max(attn, widest)) * ab * tokens
    rows = min(num_seqs, tokens)
    sampler = cfg.sampler_bytes_per_logit * rows * padded_vocab(spec.vocab_size) if last else 0.0
    hidden = tokens * h * ab
    workspace = moe_workspace(spec, layers, tp=tp, ep=ep, tokens=tokens)
    return round(cfg.profile_base_bytes + hidden + workspace + max(forward, sampler))


def cudagraph_estimate(layers: int, config: MemoryConfig | None = None) -> int:
    """vLLM's CUDA-graph memory for a GPU holding ``layers`` decoder layers: the configured
    ``cudagraph_bytes`` if given, else the fitted base + per-layer rule."""
    cfg = config or MemoryConfig()
    if cfg.cudagraph_bytes is not None:
        return cfg.cudagraph_bytes
    return cfg.cudagraph_base_bytes + cfg.cudagraph_per_layer_bytes * layers


def non_torch_memory(tp: int, pp: int, config: MemoryConfig | None = None) -> int:
    """Memory outside PyTorch's allocator on each GPU: context and workspaces, plus communication
    buffers when the instance spans GPUs."""
    cfg = config or MemoryConfig()
    return cfg.non_torch_bytes + (cfg.comm_buffer_bytes if tp * pp > 1 else 0)


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
    non_torch = non_torch_memory(tp, pp, cfg)
    if cfg.engine == "sglang":
        # free before loading = total - non-torch; pool = free after loading - free before x (1 - fraction)
        fraction = cfg.mem_fraction_static or sglang_default_mem_fraction(gpu_memory_bytes, tp, pp)
        budget = math.floor((gpu_memory_bytes - non_torch) * fraction)
    elif cfg.engine == "trtllm":
        budget = gpu_memory_bytes  # a share of what is free, not of a budget set beforehand
    else:
        budget = math.ceil(gpu_memory_bytes * cfg.gpu_memory_utilization)
    tokens = min(cfg.max_num_batched_tokens, max(seq_len, 1) * cfg.max_num_seqs)
    per_layer_kv = kv_bytes_per_token_per_layer(spec, tp)
    ranges = partition_ranges(spec.num_layers, pp, layer_partition)
    stages = []
    graphs = 0
    short_of_graphs = False
    for i, layers in enumerate(ranges):
        first, last = i == 0, i == pp - 1
        weights = stage_weights(spec, layers, first=first, last=last, tp=tp, ep=ep)
        if cfg.engine == "sglang":
            act, graph = 0, 0
            kv_budget = budget - weights.total
        else:
            act = activation_peak(
                spec, layers, last=last, tp=tp, tokens=tokens, num_seqs=cfg.max_num_seqs, ep=ep, config=cfg
            )
            graph = cudagraph_estimate(len(layers), cfg)
            if cfg.engine == "trtllm":
                free = trtllm_free_bytes(gpu_memory_bytes, weights.total, act, non_torch)
                kv_budget = trtllm_kv_budget(free, cfg.kv_cache_free_gpu_memory_fraction)
                short_of_graphs |= free > 0 and free - kv_budget < graph
            else:
                kv_budget = budget - weights.total - act - non_torch - (graph if cfg.deduct_cudagraph else 0)
        graphs = max(graphs, graph)
        block_bytes = cfg.block_size * per_layer_kv * len(layers)
        capacity = int(kv_budget // block_bytes) * cfg.block_size if kv_budget > 0 and block_bytes else 0
        stages.append(StageMemory(i, len(layers), weights, act, round(per_layer_kv * len(layers)), kv_budget, capacity))
    deducted = cfg.deduct_cudagraph or cfg.engine == "trtllm"
    workspace = 0 if cfg.engine == "sglang" else non_torch + (graphs if deducted else 0)
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
    if short_of_graphs:
        left = 1 - cfg.kv_cache_free_gpu_memory_fraction
        reasons.append(
            f"CUDA graphs need {graphs / GIB:.2f} GiB per GPU, more than the {left:.0%} of free memory the KV pool "
            "leaves (lower kv_cache_free_gpu_memory_fraction)"
        )
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
        engine=cfg.engine,
        non_torch_bytes=non_torch,
        cudagraph_bytes=graphs,
    )
