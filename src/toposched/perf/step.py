"""Step cost: the time of one engine step of one placement, for any mix of prefill chunks and decodes.

``perf/latency.py`` predicts one prefill pass and one decode step at a design batch; a continuous-
batching engine (vLLM V1, SGLang) instead runs steps whose batch changes every time: some sequences
decode one token, others prefill a chunk of their prompt, all in one forward pass. ``StepCost``
evaluates the same ``latency.PassModel`` (the same terms, coefficients and links, with everything
that does not depend on the batch precomputed), so one step costs a few microseconds to predict and
a simulator can call it once per step of every instance. It adds only what a placement decides:
FP8 compression of the all-reduces and compute/communication overlap.

For a step with ``T`` new tokens (decode tokens plus prefill chunk tokens) of ``S`` sequences:

    memory    = weights read(T) / (eta_mem x HBM bandwidth)
    compute   = dense, grouped-expert and lm_head GEMM FLOPs at their efficiencies (latency.py)
    attention = KV read / (eta_kv x HBM bandwidth) + attention FLOPs / (eta_attn x BF16 peak) + fixed costs
    comm      = 2 x layers x all-reduce(T x hidden x 2 B, tp) x comm_scale (not over PCIe)
                (x compression, - overlap when the class allows)
    step      = (memory^p + compute^p)^(1/p) + attention + comm + small kernels + (pp - 1) P2P + overhead

Attention FLOPs per layer: a decode token at context ``c`` costs ``4 c w`` (QK^T and PV, 2 FLOPs per
MAC), a prefill chunk of ``n`` tokens after ``o`` already prefilled costs ``2 w ((o + n)^2 - o^2)``
(the causal square; ``latency.predict_latency`` charges ``2 w S^2`` for a whole prompt), where ``w``
is ``ModelSpec.attention_width`` (MLA: the mean of its QK and V head dims in prefill, its absorbed
width in decode; see latency.py). A chunk also
reads the KV of its ``o`` earlier tokens. A step with prefill work carries the prefill overhead.
"""

from __future__ import annotations

from collections.abc import Sequence

from toposched.perf.coefficients import PerfConfig
from toposched.perf.hardware import GpuSpec
from toposched.perf.latency import PassModel, resolve_config, roofline
from toposched.perf.links import LinkSpec
from toposched.workload.parallel import check_degrees
from toposched.workload.spec import ModelSpec

COMPRESSION_RATIO = 0.5
"""FP8 on the wire halves a BF16 all-reduce (seed 000 section 4); ``solver/place.py`` uses the same."""
COMPRESSION_US_PER_ALLREDUCE = 10.0
"""Quantise + dequantise cost per compressed all-reduce (an assumption, see ``solver/place.py``)."""


class StepCost:
    """Time of one engine step for one placement (degrees, GPU, links, compression and overlap).

    ``engine`` (None: vLLM/SGLang-like) decides whether prefill work pays the host-launch cost
    (``latency.prefill_launched_from_host``)."""

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
        engine: str | None = None,
    ) -> None:
        check_degrees(spec, tp, pp)
        if not 0.0 <= overlap < 1.0:
            raise ValueError(f"overlap must be in [0, 1), got {overlap}")
        self.config = resolve_config(spec, gpu, config, engine)
        self.spec, self.gpu, self.tp, self.pp = spec, gpu, tp, pp
        self.link, self.pp_link = link, pp_link or link
        self.compression, self.overlap = compression, overlap
        self.model = PassModel(
            spec, gpu, tp=tp, pp=pp, link=self.link, pp_link=self.pp_link, cfg=self.config, engine=engine
        )
        self._layers = spec.num_layers
        self._comm_cache: dict[int, float] = {}

    def _comm_and_p2p_ms(self, tokens: int) -> float:
        cached = self._comm_cache.get(tokens)
        if cached is not None:
            return cached
        transfer = self.model.allreduce_ms(tokens)
        comm = transfer
        if self.compression and comm > 0:
            comm = comm * COMPRESSION_RATIO + 2 * self._layers * COMPRESSION_US_PER_ALLREDUCE * 1e-3
        if self.overlap and comm > 0:
            # as solver/place.py assess: the hidden share is taken from the (compressed) transfer time
            comm -= (transfer * COMPRESSION_RATIO if self.compression else transfer) * self.overlap
        value = comm + self.model.p2p_ms(tokens)
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
        t = self.model.step(decode_seqs=decode_seqs, decode_context=decode_context, chunks=chunks)
        if t is None:
            return 0.0
        tokens = decode_seqs + sum(n for _, n in chunks)
        return (
            roofline(t.memory_ms, t.compute_ms, t.roofline_p)
            + t.gemm_fixed_ms
            + t.attention_ms
            + self._comm_and_p2p_ms(tokens)
            + t.small_kernels_ms
            + t.overhead_ms
        )

    def decode_ms(self, seqs: int, mean_context: float) -> float:
        """A step of ``seqs`` decodes at ``mean_context`` tokens each (``predict_latency``'s TPOT)."""
        return self.step_ms(decode_seqs=seqs, decode_context=seqs * mean_context)

    def prefill_ms(self, seqs: int, input_len: int) -> float:
        """One pass prefilling ``seqs`` whole prompts of ``input_len`` (``predict_latency``'s TTFT)."""
        return self.step_ms(chunks=[(0, input_len)] * seqs)


__all__ = ["COMPRESSION_RATIO", "COMPRESSION_US_PER_ALLREDUCE", "StepCost"]
