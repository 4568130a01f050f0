"""Degree options: which (tp, pp, ep) a request can use on a GPU type, and what each costs.

For each candidate degree the HBM estimator says whether it fits; when it does not, the capacity
fallbacks of DESIGN.md are tried in order (FP8 KV, INT8 KV, INT4 KV if the request allows it,
activation checkpointing) and the first that fits is kept, with its name recorded. Latency is
predicted per link kind (the link between TP ranks depends on where the group lands), memoised so a
solver can ask many times per decision.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from toposched.errors import InfeasibleError, InputError
from toposched.perf.hardware import GpuSpec, get_gpu, gpu_registry
from toposched.perf.latency import LatencyEstimate, PassModel, predict_latency, resolve_config
from toposched.perf.links import get_link
from toposched.perf.serving import OperatingPoint, evaluate, operating_point, settle
from toposched.perf.serving_run import CommAdjust
from toposched.solver.request import PlacementRequest
from toposched.solver.split import balanced_partition
from toposched.workload import resolve_model
from toposched.workload.dtypes import KvDtype, kv_element_bytes, parse_kv_dtype, parse_weight_dtype
from toposched.workload.memory import MemoryEstimate, estimate_memory
from toposched.workload.memory_config import MemoryConfig, vllm_batch_defaults
from toposched.workload.parallel import valid_tps
from toposched.workload.spec import ModelSpec

_KV_FALLBACKS: tuple[KvDtype, ...] = ("fp8", "int8", "int4")

RESERVE_SEQS = 8
"""Without ``--concurrent-seqs``, a degree fits when its KV cache holds this many sequences of the
whole ``max_model_len`` (as every plan before operating points did); the running batch is then chosen
per placement (``perf/serving.py``), up to what the KV cache holds at the workload's lengths."""

Prediction = Literal["operating-point", "design-batch"]
"""What a placement's predicted TTFT and TPOT are: ``operating-point`` (plans, the service): one
request's TTFT and the mean TPOT under continuous batching at the chosen running batch
(``perf/serving.py``); ``design-batch`` (the simulator, whose SLO factors were set on it): the prefill
of ``concurrent_seqs`` prompts at once and the decode step at that batch (``predict_latency``)."""


