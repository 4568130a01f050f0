"""Cost model: prefill time (TTFT) and decode step time (TPOT) for one instance.

Per pipeline stage (perf-anchors.md §4.1):

    T_mem   = (weight bytes read + KV bytes read) / (eta_mem x HBM bandwidth)
    T_cmp   = (2 x tokens x params / tp + attention FLOPs / tp) / (eta_flops x peak FLOP/s)
    T_comm  = 2 x layers x all-reduce(tokens x hidden x 2 B, tp)        (two per layer, Megatron TP)
    T_small = layers x kernels_per_layer x kernel_us                    (norms, RoPE, residuals)
    T_stage = max(T_mem, T_cmp) + T_comm + T_small

    TPOT = sum of stage steps + (pp - 1) x P2P(batch x hidden x 2 B) + per-step engine overhead
    TTFT = the same for one prefill pass over batch x input_len tokens

Decode reads only the experts the batch routes to: E x (1 - (1 - k/E)^B) per MoE layer. The
embedding is a gather (not read in full); the lm_head is read and multiplied on the last stage.
Everything is a pure function; ``predict_latency`` is cheap enough to call inside a solver loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from toposched.errors import InputError
from toposched.perf.hardware import GpuSpec
from toposched.perf.links import LinkSpec
from toposched.workload.dtypes import activation_bytes, weight_format
from toposched.workload.memory import kv_bytes_per_token_per_layer, padded_vocab
from toposched.workload.parallel import check_degrees, stage_layers
from toposched.workload.spec import ModelSpec


class PerfConfig(BaseModel):
    """Achievable fractions and overheads of the cost model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    eta_mem: float = Field(0.8, gt=0.0, le=1.0)
    """Achievable HBM fraction: AIC ``mem_bw_empirical_scaling_factor: 0.8`` (perf-anchors §0)."""
    eta_flops: float = Field(0.7, gt=0.0, le=1.0)
    """Achievable dense GEMM fraction: 0.7-0.75 BF16, ~0.7 FP8 (perf-anchors §4.1)."""
    kernel_us: float = Field(3.0, ge=0.0)
    """Fixed cost of one small kernel: AIC ``mem_empirical_constant_latency: 3us`` (perf-anchors §0)."""
    kernels_per_layer: int = Field(6, ge=0)
    """Small kernels per layer (norms, RoPE, activation, residual): 5-8 (perf-anchors §3.4)."""
    step_overhead_ms: float = Field(2.6, ge=0.0)
    """Per-pass engine/host overhead (perf-anchors §3.4: "0-5 ms ... calibrate it per engine").
    One global value, fitted by ``benchmarks/estimate_anchors.py --fit`` (weighted least squares
    over all decode anchors of perf-anchors §3.1); see docs/cost-model.md."""


@dataclass(frozen=True)
class StepTime:
    """One pass (prefill or one decode step) over all stages, in milliseconds, by term."""

    memory_ms: float
    compute_ms: float
    comm_ms: float
    small_kernels_ms: float
    p2p_ms: float
    overhead_ms: float

    @property
    def total_ms(self) -> float:
        """Time of the pass: roofline max plus the additive terms."""
        return (
            max(self.memory_ms, self.compute_ms) + self.comm_ms + self.small_kernels_ms + self.p2p_ms + self.overhead_ms
        )

    @property
    def bound(self) -> str:
        """Which roofline term dominates: ``memory`` or ``compute``."""
        return "memory" if self.memory_ms >= self.compute_ms else "compute"


@dataclass(frozen=True)
class LatencyEstimate:
    """Predicted latencies of one batch: TTFT, TPOT, end-to-end time and throughput."""

    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    tokens_per_s: float
    prefill: StepTime
    decode: StepTime


def _touched_experts(num_experts: int, per_token: int, tokens: int) -> float:
    """Expected distinct experts hit when ``tokens`` tokens each pick ``per_token`` of them."""
    return num_experts * (1.0 - (1.0 - per_token / num_experts) ** tokens)


