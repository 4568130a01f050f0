"""Cost model: prefill time (TTFT) and decode step time (TPOT) for one instance.

One forward pass over ``T`` new tokens of ``S`` sequences, summed over the pipeline stages
(perf-anchors.md §4.1, with the corrections of issue 16):

    T_mem   = weight bytes read / (eta_mem x HBM bandwidth)
    T_cmp   = dense GEMM FLOPs / (eta(dtype) x peak(dtype))
            + grouped expert GEMM FLOPs (tile-padded rows) / (eta(dtype) x peak(dtype))
            + lm_head FLOPs / (eta_flops x BF16 peak)
              (each GEMM at eta x n / (n + gemm_n_half(dtype)) over its n output columns per GPU)
    T_attn  = KV bytes read / (eta_kv x HBM bandwidth) + attention FLOPs / (eta_attn x BF16 peak)
              (+ attn_s_half keys per prefill query token) + layers x attn_us (prefill) or attn_us_decode
              + decode sequences x KV heads x layers x attn_seq_ns    (NVIDIA's attention tables)
    T_comm  = 2 x layers x all-reduce(T x hidden x 2 B, tp)         (two per layer, Megatron TP;
              x comm_scale, except over PCIe)
    T_small = layers x kernels_per_layer x kernel_us + MoE layers x moe_layer_us + MLA layers x mla_layer_us
              (x prefill_kernel_factor in a pass with prefill work, on engines that launch it from Python)
    T_pass  = (T_mem^p + T_cmp^p)^(1/p) + T_attn + T_comm + T_small + (pp - 1) x P2P + overhead

* ``(m^p + c^p)^(1/p)`` is a smooth roofline of the GEMMs: ``p`` large is ``max(memory,
  compute)``, ``p = 1`` their sum. Measured pass times sit between the two near the ridge (short
  prompts, mid batches); ``p`` is fitted (``roofline_p``). Attention is its own kernel: its KV
  traffic (decode) and FLOPs (prefill) add to the GEMMs, which keeps a decode step exactly linear
  in the context it reads (the simulator's macro steps rely on that).
* FP8 GEMMs reach a lower fraction of FP8 peak than BF16 GEMMs of BF16 peak: ``eta_flops_fp8``.
  Attention and the lm_head run in the activation dtype (BF16) whatever the weights are.
* MoE experts run as a grouped GEMM: with ``m = T k / E_touched`` tokens per touched expert, each
  touched expert costs ``max(m, moe_tile_m)`` token rows (a tile is computed whole, so few tokens per
  expert waste most of it); the router, top-k, permute and unpermute kernels cost ``moe_layer_us``
  per MoE layer. An engine version at or past its fused-MoE tables' prices the experts by that engine's
  fit instead (its tile, routing cost, HBM fraction and grouped-GEMM efficiency: ``perf/moe_engines.py``).
  Decode reads only the experts the batch routes to:
  ``E x (1 - (1 - k/E)^T)`` per MoE layer.
* MLA (DeepSeek-V2/V3) decode runs with the absorbed weights: per head and context token it does
  ``2 (2 kv_lora_rank + rope dim)`` FLOPs on the latent cache, and its extra projections and norms
  cost ``mla_layer_us`` per layer. MLA prefill runs as multi-head attention with QK over the
  ``nope + rope`` head dims and PV over ``v_head_dim``: its width is their mean per head.
* A pass with prefill work carries ``prefill_overhead_ms`` (scheduling, and for client-side TTFT
  the request's HTTP/tokenisation path); a decode-only step carries ``step_overhead_ms``. Engines
  that launch a prefill op by op from Python (vLLM, SGLang, TensorRT-LLM's PyTorch backend:
  ``HOST_LAUNCHED_PREFILL``; also the default when the engine is not given) pay
  ``prefill_kernel_factor`` times the small-kernel cost in such a pass (decode steps replay CUDA
  graphs); a TensorRT engine (TensorRT-LLM's TensorRT path, NIM) runs its prefill as one enqueued
  engine and pays the decode step's.
* The TP all-reduces cost ``comm_scale`` times the link table's time: the table is the best of
  nccl-tests and the custom all-reduce with CUDA graphs, measured alone; inside a forward pass the
  engines reach less (fitted on the published anchors: the TP4/TP8 TensorRT-LLM rows over NVLink).
  PCIe-only links are not scaled: the one PCIe anchor with TP > 1 (L40S TP4) is compared with a
  derived PCIe curve and wants it faster, not slower. Network and two-level links are scaled like
  NVLink (no anchor measures them in an engine; a TP group across nodes must not come out cheaper
  than one inside an NVLink domain).
* Engines chunk prefill: with ``max_batched_tokens`` the TTFT of a batch is the sum of budget-sized
  passes, each attending to the chunks before it.

The embedding is a gather (not read in full); the lm_head is read and multiplied on the last stage.
``PassModel`` precomputes everything that does not depend on the batch; ``predict_latency`` and
``perf/step.py``'s ``StepCost`` both evaluate it, so they are one model. When no ``PerfConfig`` is
passed the coefficients come from the active calibration profile (``perf/profile.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from toposched.errors import InputError
from toposched.perf.coefficients import PerfConfig
from toposched.perf.engine_names import engine_of
from toposched.perf.hardware import GpuSpec
from toposched.perf.links import LinkSpec
from toposched.perf.moe_engines import moe_kernels
from toposched.perf.profile import active_config
from toposched.workload.dtypes import activation_bytes, weight_format
from toposched.workload.memory import kv_bytes_per_token_per_layer, padded_vocab
from toposched.workload.parallel import check_degrees, stage_layers
from toposched.workload.spec import ModelSpec


@dataclass(frozen=True)
class StepTime:
    """One pass (prefill or one decode step) over all stages, in milliseconds, by term."""

    memory_ms: float  # weights read (the GEMMs' operand traffic)
    compute_ms: float  # GEMM FLOPs (dense, grouped experts, lm_head)
    comm_ms: float
    small_kernels_ms: float
    p2p_ms: float
    overhead_ms: float
    roofline_p: float = 16.0
    attention_ms: float = 0.0  # attention kernels: KV read + attention FLOPs
    gemm_fixed_ms: float = 0.0  # the GEMM kernels' fixed cost (PerfConfig.gemm_us per GEMM)

    @property
    def roofline_ms(self) -> float:
        """The GEMMs: smooth roofline of memory and compute time, ``(m^p + c^p)^(1/p)``, plus their
        fixed cost per kernel."""
        return roofline(self.memory_ms, self.compute_ms, self.roofline_p) + self.gemm_fixed_ms

    @property
    def total_ms(self) -> float:
        """Time of the pass: smooth roofline of the GEMMs plus attention and the additive terms."""
        return (
            self.roofline_ms + self.attention_ms + self.comm_ms + self.small_kernels_ms + self.p2p_ms + self.overhead_ms
        )

    @property
    def bound(self) -> str:
        """Which roofline term of the GEMMs dominates: ``memory`` or ``compute``."""
        return "memory" if self.memory_ms >= self.compute_ms else "compute"


GEMMS_PER_LAYER = 4
"""GEMM kernels of one transformer layer that pay ``PerfConfig.gemm_us``: QKV, O, gate+up, down."""


def roofline(memory: float, compute: float, p: float) -> float:
    """``(memory^p + compute^p)^(1/p)``, computed without overflow."""
    top = max(memory, compute)
    if top <= 0.0:
        return 0.0
    return float(top * ((memory / top) ** p + (compute / top) ** p) ** (1.0 / p))


@dataclass(frozen=True)
class LatencyEstimate:
    """Predicted latencies of one batch: TTFT, TPOT, end-to-end time and throughput."""

    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    tokens_per_s: float
    prefill: StepTime
    decode: StepTime
    prefill_passes: int = 1
    """Passes the prefill took (more than one when chunked by ``max_batched_tokens``); ``prefill``
    is the first of them."""


HOST_LAUNCHED_PREFILL = ("vllm", "sglang", "tensorrt-llm-pytorch")
"""Engines whose prefill passes are launched op by op from Python (no CUDA graph for a prefill of
varying shape): they pay ``prefill_kernel_factor``. The others named in ``TENSORRT_ENGINES`` run a
built TensorRT engine."""
TENSORRT_ENGINES = ("tensorrt-llm", "nvidia-nim")
"""TensorRT-LLM's TensorRT-engine path (``trtllm-build`` / ``trtllm-bench build``) and NVIDIA NIM's
TensorRT-LLM profiles: a prefill is one enqueued engine, its small kernels cost what a decode's do."""