@dataclass(frozen=True)
class DegreeOption:
    """One way to run the model: degrees, the dtype it needs and its per-GPU memory."""

    tp: int
    pp: int
    ep: int
    spec: ModelSpec
    memory: MemoryEstimate
    fallbacks: tuple[str, ...] = ()
    max_batch: int = RESERVE_SEQS
    """The largest running batch: what the KV cache holds at the workload's lengths (memory sized
    for that many sampler rows) and the engine's limit; the request's ``concurrent_seqs`` when given."""
    kv_limited: bool = False
    """Whether ``max_batch`` is the KV cache's limit (else the engine's or the request's)."""

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
    prediction: Prediction = "operating-point"
    _latency: dict[tuple[int, int, str, str], LatencyEstimate] = field(default_factory=dict)
    _points: dict[tuple[object, ...], OperatingPoint] = field(default_factory=dict)

    def operating(
        self,
        option: DegreeOption,
        link: str,
        pp_link: str | None = None,
        *,
        max_batch: int | None = None,
        comm: tuple[str, CommAdjust] | None = None,
    ) -> OperatingPoint:
        """The operating point of ``option`` over these links (``perf/serving.py``): the chosen running
        batch (at most ``max_batch``, default the option's) and the predicted per-request TTFT and TPOT.

        ``comm`` is a name and a function for the all-reduce time a placement pays (compression,
        overlap); the name keys the cache. Under ``design-batch`` the point is ``predict_latency``'s
        design batch (TTFT the prefill of every prompt at once), adjusted by ``comm`` the same way.
        """
        cap = option.max_batch if max_batch is None else max(1, min(max_batch, option.max_batch))
        key = (option.tp, option.pp, option.fallbacks, link, pp_link or link, cap, comm[0] if comm else None)
        point = self._points.get(key)
        if point is None:
            point = self._operating(option, link, pp_link, cap, comm[1] if comm else None)
            self._points[key] = point
        return point

    def pass_model(self, option: DegreeOption, link: str, pp_link: str | None = None) -> PassModel:
        """The cost model of one pass of ``option`` over these links (``perf/latency.py``)."""
        spec, gpu, engine = option.spec, self.gpu, self.request.cost_engine
        return PassModel(
            spec, gpu, tp=option.tp, pp=option.pp, link=get_link(link),
            pp_link=get_link(pp_link) if pp_link else get_link(link), cfg=resolve_config(spec, gpu, None, engine),
            engine=engine,
        )  # fmt: skip

    def _operating(
        self, option: DegreeOption, link: str, pp_link: str | None, cap: int, comm: CommAdjust | None
    ) -> OperatingPoint:
        r = self.request
        model = self.pass_model(option, link, pp_link)
        budget = batched_tokens(option, r.max_model_len, cap)
        isl, tpot_slo, ttft_slo = r.input_len, r.slo_tpot_ms, r.slo_ttft_ms
        osl = max(1, min(r.output_len, r.max_model_len - isl))  # the engine stops a sequence at the context
        if self.prediction == "operating-point" and r.concurrent_seqs is None:
            kv_limited = option.kv_limited and cap == option.max_batch
            return operating_point(
                model, isl=isl, osl=osl, budget=budget, max_batch=cap, kv_limited=kv_limited,
                slo_tpot_ms=tpot_slo, slo_ttft_ms=ttft_slo, comm=comm, role=r.serving_role,
            )  # fmt: skip
        point = evaluate(
            model, cap, isl=isl, osl=osl, budget=budget, slo_tpot_ms=tpot_slo, slo_ttft_ms=ttft_slo, comm=comm,
            role=r.serving_role,
        )  # fmt: skip
        if self.prediction == "operating-point":
            return settle(point, "fixed", ttft_slo, model=model, role=r.serving_role)
        est = self.latency(option, link, pp_link)
        ttft, tpot = est.ttft_ms, est.tpot_ms
        if comm is not None:
            ttft += comm(est.prefill.comm_ms) - est.prefill.comm_ms
            tpot += comm(est.decode.comm_ms) - est.decode.comm_ms
        meets = (tpot_slo is None or tpot <= tpot_slo) and (ttft_slo is None or ttft <= ttft_slo)
        return dataclasses.replace(point, ttft_ms=ttft, tpot_ms=tpot, meets_slo=meets)

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
                batch=self.request.concurrent_seqs or RESERVE_SEQS,
                input_len=self.request.input_len,
                output_len=self.request.output_len,
                engine=self.request.cost_engine,
            )
        return self._latency[key]

    def meets_slo(self, estimate: LatencyEstimate | OperatingPoint) -> bool:
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
    spec: ModelSpec,
    gpu_bytes: int,
    tp: int,
    pp: int,
    ep: int,
    max_len: int,
    seqs: int,
    int4: bool,
    ckpt: bool,
    rows: int | None = None,
) -> MemoryEstimate:
    # the launch passes --max-num-seqs = the running batch (binding/engine_args.py), so vLLM's sampler
    # warm-up and the forward peak are sized for that many rows (``rows``, default ``seqs``), not the
    # 1,024 default; ``seqs`` sequences of ``max_len`` must fit in the KV cache
    cfg = MemoryConfig(allow_int4_kv=int4, max_num_seqs=rows or seqs)
    if ckpt:
        cfg = cfg.model_copy(update={"max_num_batched_tokens": cfg.checkpoint_batched_tokens})
    return estimate_memory(
        spec, gpu_memory_bytes=gpu_bytes, tp=tp, pp=pp, ep=ep, max_model_len=max_len, num_seqs=seqs, config=cfg,
        layer_partition=balanced_partition(spec, pp, tp, ep) if pp > 1 else None,
    )  # fmt: skip


def batched_tokens(option: DegreeOption, max_model_len: int, batch: int) -> int:
    """Tokens of one pass at ``batch`` running sequences: what the memory estimate profiled (8,192, or
    the activation-checkpointing fallback's 2,048), no more than ``batch`` whole contexts, and at least
    ``batch`` (vLLM refuses ``max_num_batched_tokens < max_num_seqs``)."""
    cfg = MemoryConfig()
    budget = (
        cfg.checkpoint_batched_tokens if "activation-checkpointing" in option.fallbacks else cfg.max_num_batched_tokens
    )
    return max(min(budget, max_model_len * batch), batch)


