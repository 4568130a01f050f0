"""The cost model's coefficients (``PerfConfig``): achievable fractions and overheads, every field bounded.

``perf/latency.py`` evaluates the model with them; a calibration profile (``perf/profile.py``) holds them
per GPU and weight dtype.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from toposched.perf.hardware import GpuSpec


class PerfConfig(BaseModel):
    """Achievable fractions and overheads of the cost model (every field bounded).

    The defaults are the uncalibrated model (literature values, perf-anchors.md); the shipped
    profile ``data/profiles/default.json`` holds the values fitted on the published anchors.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    eta_mem: float = Field(0.799, ge=0.3, le=1.0)
    """Achievable HBM fraction of a GEMM's weight read (and of the KV read): measured on NVIDIA's GEMM
    tables (aiconfigurator-core 0.12.0: 7,825 GEMMs inside vLLM, SGLang and TensorRT-LLM on A100, H100 and
    H200; ``benchmarks/gemm_tables.py``), as are ``eta_flops``, ``eta_flops_fp8``, ``gemm_n_half``, ``gemm_n_half_fp8``,
    ``gemm_us``, ``gemm_us_fp8`` and ``roofline_p``. AIC's own constant is 0.8 (perf-anchors §0).
    Not fitted on the serving anchors (``fitting.OPERATOR_FIELDS``); a user's ``calibrate`` may move it."""
    eta_flops: float = Field(0.792, ge=0.1, le=1.0)
    """Achievable BF16/FP16 dense GEMM fraction of BF16 peak for a wide GEMM (the GEMM tables; literature
    0.7-0.75, perf-anchors §4.1): a GEMM with ``n`` output columns per GPU reaches
    ``eta_flops x n / (n + gemm_n_half)``."""
    eta_flops_fp8: float = Field(0.680, ge=0.1, le=1.0)
    """Achievable FP8 GEMM fraction of FP8 peak for a wide GEMM, per-tensor scaled, the activation's
    quantisation included (the GEMM tables; block-scaled FP8 reaches about the same, 0.70, where SGLang or
    TensorRT-LLM run it): ``eta_flops_fp8 x n / (n + gemm_n_half_fp8)``."""
    gemm_n_half: float = Field(91.0, ge=0.0, le=100_000.0)
    """Output columns per GPU at which a BF16 GEMM reaches half of ``eta_flops``: the same as charging every
    GEMM ``gemm_n_half`` more columns (issue 34, "efficiency as a function of the GPU shard and TP
    degree": a TP shard is narrower, so its GEMMs run further below peak)."""
    gemm_n_half_fp8: float = Field(1412.0, ge=0.0, le=100_000.0)
    """The same for FP8 GEMMs (the tables: 1,412 columns; a flat FP8 efficiency left 23.0 % error on the
    FP8 rows, over-pricing wide GEMMs and under-pricing narrow ones by 20-30 %; with the curve 17.9 %)."""
    eta_attn: float = Field(0.653, ge=0.1, le=1.0)
    """Attention kernels' (FlashAttention-style fused softmax) FLOP efficiency for long prompts, a fraction
    of BF16 peak: a prefill of ``s`` tokens runs at ``eta_attn x s / (s + attn_s_half)``. Measured on
    NVIDIA's attention tables (aiconfigurator-core 0.12.0: 8,460 context and 8,479 generation attention
    kernels inside vLLM, SGLang and TensorRT-LLM on A100, H100 and H200; ``benchmarks/attention_tables.py``),
    as are the five below. Fitted by nobody on serving runs: few published prompts are long enough to inform
    it (a flat 0.5 had been assumed; FA2/FA3 publish 50-75 %)."""
    attn_s_half: float = Field(1113.0, ge=0.0, le=100_000.0)
    """Prompt length (tokens) at which a prefill's attention reaches half of ``eta_attn``: the same as
    charging every query token ``attn_s_half`` extra keys (the tables: efficiency rises 3-7x from 256 to
    8,192 tokens; one flat efficiency left 43.5 % error on them, this curve 19.8 %)."""
    attn_us: float = Field(14.85, ge=0.0, le=100.0)
    """Fixed cost of one prefill attention kernel (one per layer in a pass with prefill work), in µs."""
    eta_kv: float = Field(0.775, ge=0.3, le=1.0)
    """Achievable HBM fraction of the decode attention kernels' KV-cache read (the tables: 0.775; a GEMM's
    weight read reaches ``eta_mem``)."""
    attn_us_decode: float = Field(11.1, ge=0.0, le=100.0)
    """Fixed cost of one decode attention kernel (one per layer in a pass with decodes), in µs; a pass with
    both prefill and decode work pays the larger of the two (vLLM and SGLang run one kernel over both)."""
    attn_seq_ns: float = Field(17.7, ge=0.0, le=1000.0)
    """Decode attention cost per sequence, KV head on the GPU and layer, in ns (the kernel's work split per
    sequence and head: 29.2 -> 23.0 % error on the generation tables)."""
    gemm_us: float = Field(4.18, ge=0.0, le=100.0)
    """Fixed cost of one BF16 GEMM kernel beyond its roofline time, in µs (launch, the tail wave of a small
    shard): four per layer and the lm_head. Measured on the GEMM tables (4.2 µs); Vidur's linear-layer
    profiles give 5.1 µs with their flat efficiencies (``benchmarks/gemm_profile.py``)."""
    gemm_us_fp8: float = Field(7.33, ge=0.0, le=100.0)
    """The same for an FP8 GEMM (the tables: 7.3 µs; it quantises its activation first)."""
    roofline_p: float = Field(1.92, ge=1.0, le=16.0)
    """Smooth-roofline exponent: 1 adds memory and compute time, large ``p`` takes their max (the GEMM
    tables: 1.9)."""
    moe_tile_m: float = Field(16.0, ge=1.0, le=256.0)
    """Token rows of one grouped-GEMM tile: an expert that gets fewer tokens still costs a tile."""
    moe_layer_us: float = Field(20.0, ge=0.0, le=2000.0)
    """Router, top-k, permute and unpermute kernels of one MoE layer, in µs."""
    mla_layer_us: float = Field(10.0, ge=0.0, le=2000.0)
    """Extra projections, latent norms and the MLA kernel's fixed cost per layer, in µs."""
    kernel_us: float = Field(3.0, ge=0.0, le=100.0)
    """Fixed cost of one small kernel: AIC ``mem_empirical_constant_latency: 3us`` (perf-anchors §0)."""
    kernels_per_layer: int = Field(6, ge=0, le=64)
    """Small kernels per layer (norms, RoPE, activation, residual): 5-8 (perf-anchors §3.4)."""
    prefill_kernel_factor: float = Field(1.0, ge=1.0, le=20.0)
    """Small-kernel cost of a pass with prefill work relative to a decode step, on engines that
    launch a prefill op by op from Python (``HOST_LAUNCHED_PREFILL``): decode steps replay CUDA
    graphs, such prefill passes launch every kernel from the host."""
    step_overhead_ms: float = Field(2.6, ge=0.0, le=100.0)
    """Per decode step engine/host overhead (perf-anchors §3.4: "0-5 ms ... calibrate it per engine")."""
    prefill_overhead_ms: float = Field(2.6, ge=0.0, le=500.0)
    """Per pass with prefill work, inside the engine: no CUDA graph, scheduling."""
    client_overhead_ms: float = Field(0.0, ge=0.0, le=500.0)
    """Once per request, in the TTFT a client measures and the engine's own metrics do not: the HTTP
    request, the prompt's path into the engine and the first token's way back (``Sample.ttft_at``).
    Uncalibrated: 0 (not charged)."""
    comm_scale: float = Field(1.0, ge=0.5, le=1.25)
    """TP all-reduce time inside an engine's forward pass relative to the link table's curve (the best
    of nccl-tests and a CUDA-graph custom all-reduce, run alone); not applied over PCIe-only links.
    Bounded at 1.25 (issue 34): inside a pass the all-reduce shares the SMs and HBM with the kernels
    around it and is not always the faster of the two algorithms, which costs some (a figure near 1);
    unbounded it was fitted at 2.1-2.3 and stood for other terms' errors. With the bound the
    leave-one-publication-out errors did not get worse (TTFT 26.4 vs 26.6 %, TPOT 9.7 vs 10.2 %,
    throughput 14.7 vs 15.5 %; docs/cost-model.md)."""

    def gemm_fixed_us(self, weight_dtype: str, gpu: GpuSpec) -> float:
        """Fixed cost of one GEMM kernel for weights of ``weight_dtype`` on ``gpu``."""
        return self.gemm_us_fp8 if _fp8_gemms(weight_dtype, gpu) else self.gemm_us

    def gemm_eta(self, weight_dtype: str, gpu: GpuSpec) -> float:
        """GEMM efficiency of a wide GEMM for weights of ``weight_dtype`` on ``gpu`` (FP8 only where it
        runs FP8)."""
        return self.eta_flops_fp8 if _fp8_gemms(weight_dtype, gpu) else self.eta_flops

    def gemm_n_half_for(self, weight_dtype: str, gpu: GpuSpec) -> float:
        """The width curve's half point (output columns) for weights of ``weight_dtype`` on ``gpu``."""
        return self.gemm_n_half_fp8 if _fp8_gemms(weight_dtype, gpu) else self.gemm_n_half


def _fp8_gemms(weight_dtype: str, gpu: GpuSpec) -> bool:
    """FP8 weights run FP8 GEMMs where the GPU has them (``GpuSpec.gemm_flops``), else BF16 ones."""
    return weight_dtype == "fp8" and bool(gpu.fp8_flops)