def prefill_launched_from_host(engine: str | None) -> bool:
    """Whether ``engine`` launches a prefill op by op from Python (True for an unknown or unnamed
    engine: toposched launches vLLM and SGLang)."""
    name = engine_of(engine) or ""
    return name in HOST_LAUNCHED_PREFILL or name not in TENSORRT_ENGINES


def _comm_scaled(link: LinkSpec) -> bool:
    """Whether ``comm_scale`` applies to the link's all-reduces: every kind but the PCIe-only boxes
    (NVLink, and the network and two-level links, whose in-engine cost no anchor measures: scaled
    like NVLink so that a TP group across nodes never costs less than one inside an NVLink domain)."""
    return not link.name.startswith("pcie")


def _touched_experts(num_experts: int, per_token: int, tokens: int) -> float:
    """Expected distinct experts hit when ``tokens`` tokens each pick ``per_token`` of them."""
    return num_experts * (1.0 - (1.0 - per_token / num_experts) ** tokens)


class PassModel:
    """The batch-independent part of the cost model for one placement; ``step`` times one pass."""

    def __init__(
        self,
        spec: ModelSpec,
        gpu: GpuSpec,
        *,
        tp: int,
        pp: int,
        link: LinkSpec,
        pp_link: LinkSpec,
        cfg: PerfConfig,
        engine: str | None = None,
    ) -> None:
        self.spec, self.tp, self.pp, self.link, self.pp_link, self.cfg = spec, tp, pp, link, pp_link, cfg
        self._prefill_factor = cfg.prefill_kernel_factor if prefill_launched_from_host(engine) else 1.0
        self._comm_scale = cfg.comm_scale if _comm_scaled(link) else 1.0
        wb = weight_format(spec.weight_dtype).bytes_per_param
        ab = activation_bytes(spec.activation_dtype)
        a = spec.attention_params()
        kv_heads = max(1, spec.num_kv_heads // tp) if spec.mla is None else 1
        kv_share = kv_heads / spec.num_kv_heads if spec.num_kv_heads else 0.0
        attn = a.q_and_o / tp + a.kv * kv_share + a.replicated
        fixed = 0.0  # parameters read whatever the batch = dense parameters each token multiplies with
        widths = 0.0  # input widths (k) of the GEMMs those parameters form, summed: the width curve's charge
        moe_layers = 0
        attn_k, mlp_k, shared_k, expert_k = gemm_input_widths(spec, tp)
        for layers in stage_layers(spec.num_layers, pp):
            for layer in layers:
                fixed += attn
                widths += attn_k
                if spec.moe is not None and spec.is_moe_layer(layer):
                    moe_layers += 1
                    fixed += spec.shared_expert_params() / tp + spec.router_params()
                    widths += shared_k
                else:
                    fixed += spec.dense_mlp_params() / tp
                    widths += mlp_k
        head = padded_vocab(spec.vocab_size) * spec.hidden_size / tp  # on the last stage only
        bw = gpu.hbm_bandwidth * cfg.eta_mem
        self._flops_w = gpu.gemm_flops(spec.weight_dtype) * cfg.gemm_eta(str(spec.weight_dtype), gpu)
        self._flops_a = gpu.bf16_flops * cfg.eta_flops
        self._flops_attn = gpu.bf16_flops * cfg.eta_attn
        # memory seconds = _mem_fixed + _mem_per_expert x experts touched + _mem_per_kv x KV tokens read
        self._mem_fixed = (fixed * wb + head * ab) / bw
        # an engine version at or past its fused-MoE tables' prices the experts by them (perf/moe_engines.py)
        kernels = moe_kernels(engine, str(spec.weight_dtype), spec.fp8_block, gpu) if spec.moe else None
        self.moe_kernels = kernels
        self._moe_tile = kernels.moe_tile_m if kernels else cfg.moe_tile_m
        # (a calibrated eta_mem or GEMM efficiency times the engine's fraction stays at most the GPU's peak)
        mem_moe = min(kernels.mem_moe, 1.0 / cfg.eta_mem) if kernels else 1.0
        self._mem_per_expert = moe_layers * spec.expert_params() / tp * wb / bw / mem_moe
        self._mem_per_kv = kv_bytes_per_token_per_layer(spec, tp) * spec.num_layers / (gpu.hbm_bandwidth * cfg.eta_kv)
        # the attention kernels' fixed costs (benchmarks/attention_tables.py): per layer and pass, and per
        # decode sequence, KV head on this GPU (MLA: its one latent head) and layer
        self._attn_prefill_s = spec.num_layers * cfg.attn_us * 1e-6
        self._attn_decode_s = spec.num_layers * cfg.attn_us_decode * 1e-6
        self._attn_seq_s = kv_heads * spec.num_layers * cfg.attn_seq_ns * 1e-9
        # GEMM efficiency eta x n / (n + n_half) over each GEMM's output columns n per GPU = charging every
        # GEMM n_half more columns: FLOPs per token 2 x sum k (n + n_half) = 2 (parameters + n_half x sum k)
        n_half = cfg.gemm_n_half_for(str(spec.weight_dtype), gpu)
        self._dense = fixed + n_half * widths
        self._head = head + cfg.gemm_n_half * spec.hidden_size  # BF16, k = hidden
        self._moe = spec.moe
        # one token through one expert (its gate+up and down GEMMs)
        self._expert_flops_per_row = 2.0 * (spec.expert_params() / tp + n_half * expert_k) * moe_layers
        if kernels is not None and spec.moe is not None:  # its grouped-GEMM efficiency, n / (n + n_half) wide
            width = spec.moe.expert_intermediate_size / tp
            eta_moe = min(kernels.eta_moe, 1.0 / cfg.gemm_eta(str(spec.weight_dtype), gpu))
            self._expert_flops_per_row *= (width + kernels.moe_n_half) / width / eta_moe
        self._ar_bytes_per_token = spec.hidden_size * ab
        if spec.mla is not None:  # MLA prefill: QK over nope + rope dims, PV over v_head_dim
            m = spec.mla
            self._width = spec.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / 2
        else:
            self._width = spec.attention_width
        # decode attention FLOPs = 2 (per MAC) x context x _decode_width per token and layer
        if spec.mla is not None:  # absorbed MLA decode: QK over latent + rope dims, PV over the latent
            self._decode_width = spec.num_heads * (2 * spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim)
        else:  # QK^T and PV over the head width each
            self._decode_width = 2 * spec.attention_width
        self.layers = spec.num_layers
        # four GEMM kernels per layer (QKV, O, gate+up, down; an MoE layer's grouped GEMMs stand for its
        # MLP pair) and the lm_head (BF16), each with its fixed cost (benchmarks/gemm_tables.py)
        self._gemm_fixed_ms = (
            GEMMS_PER_LAYER * spec.num_layers * cfg.gemm_fixed_us(str(spec.weight_dtype), gpu) + cfg.gemm_us
        ) * 1e-3
        self._small_ms = (
            spec.num_layers * cfg.kernels_per_layer * cfg.kernel_us
            + moe_layers * (kernels.moe_layer_us if kernels else cfg.moe_layer_us)
            + (spec.num_layers * cfg.mla_layer_us if spec.mla is not None else 0.0)
        ) * 1e-3

    def touched(self, tokens: int) -> float:
        """Expected experts per MoE layer a pass of ``tokens`` tokens routes to (0 for dense)."""
        m = self._moe
        if m is None:
            return 0.0
        return _touched_experts(m.num_experts, m.experts_per_token, tokens)

    def allreduce_ms(self, tokens: int) -> float:
        """The TP all-reduces of one pass over ``tokens`` tokens (two per layer)."""
        us = self.link.allreduce_us(tokens * self._ar_bytes_per_token, self.tp)
        return 2 * self.layers * us * self._comm_scale * 1e-3

    def p2p_ms(self, tokens: int) -> float:
        """Stage-to-stage hand-offs of one pass."""
        return (self.pp - 1) * self.pp_link.p2p_us(tokens * self._ar_bytes_per_token) * 1e-3

    def step(
        self, *, decode_seqs: int = 0, decode_context: float = 0.0, chunks: Sequence[tuple[int, int]] = ()
    ) -> StepTime | None:
        """One pass: ``decode_seqs`` decodes holding ``decode_context`` KV tokens in total, and prefill
        ``chunks`` of ``(tokens already prefilled, chunk tokens)``; None when there is no work."""
        tokens = decode_seqs
        kv_read = decode_context
        prefill_attn = 0.0
        for done, n in chunks:
            tokens += n
            kv_read += done  # the chunk's attention reads its earlier tokens' KV once
            # the causal square, and attn_s_half extra keys per query token (the efficiency curve)
            prefill_attn += 2.0 * ((done + n) * (done + n) - done * done + n * self.cfg.attn_s_half)
        if tokens <= 0:
            return None
        seqs = decode_seqs + len(chunks)
        touched = self.touched(tokens)
        mem = self._mem_fixed + self._mem_per_expert * touched
        cmp = (2.0 * tokens * self._dense) / self._flops_w + 2.0 * seqs * self._head / self._flops_a
        attn_flops = (2.0 * decode_context * self._decode_width + prefill_attn * self._width) * self.layers / self.tp
        attention = self._mem_per_kv * kv_read + attn_flops / self._flops_attn + self._attn_seq_s * decode_seqs
        attention += max(self._attn_prefill_s if chunks else 0.0, self._attn_decode_s if decode_seqs else 0.0)
        if self._moe is not None and touched > 0:
            # grouped GEMM: each touched expert runs max(tokens it got, one tile) rows
            per_expert = tokens * self._moe.experts_per_token / touched
            rows = touched * max(per_expert, self._moe_tile)
            cmp += rows * self._expert_flops_per_row / self._flops_w
        overhead = self.cfg.prefill_overhead_ms if chunks else self.cfg.step_overhead_ms
        small = self._small_ms * (self._prefill_factor if chunks else 1.0)
        return StepTime(
            memory_ms=mem * 1e3,
            compute_ms=cmp * 1e3,
            attention_ms=attention * 1e3,
            comm_ms=self.allreduce_ms(tokens),
            small_kernels_ms=small,
            p2p_ms=self.p2p_ms(tokens),
            overhead_ms=overhead,
            roofline_p=self.cfg.roofline_p,
            gemm_fixed_ms=self._gemm_fixed_ms,
        )


def gemm_input_widths(spec: ModelSpec, tp: int) -> tuple[float, float, float, float]:
    """Summed input widths ``k`` per GPU of one layer's GEMMs: (attention projections, dense MLP, shared
    experts of an MoE layer, one routed expert). A fused QKV or gate+up GEMM counts once; the router is
    left out (a narrow BF16 GEMM the width curve was not measured on)."""
    h = spec.hidden_size
    if spec.mla is not None:
        # with a q LoRA the engines fuse q_a and kv_a into one GEMM over the hidden state (vLLM
        # fused_qkv_a_proj, SGLang fused_qkv_a_proj_with_mqa, TensorRT-LLM fused_a), then q_b, kv_b, o;
        # without one, q_proj and kv_a each read the hidden state
        m = spec.mla
        attn = (h + m.q_lora_rank if m.q_lora_rank else 2 * h) + m.kv_lora_rank + spec.num_heads * m.v_head_dim / tp
    else:  # QKV, O
        attn = h + spec.num_heads * spec.head_dim / tp
    mlp = h + spec.intermediate_size / tp  # gate+up, down
    if spec.moe is None:
        return attn, mlp, 0.0, 0.0
    m2 = spec.moe
    shared = h + m2.shared_intermediate_size / tp if m2.shared_intermediate_size else 0.0  # all shared, fused
    return attn, mlp, shared, h + m2.expert_intermediate_size / tp


def resolve_config(spec: ModelSpec, gpu: GpuSpec, config: PerfConfig | None, engine: str | None = None) -> PerfConfig:
    """``config``, else the active calibration profile's entry for this GPU, weight dtype, engine (and its
    version: ``vllm==0.11.0``, ``perf/engine_names.cost_engine``) and model family (``config.json``'s
    ``model_type``)."""
    if config is not None:
        return config
    return active_config(gpu.name, str(spec.weight_dtype), engine=engine, family=spec.model_type or None)


def prefill_chunks(batch: int, input_len: int, budget: int | None) -> list[list[tuple[int, int]]]:
    """The passes that prefill ``batch`` prompts of ``input_len`` under a batched-token ``budget``:
    prompts in arrival order, each pass filled up to the budget (a prompt may span passes)."""
    if budget is None or budget >= batch * input_len:
        return [[(0, input_len)] * batch]
    passes: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    room = budget
    for _ in range(batch):
        done = 0
        while done < input_len:
            n = min(room, input_len - done)
            current.append((done, n))
            done += n
            room -= n
            if room == 0:
                passes.append(current)
                current, room = [], budget
    if current:
        passes.append(current)
    return passes


def predict_latency(
    spec: ModelSpec,
    gpu: GpuSpec,
    *,
    tp: int,
    pp: int = 1,
    link: LinkSpec,
    pp_link: LinkSpec | None = None,
    batch: int = 1,
    input_len: int = 1024,
    output_len: int = 128,
    config: PerfConfig | None = None,
    max_batched_tokens: int | None = None,
    engine: str | None = None,
) -> LatencyEstimate:
    """TTFT, TPOT and throughput of ``batch`` sequences of ``input_len`` in, ``output_len`` out.

    ``link`` joins the GPUs of one TP group; ``pp_link`` joins consecutive pipeline stages
    (defaults to ``link``). TTFT is the prefill of all ``batch x input_len`` tokens: one pass, or
    with ``max_batched_tokens`` (the engine's batched-token limit) the sum of budget-sized passes.
    TPOT is the decode step at the mean context ``input_len + output_len / 2``. ``config`` defaults
    to the active calibration profile's coefficients for this GPU and weight dtype; ``engine``
    (``vllm``, ``sglang``, ``tensorrt-llm``, ...) decides whether a prefill pays the host-launch cost
    (``prefill_launched_from_host``).
    """
    check_degrees(spec, tp, pp)
    if batch < 1 or input_len < 1 or output_len < 1:
        raise InputError(f"batch, input_len and output_len must be positive, got {batch}, {input_len}, {output_len}")
    if max_batched_tokens is not None and max_batched_tokens < 1:
        raise InputError(f"max_batched_tokens must be positive, got {max_batched_tokens}")
    cfg = resolve_config(spec, gpu, config, engine)
    model = PassModel(spec, gpu, tp=tp, pp=pp, link=link, pp_link=pp_link or link, cfg=cfg, engine=engine)
    passes = [model.step(chunks=c) for c in prefill_chunks(batch, input_len, max_batched_tokens)]
    steps = [p for p in passes if p is not None]
    context = input_len + output_len / 2
    decode = model.step(decode_seqs=batch, decode_context=batch * context)
    assert decode is not None and steps  # batch >= 1
    ttft = sum(p.total_ms for p in steps)
    tpot = decode.total_ms
    e2e = ttft + (output_len - 1) * tpot
    return LatencyEstimate(
        ttft_ms=ttft,
        tpot_ms=tpot,
        e2e_ms=e2e,
        tokens_per_s=batch * output_len / (e2e / 1e3),
        prefill=steps[0],
        decode=decode,
        prefill_passes=len(steps),
    )