def sequence_tokens(request: PlacementRequest) -> int:
    """The KV a running sequence of the workload holds at its end: its prompt and output, within the context."""
    return min(request.input_len + request.output_len, request.max_model_len)


def engine_batch_limit(gpu: GpuSpec) -> int:
    """The most running sequences a plan gives one instance on ``gpu``: vLLM 0.33's default
    ``max_num_seqs`` for the GPU's memory tier (1,024 on H100/H200-class GPUs, 256 on others)."""
    return vllm_batch_defaults(gpu.usable_memory_bytes, gpu.name)[1]


def _sized(
    request: PlacementRequest,
    gpu: GpuSpec,
    spec: ModelSpec,
    est: MemoryEstimate,
    fallbacks: tuple[str, ...],
    tp: int,
    pp: int,
) -> tuple[MemoryEstimate, int, bool]:
    """(memory, largest running batch, whether the KV cache sets it) of a fitting option.

    With ``concurrent_seqs`` the batch is that. Without it, the batch may grow to what the KV cache holds
    at the workload's lengths (``input_len + output_len`` per sequence, whole blocks) and the engine's
    limit; the memory is then estimated again with that many sampler rows (vLLM's warm-up grows with
    ``max_num_seqs``), which leaves a little less KV: the batch is bounded by the second estimate too.
    """
    if request.concurrent_seqs is not None:
        return est, request.concurrent_seqs, False
    per_seq = sequence_tokens(request)
    cap = engine_batch_limit(gpu)
    top = min(cap, est.concurrent_seqs(per_seq))
    if top <= RESERVE_SEQS:
        return est, max(1, est.concurrent_seqs(per_seq)), True
    args = (gpu.usable_memory_bytes, tp, pp, request.ep, request.max_model_len, RESERVE_SEQS, request.allow_int4_kv)
    wider = _memory(spec, *args, "activation-checkpointing" in fallbacks, top)
    if not wider.fits:  # the larger sampler warm-up leaves too little KV: keep the reserve's rows
        return est, RESERVE_SEQS, True
    held = wider.concurrent_seqs(per_seq)
    return wider, max(1, min(top, held)), held <= cap


def _fit_with_fallbacks(
    request: PlacementRequest, spec: ModelSpec, gpu_bytes: int, tp: int, pp: int, ep: int
) -> tuple[ModelSpec, MemoryEstimate, tuple[str, ...]]:
    seqs = request.concurrent_seqs or RESERVE_SEQS
    args = (gpu_bytes, tp, pp, ep, request.max_model_len, seqs, request.allow_int4_kv)
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


def build_options(
    request: PlacementRequest, gpu: GpuSpec, *, max_tp: int, max_gpus: int, prediction: Prediction = "operating-point"
) -> OptionSet:
    """Every (tp, pp, ep) that fits ``gpu`` for this request, fewest GPUs first."""
    spec = resolve_model(
        request.model,
        weight_dtype=parse_weight_dtype(request.weight_dtype) if request.weight_dtype else None,
        kv_dtype=parse_kv_dtype(request.kv_dtype) if request.kv_dtype else None,
    )
    check_context(request, spec)
    tps = [t for t in valid_tps(spec, limit=max(1, max_tp)) if request.allowed_tp is None or t in request.allowed_tp]
    result = OptionSet(request=request, gpu=gpu, options=[], prediction=prediction)
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
                est, top, kv_limited = _sized(request, gpu, used_spec, est, fallbacks, tp, pp)
                result.options.append(DegreeOption(tp, pp, request.ep, used_spec, est, fallbacks, top, kv_limited))
                if not fallbacks:
                    break  # more stages only cost GPUs once this pp fits as asked
            if pp == request.max_pp or tp * (pp + 1) > max_gpus:
                result.dropped.append(f"tp={tp} pp<={pp}: {'; '.join(est.reasons)}")
    # Degrade only when needed: options that fit as asked come before those that need fallbacks.
    result.options.sort(key=lambda o: (len(o.fallbacks), o.gpus, -o.tp, o.pp))
    return result
