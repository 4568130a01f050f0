"""Step cost: the time of one engine step of one placement, for any mix of prefill chunks and decodes.

``perf/latency.py`` predicts one prefill pass and one decode step at a design batch; a continuous-
batching engine (vLLM V1, SGLang) instead runs steps whose batch changes every time: some sequences
decode one token, others prefill a chunk of their prompt, all in one forward pass. ``StepCost`` is
the same model as ``latency._pass_time`` (the same terms, constants and links), with everything that
does not depend on the batch precomputed, so one step costs a few microseconds to predict and a
simulator can call it once per step of every instance.

For a step with ``T`` new tokens (decode tokens plus prefill chunk tokens) of ``S`` sequences:

    memory  = (weights read(T) + KV read) / (eta_mem x HBM bandwidth)
    compute = (2 T x params used per token + 2 S x lm_head + attention FLOPs / tp) / (eta_flops x peak)
    comm    = 2 x layers x all-reduce(T x hidden x 2 B, tp)   (x compression, - overlap when the class allows)
    step    = max(memory, compute) + comm + small kernels + (pp - 1) P2P(T x hidden x 2 B) + overhead

Attention FLOPs per layer: a decode token at context ``c`` costs ``4 c w`` (QK^T and PV, 2 FLOPs per
MAC), a prefill chunk of ``n`` tokens after ``o`` already prefilled costs ``2 w ((o + n)^2 - o^2)``
(the causal square; ``latency.predict_latency`` charges ``2 w S^2`` for a whole prompt), where ``w``
is ``ModelSpec.attention_width``. A chunk also reads the KV of its ``o`` earlier tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from toposched.perf.hardware import GpuSpec
from toposched.perf.latency import PerfConfig
from toposched.perf.links import LinkSpec
from toposched.workload.dtypes import activation_bytes, weight_format
from toposched.workload.memory import kv_bytes_per_token_per_layer, padded_vocab
from toposched.workload.parallel import check_degrees, stage_layers
from toposched.workload.spec import ModelSpec

COMPRESSION_RATIO = 0.5
"""FP8 on the wire halves a BF16 all-reduce (seed 000 section 4); ``solver/place.py`` uses the same."""
COMPRESSION_US_PER_ALLREDUCE = 10.0
"""Quantise + dequantise cost per compressed all-reduce (an assumption, see ``solver/place.py``)."""


class StepCost:
    """Time of one engine step for one placement (degrees, GPU, links, compression and overlap)."""

    def __init__(
        self,
        spec: ModelSpec,
        gpu: GpuSpec,
        *,
        tp: int,
        pp: int = 1,
        link: LinkSpec,
        pp_link: LinkSpec | None = None,
        config: PerfConfig | None = None,
        compression: bool = False,
        overlap: float = 0.0,
    ) -> None:
        check_degrees(spec, tp, pp)
        if not 0.0 <= overlap < 1.0:
            raise ValueError(f"overlap must be in [0, 1), got {overlap}")
        cfg = config or PerfConfig()
        self.spec, self.gpu, self.tp, self.pp = spec, gpu, tp, pp
        self.link, self.pp_link = link, pp_link or link
        self.compression, self.overlap = compression, overlap
        wb = weight_format(spec.weight_dtype).bytes_per_param
        ab = activation_bytes(spec.activation_dtype)
        a = spec.attention_params()
        kv_heads = max(1, spec.num_kv_heads // tp) if spec.mla is None else 1
        kv_share = kv_heads / spec.num_kv_heads if spec.num_kv_heads else 0.0
        attn = a.q_and_o / tp + a.kv * kv_share + a.replicated
        fixed_read = used = 0.0  # parameters read from HBM whatever the batch / multiplied by each token
        moe_layers = 0
        for layers in stage_layers(spec.num_layers, pp):
            for layer in layers:
                fixed_read += attn
                used += attn
                if spec.moe is not None and spec.is_moe_layer(layer):
                    moe_layers += 1
                    shared = spec.shared_expert_params() / tp
                    fixed_read += shared + spec.router_params()
                    used += spec.moe.experts_per_token * spec.expert_params() / tp + shared + spec.router_params()
                else:
                    fixed_read += spec.dense_mlp_params() / tp
                    used += spec.dense_mlp_params() / tp
        self._head = padded_vocab(spec.vocab_size) * spec.hidden_size / tp  # on the last stage only
        bw = gpu.hbm_bandwidth * cfg.eta_mem
        self._flops = gpu.gemm_flops(spec.weight_dtype) * cfg.eta_flops
        # memory seconds = _mem_fixed + _mem_per_expert x experts touched + _mem_per_kv x KV tokens read
        self._mem_fixed = (fixed_read * wb + self._head * ab) / bw
        self._mem_per_expert = moe_layers * spec.expert_params() / tp * wb / bw
        self._mem_per_kv = kv_bytes_per_token_per_layer(spec, tp) * spec.num_layers / bw
        self._used = used
        self._moe = spec.moe
        self._ar_bytes_per_token = spec.hidden_size * ab
        self._width = spec.attention_width
        self._layers = spec.num_layers
        self._small_ms = spec.num_layers * cfg.kernels_per_layer * cfg.kernel_us * 1e-3
        self._overhead_ms = cfg.step_overhead_ms
        self._comm_cache: dict[int, float] = {}

    def _touched(self, tokens: int) -> float:
        m = self._moe
        if m is None:
            return 0.0
        return m.num_experts * (1.0 - (1.0 - m.experts_per_token / m.num_experts) ** tokens)

    def _comm_and_p2p_ms(self, tokens: int) -> float:
        cached = self._comm_cache.get(tokens)
        if cached is not None:
            return cached
        nbytes = tokens * self._ar_bytes_per_token
        comm = 2 * self._layers * self.link.allreduce_us(nbytes, self.tp) * 1e-3
        if self.compression and comm > 0:
            comm = comm * COMPRESSION_RATIO + 2 * self._layers * COMPRESSION_US_PER_ALLREDUCE * 1e-3
        if self.overlap and comm > 0:
            # as solver/place.py assess: the hidden share is taken from the (compressed) transfer time
            transfer = 2 * self._layers * self.link.allreduce_us(nbytes, self.tp) * 1e-3
            comm -= (transfer * COMPRESSION_RATIO if self.compression else transfer) * self.overlap
        p2p = (self.pp - 1) * self.pp_link.p2p_us(nbytes) * 1e-3
        value = comm + p2p
        if len(self._comm_cache) < 65536:
            self._comm_cache[tokens] = value
        return value

    def step_ms(
        self, *, decode_seqs: int = 0, decode_context: float = 0.0, chunks: Sequence[tuple[int, int]] = ()
    ) -> float:
        """Milliseconds of one step.

        ``decode_seqs`` sequences decode one token each, holding ``decode_context`` tokens of KV in
        total (the sum over those sequences); ``chunks`` are ``(tokens already prefilled, chunk
        tokens)`` of each sequence prefilling in this step. A step with no work takes 0.
        """
        tokens = decode_seqs
        kv_read = decode_context
        attn = 4.0 * decode_context
        for done, n in chunks:
            tokens += n
            kv_read += done  # the chunk's attention reads its earlier tokens' KV once
            attn += 2.0 * ((done + n) * (done + n) - done * done)
        if tokens <= 0:
            return 0.0
        seqs = decode_seqs + len(chunks)
        mem = self._mem_fixed + self._mem_per_expert * self._touched(tokens) + self._mem_per_kv * kv_read
        cmp = (2.0 * tokens * self._used + 2.0 * seqs * self._head + attn * self._width * self._layers / self.tp) / (
            self._flops
        )
        return max(mem, cmp) * 1e3 + self._comm_and_p2p_ms(tokens) + self._small_ms + self._overhead_ms

    def decode_ms(self, seqs: int, mean_context: float) -> float:
        """A step of ``seqs`` decodes at ``mean_context`` tokens each (``predict_latency``'s TPOT)."""
        return self.step_ms(decode_seqs=seqs, decode_context=seqs * mean_context)

    def prefill_ms(self, seqs: int, input_len: int) -> float:
        """One pass prefilling ``seqs`` whole prompts of ``input_len`` (``predict_latency``'s TTFT)."""
        return self.step_ms(chunks=[(0, input_len)] * seqs)


__all__ = ["COMPRESSION_RATIO", "COMPRESSION_US_PER_ALLREDUCE", "StepCost"]
