"""Degree options: which (tp, pp, ep) a request can use on a GPU type, and what each costs.

For each candidate degree the HBM estimator says whether it fits; when it does not, the capacity
fallbacks of DESIGN.md are tried in order (FP8 KV, INT8 KV, INT4 KV if the request allows it,
activation checkpointing) and the first that fits is kept, with its name recorded. Latency is
predicted per link kind (the link between TP ranks depends on where the group lands), memoised so a
solver can ask many times per decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from toposched.errors import InfeasibleError, InputError
from toposched.perf.hardware import GpuSpec, get_gpu, gpu_registry
from toposched.perf.latency import LatencyEstimate, predict_latency
from toposched.perf.links import get_link
from toposched.solver.request import PlacementRequest
from toposched.solver.split import balanced_partition
from toposched.workload import resolve_model
from toposched.workload.dtypes import KvDtype, kv_element_bytes, parse_kv_dtype, parse_weight_dtype
from toposched.workload.memory import MemoryConfig, MemoryEstimate, estimate_memory
from toposched.workload.parallel import valid_tps
from toposched.workload.spec import ModelSpec

_KV_FALLBACKS: tuple[KvDtype, ...] = ("fp8", "int8", "int4")


@dataclass(frozen=True)
class DegreeOption:
    """One way to run the model: degrees, the dtype it needs and its per-GPU memory."""

    tp: int
    pp: int
    ep: int
    spec: ModelSpec
    memory: MemoryEstimate
    fallbacks: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return tuple(s.layers for s in self.memory.stages)


@dataclass
class OptionSet:
    """All degree options of one request on one GPU type, plus why the others were dropped."""

    request: PlacementRequest
    gpu: GpuSpec
    options: list[DegreeOption]
    dropped: list[str] = field(default_factory=list)
    _latency: dict[tuple[int, int, str, str], LatencyEstimate] = field(default_factory=dict)

    def latency(self, option: DegreeOption, link: str, pp_link: str | None = None) -> LatencyEstimate:
        key = (option.tp, option.pp, link, pp_link or link)
        if key not in self._latency:
            self._latency[key] = predict_latency(
                option.spec,
                self.gpu,
                tp=option.tp,
                pp=option.pp,
                link=get_link(link),
                pp_link=get_link(pp_link) if pp_link else None,
                batch=self.request.concurrent_seqs,
                input_len=self.request.input_len,
                output_len=self.request.output_len,
            )
        return self._latency[key]

    def meets_slo(self, estimate: LatencyEstimate) -> bool:
        r = self.request
        return (r.slo_tpot_ms is None or estimate.tpot_ms <= r.slo_tpot_ms) and (
            r.slo_ttft_ms is None or estimate.ttft_ms <= r.slo_ttft_ms
        )


# NVML/nvidia-smi product names -> GPU table keys, most specific first.
_NAME_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("GB200",), "GB200"),
    (("B200",), "B200"),
    (("H200",), "H200"),
    (("H100", "PCIE"), "H100-PCIe"),
    (("H100",), "H100-SXM"),
    (("A100", "40GB"), "A100-SXM-40GB"),
    (("A100",), "A100-SXM-80GB"),
    (("L40S",), "L40S"),
    (("4090",), "RTX-4090"),
)


def gpu_type_for(model_name: str | None, override: str | None = None) -> GpuSpec:
    """The cost-model GPU for a topology's GPU model string (or the ``--gpu`` override)."""
    if override:
        return get_gpu(override)
    upper = (model_name or "").upper()
    for needles, key in _NAME_HINTS:
        if upper and all(n in upper for n in needles):
            return get_gpu(key)
    raise InputError(
        f"the topology does not say which GPU this is ({model_name or 'model unknown'})",
        fix="pass --gpu, one of " + ", ".join(gpu_registry().names()),
    )


@lru_cache(maxsize=512)
def _memory(
    spec: ModelSpec, gpu_bytes: int, tp: int, pp: int, ep: int, max_len: int, seqs: int, int4: bool, ckpt: bool
) -> MemoryEstimate:
    # the launch passes --max-num-seqs = the request's concurrent sequences (binding/engine_args.py), so
    # vLLM's sampler warm-up and the forward peak are sized for that many rows, not the 1,024 default
    cfg = MemoryConfig(allow_int4_kv=int4, max_num_seqs=seqs)
    if ckpt:
        cfg = cfg.model_copy(update={"max_num_batched_tokens": cfg.checkpoint_batched_tokens})
    return estimate_memory(
        spec, gpu_memory_bytes=gpu_bytes, tp=tp, pp=pp, ep=ep, max_model_len=max_len, num_seqs=seqs, config=cfg,
        layer_partition=balanced_partition(spec, pp, tp, ep) if pp > 1 else None,
    )  # fmt: skip