def _pass_time(
    spec: ModelSpec,
    gpu: GpuSpec,
    link: LinkSpec,
    pp_link: LinkSpec,
    cfg: PerfConfig,
    *,
    tp: int,
    pp: int,
    tokens: int,
    seqs: int,
    kv_tokens_read: float,
    attn_flops_per_layer: float,
) -> StepTime:
    """Time of one forward pass over ``tokens`` new tokens belonging to ``seqs`` sequences."""
    wb = weight_format(spec.weight_dtype).bytes_per_param
    ab = activation_bytes(spec.activation_dtype)
    a = spec.attention_params()
    kv_heads = max(1, spec.num_kv_heads // tp) if spec.mla is None else 1
    kv_share = kv_heads / spec.num_kv_heads if spec.num_kv_heads else 0.0
    attn_params = a.q_and_o / tp + a.kv * kv_share + a.replicated
    kv_layer = kv_bytes_per_token_per_layer(spec, tp)
    flops_peak = gpu.gemm_flops(spec.weight_dtype) * cfg.eta_flops
    bw = gpu.hbm_bandwidth * cfg.eta_mem
    ar_bytes = tokens * spec.hidden_size * ab
    mem = cmp = comm = 0.0
    ranges = stage_layers(spec.num_layers, pp)
    for i, layers in enumerate(ranges):
        read = 0.0  # parameters read from HBM on one GPU of this stage
        used = 0.0  # parameters each token multiplies with
        for layer in layers:
            read += attn_params
            used += attn_params
            if spec.moe is not None and spec.is_moe_layer(layer):
                m = spec.moe
                hit = _touched_experts(m.num_experts, m.experts_per_token, tokens)
                shared = spec.shared_expert_params() / tp
                read += (hit * spec.expert_params()) / tp + shared + spec.router_params()
                used += (m.experts_per_token * spec.expert_params()) / tp + shared + spec.router_params()
            else:
                read += spec.dense_mlp_params() / tp
                used += spec.dense_mlp_params() / tp
        head = padded_vocab(spec.vocab_size) * spec.hidden_size / tp if i == pp - 1 else 0.0
        weight_bytes = read * wb + head * ab
        kv_bytes = kv_tokens_read * kv_layer * len(layers)
        mem += (weight_bytes + kv_bytes) / bw
        head_tokens = seqs  # logits only for the last position of each sequence
        cmp += (2 * tokens * used + 2 * head_tokens * head + attn_flops_per_layer * len(layers) / tp) / flops_peak
        comm += 2 * len(layers) * link.allreduce_us(ar_bytes, tp) * 1e-6
    small = spec.num_layers * cfg.kernels_per_layer * cfg.kernel_us * 1e-3
    p2p = (pp - 1) * pp_link.p2p_us(ar_bytes) * 1e-3
    return StepTime(
        memory_ms=mem * 1e3,
        compute_ms=cmp * 1e3,
        comm_ms=comm * 1e3,
        small_kernels_ms=small,
        p2p_ms=p2p,
        overhead_ms=cfg.step_overhead_ms,
    )


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
) -> LatencyEstimate:
    """TTFT, TPOT and throughput of ``batch`` sequences of ``input_len`` in, ``output_len`` out.

    ``link`` joins the GPUs of one TP group; ``pp_link`` joins consecutive pipeline stages
    (defaults to ``link``). TTFT is one prefill pass over all ``batch x input_len`` tokens; TPOT
    is the decode step at the mean context ``input_len + output_len / 2``.
    """
    check_degrees(spec, tp, pp)
    if batch < 1 or input_len < 1 or output_len < 1:
        raise InputError(f"batch, input_len and output_len must be positive, got {batch}, {input_len}, {output_len}")
    cfg = config or PerfConfig()
    between = pp_link or link
    width = spec.attention_width
    # Causal prefill: QK^T and PV over half the square, 2 FLOPs per MAC -> 2 x S^2 x width per seq.
    prefill = _pass_time(
        spec, gpu, link, between, cfg, tp=tp, pp=pp,
        tokens=batch * input_len, seqs=batch, kv_tokens_read=0.0,
        attn_flops_per_layer=2.0 * batch * input_len * input_len * width,
    )  # fmt: skip
    context = input_len + output_len / 2
    decode = _pass_time(
        spec, gpu, link, between, cfg, tp=tp, pp=pp,
        tokens=batch, seqs=batch, kv_tokens_read=batch * context,
        attn_flops_per_layer=4.0 * batch * context * width,
    )  # fmt: skip
    ttft = prefill.total_ms
    tpot = decode.total_ms
    e2e = ttft + (output_len - 1) * tpot
    return LatencyEstimate(
        ttft_ms=ttft,
        tpot_ms=tpot,
        e2e_ms=e2e,
        tokens_per_s=batch * output_len / (e2e / 1e3),
        prefill=prefill,
        decode=decode,
    )