def _fit_with_fallbacks(
    request: PlacementRequest, spec: ModelSpec, gpu_bytes: int, tp: int, pp: int, ep: int
) -> tuple[ModelSpec, MemoryEstimate, tuple[str, ...]]:
    args = (gpu_bytes, tp, pp, ep, request.max_model_len, request.concurrent_seqs, request.allow_int4_kv)
    est = _memory(spec, *args, False)
    if est.fits:
        return spec, est, ()
    used: list[str] = []
    current = spec
    for kv in _KV_FALLBACKS:
        if kv == "int4" and not request.allow_int4_kv:
            continue
        if request.kv_dtype is not None and request.kv_dtype != "auto":
            break  # the request fixed the KV dtype; do not override it
        candidate = current.with_dtypes(kv_dtype=kv)
        if kv_element_bytes(kv, spec.activation_dtype) >= kv_element_bytes(current.kv_dtype, spec.activation_dtype):
            continue  # saves nothing (e.g. INT8 after FP8: both one byte)
        current = candidate
        used.append(f"{kv}-kv")
        est = _memory(current, *args, False)
        if est.fits:
            return current, est, tuple(used)
    est = _memory(current, *args, True)
    used.append("activation-checkpointing")
    return current, est, tuple(used)


def context_limit(spec: ModelSpec) -> int:
    """The longest context the engines accept for this model: vLLM's derived max model len.

    vLLM (``config/model.py: _get_and_verify_max_len``) takes ``max_position_embeddings`` and
    multiplies it by the RoPE scaling ``factor`` only for rope types other than ``llama3``, ``yarn``,
    ``longrope``, ``su``, ``deepseek_yarn`` and ``deepseek_llama_scaling``, whose
    ``max_position_embeddings`` is already the scaled length; a larger ``--max-model-len`` makes it
    refuse to start (SGLang's ``--context-length`` likewise). Every catalog model uses one of those
    rope types or none (Llama 3.1: llama3, 131072; DeepSeek-V3: yarn, 163840), so the limit is
    ``max_position_embeddings``.
    """
    return spec.max_position_embeddings


def check_context(request: PlacementRequest, spec: ModelSpec) -> None:
    """Refuse a ``max_model_len`` above the model's context, naming the limit."""
    limit = context_limit(spec)
    if request.max_model_len > limit:
        raise InfeasibleError(
            f"max_model_len {request.max_model_len} is longer than the {limit}-token context of {spec.name} "
            "(max_position_embeddings in its config.json); vLLM and SGLang refuse to start with it",
            fix=f"use --max-model-len {limit} or less",
        )


def build_options(request: PlacementRequest, gpu: GpuSpec, *, max_tp: int, max_gpus: int) -> OptionSet:
    """Every (tp, pp, ep) that fits ``gpu`` for this request, fewest GPUs first."""
    spec = resolve_model(
        request.model,
        weight_dtype=parse_weight_dtype(request.weight_dtype) if request.weight_dtype else None,
        kv_dtype=parse_kv_dtype(request.kv_dtype) if request.kv_dtype else None,
    )
    check_context(request, spec)
    tps = [t for t in valid_tps(spec, limit=max(1, max_tp)) if request.allowed_tp is None or t in request.allowed_tp]
    result = OptionSet(request=request, gpu=gpu, options=[])
    if request.allowed_tp is not None:
        result.dropped.extend(
            f"tp={t} does not shard {spec.name} or exceeds the largest group ({max_tp} GPUs)"
            for t in request.allowed_tp
            if t not in tps
        )
    for tp in tps:
        if request.ep > 1 and tp % request.ep:
            result.dropped.append(f"tp={tp}: ep={request.ep} must divide tp")
            continue
        for pp in range(1, request.max_pp + 1):
            if tp * pp > max_gpus or pp > spec.num_layers:
                break
            # the engines size against what the driver reports (79.19 GiB on an H100 80GB), not the nominal
            usable = gpu.usable_memory_bytes
            used_spec, est, fallbacks = _fit_with_fallbacks(request, spec, usable, tp, pp, request.ep)
            if est.fits:
                result.options.append(DegreeOption(tp, pp, request.ep, used_spec, est, fallbacks))
                if not fallbacks:
                    break  # more stages only cost GPUs once this pp fits as asked
            if pp == request.max_pp or tp * (pp + 1) > max_gpus:
                result.dropped.append(f"tp={tp} pp<={pp}: {'; '.join(est.reasons)}")
    # Degrade only when needed: options that fit as asked come before those that need fallbacks.
    result.options.sort(key=lambda o: (len(o.fallbacks), o.gpus, -o.tp, o.pp))
    return result
