"""CLI for the workload model and cost model: ``toposched fit`` and ``toposched estimate``.

``fit`` lists the (tp, pp) an instance could use on one GPU type with the per-GPU memory breakdown
and KV capacity; ``estimate`` predicts TTFT, TPOT and throughput for one configuration. Both take
``--json`` (stable keys: see docs/estimator.md).
"""

from __future__ import annotations

from typing import Any

import typer
from rich import box
from rich.table import Table

from toposched.cli._common import console, err_console, print_json
from toposched.errors import InfeasibleError, InputError
from toposched.perf.engine_names import ENGINE_ALIASES, checked_version, cost_engine, engine_of
from toposched.perf.hardware import GpuSpec, get_gpu, variant_note
from toposched.perf.latency import LatencyEstimate, PassModel, StepTime, predict_latency
from toposched.perf.links import get_link
from toposched.perf.profile import active_entry, load_profile, use_profile
from toposched.perf.serving import OperatingPoint, evaluate
from toposched.solver.options import context_limit
from toposched.solver.request import DEFAULT_MAX_MODEL_LEN
from toposched.workload.catalog import resolve_model
from toposched.workload.dtypes import parse_kv_dtype, parse_weight_dtype
from toposched.workload.fallbacks import Fallback, capacity_fallbacks
from toposched.workload.memory import MemoryEstimate, estimate_memory
from toposched.workload.memory_config import ENGINES, GIB, MemoryConfig, sglang_chunked_prefill, vllm_batch_defaults
from toposched.workload.parallel import DEFAULT_PPS, DEFAULT_TPS, check_degrees, ep_problem, tp_problem
from toposched.workload.spec import ModelSpec

MODEL_HELP = "Catalog name (e.g. llama-3.1-70b), Hugging Face id, or a local config.json / model dir."
GPU_HELP = "GPU type, e.g. H100-SXM, H200, A100-SXM-80GB, B200, L40S (case-insensitive)."
MAX_TOKENS = 1 << 30
"""Longest sequence a flag may ask for (the bound on a config's max_position_embeddings)."""
MAX_SEQS = 1 << 20
"""Most concurrent sequences a flag may ask for."""
MAX_GIB = 1 << 16
"""Largest --usable-memory-gib accepted."""
ENGINE_HELP = (
    "Whose KV sizing rule: vllm (0.33 profile run, default), sglang (0.5.23 mem_fraction_static) or trtllm "
    "(TensorRT-LLM: a fraction of the memory free after weights and buffers; its PyTorch backend, as `launch "
    "trtllm` starts it); tensorrt-llm or nim: a built TensorRT engine (trtllm-build, NVIDIA NIM), TensorRT-LLM's "
    "KV rule, its prefill one enqueued engine (no host launch cost per kernel)."
)
SEQS_HELP = "Engine max_num_seqs (sizes vLLM's sampler warm-up). Default: the engine's for this GPU."
TOKENS_HELP = "Engine max_num_batched_tokens (SGLang: chunked_prefill_size). Default: the engine's for this GPU."
UTIL_HELP = "vLLM gpu_memory_utilization (default 0.92)."
MFS_HELP = "SGLang mem_fraction_static (default: SGLang's rule for the GPU and tp)."
KV_FREE_HELP = "TensorRT-LLM kv_cache_free_gpu_memory_fraction (default 0.9)."
USABLE_HELP = "GPU memory the engine sees, GiB (default: the driver-reported total where known, else nominal)."

# The engine settings ``fit`` and ``estimate`` both take (one declaration each, shared).
ENGINE = typer.Option("vllm", "--engine", help=ENGINE_HELP)
MAX_NUM_SEQS = typer.Option(None, "--max-num-seqs", min=1, max=MAX_SEQS, help=SEQS_HELP)
MAX_NUM_BATCHED_TOKENS = typer.Option(None, "--max-num-batched-tokens", min=1, max=MAX_TOKENS, help=TOKENS_HELP)
GPU_MEMORY_UTILIZATION = typer.Option(None, "--gpu-memory-utilization", help=UTIL_HELP)
MEM_FRACTION_STATIC = typer.Option(None, "--mem-fraction-static", help=MFS_HELP)
KV_FREE_FRACTION = typer.Option(None, "--kv-cache-free-gpu-memory-fraction", help=KV_FREE_HELP)
USABLE_MEMORY_GIB = typer.Option(None, "--usable-memory-gib", help=USABLE_HELP)


def _note_variant(gpu: str) -> None:
    note = variant_note(gpu)
    if note is not None:
        err_console.print(note, markup=False)


def _usable_bytes(g: GpuSpec, usable_gib: float | None) -> int:
    if usable_gib is None:
        return g.usable_memory_bytes
    if not 0 < usable_gib <= MAX_GIB:
        raise InfeasibleError(f"--usable-memory-gib must be in (0, {MAX_GIB}], got {usable_gib}")
    return round(usable_gib * GIB)


def _memory_config(
    g: GpuSpec,
    memory_bytes: int,
    *,
    engine: str,
    gpu_memory_utilization: float | None,
    mem_fraction_static: float | None,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    kv_free_fraction: float | None = None,
    allow_int4_kv: bool = False,
) -> MemoryConfig:
    """The engine's memory settings: flags where given, else the engine's defaults for this GPU (a TensorRT
    engine's, ``tensorrt-llm`` or ``nim``, are TensorRT-LLM's)."""
    given = engine.strip().lower()
    if given not in ENGINE_ALIASES:  # the cost model's names; every TensorRT-LLM or NIM one sizes like trtllm
        raise InputError(
            f"unknown engine {engine[:40]!r}", fix="use --engine vllm, sglang, trtllm, tensorrt-llm or nim"
        )
    name = given if given in ENGINES else "trtllm"
    if name != "vllm" and gpu_memory_utilization is not None:
        raise InputError("--gpu-memory-utilization is vLLM's setting", fix=f"leave it out with --engine {given}")
    if name != "sglang" and mem_fraction_static is not None:
        raise InputError("--mem-fraction-static is SGLang's setting", fix="add --engine sglang")
    if name != "trtllm" and kv_free_fraction is not None:
        raise InputError("--kv-cache-free-gpu-memory-fraction is TensorRT-LLM's setting", fix="add --engine trtllm")
    if kv_free_fraction is not None and not 0 < kv_free_fraction <= 1:
        raise InfeasibleError(f"--kv-cache-free-gpu-memory-fraction must be in (0, 1], got {kv_free_fraction}")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise InfeasibleError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
        raise InfeasibleError(f"--mem-fraction-static must be in (0, 1), got {mem_fraction_static}")
    tokens, seqs = vllm_batch_defaults(memory_bytes, g.name)
    if name == "sglang":
        tokens = sglang_chunked_prefill(memory_bytes)
    kw: dict[str, Any] = {
        "engine": name,
        "max_num_seqs": max_num_seqs or seqs,
        "max_num_batched_tokens": max_num_batched_tokens or tokens,
        "mem_fraction_static": mem_fraction_static,
        "allow_int4_kv": allow_int4_kv,
    }
    if gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = gpu_memory_utilization
    if kv_free_fraction is not None:
        kw["kv_cache_free_gpu_memory_fraction"] = kv_free_fraction
    return MemoryConfig(**kw)


def _moe_source(passes: PassModel) -> dict[str, str] | None:
    """Which engine's fused-MoE tables price the experts (an engine version at or past theirs), else None."""
    k = passes.moe_kernels
    return None if k is None else {"table": k.table, "from_version": k.from_version}


def _engine_json(cfg: MemoryConfig, memory_bytes: int) -> dict[str, Any]:
    return {
        "engine": cfg.engine,
        "usable_memory_bytes": memory_bytes,
        "gpu_memory_utilization": cfg.gpu_memory_utilization if cfg.engine == "vllm" else None,
        "mem_fraction_static": cfg.mem_fraction_static,
        "kv_cache_free_gpu_memory_fraction": cfg.kv_cache_free_gpu_memory_fraction if cfg.engine == "trtllm" else None,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
    }


def _load(model: str, weight_dtype: str | None, kv_dtype: str | None) -> ModelSpec:
    return resolve_model(
        model,
        weight_dtype=parse_weight_dtype(weight_dtype) if weight_dtype else None,
        kv_dtype=parse_kv_dtype(kv_dtype) if kv_dtype else None,
    )


def _options(spec: ModelSpec, tp: int | None, pp: int | None, ep: int) -> list[tuple[int, int]]:
    """The (tp, pp) to show: the flags', else every default degree that shards the model and holds ``ep``."""
    if tp is not None:
        check_degrees(spec, tp, pp or 1, ep)
        tps = [tp]
    else:
        shard = [t for t in DEFAULT_TPS if tp_problem(spec, t) is None]
        tps = [t for t in shard if ep_problem(spec, t, ep) is None]
        if not tps:  # no default tp holds this ep: the largest one says why
            check_degrees(spec, shard[-1] if shard else 1, 1, ep)
    pps = [pp] if pp is not None else [p for p in DEFAULT_PPS if p <= spec.num_layers]
    for p in pps:
        check_degrees(spec, tps[0], p, ep)
    return [(t, p) for p in pps for t in tps]


def _fallback_json(f: Fallback) -> dict[str, Any]:
    return {"name": f.name, "saves_bytes": f.saves_bytes, "kv_tokens_capacity": f.kv_tokens_capacity, "fits": f.fits}


def _option_json(e: MemoryEstimate, fallbacks: tuple[Fallback, ...]) -> dict[str, Any]:
    return {
        "tp": e.tp,
        "pp": e.pp,
        "ep": e.ep,
        "gpus": e.gpus,
        "weights_bytes_per_gpu": e.weights_bytes_per_gpu,
        "activation_bytes_per_gpu": e.activation_bytes,
        "workspace_bytes_per_gpu": e.workspace_bytes,
        "non_torch_bytes_per_gpu": e.non_torch_bytes,
        "cudagraph_bytes_per_gpu": e.cudagraph_bytes,
        "kv_budget_bytes_per_gpu": e.kv_budget_bytes,
        "kv_bytes_per_token_per_gpu": e.kv_bytes_per_token_per_gpu,
        "kv_tokens_capacity": e.kv_tokens_capacity,
        "max_concurrent_seqs": e.max_concurrent_seqs,
        "fits": e.fits,
        "reasons": list(e.reasons),
        "fallbacks": [_fallback_json(f) for f in fallbacks],
    }


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _fit_table(
    spec: ModelSpec, gpu: GpuSpec, rows: list[tuple[MemoryEstimate, tuple[Fallback, ...]]], cfg: MemoryConfig
) -> None:
    first = rows[0][0]
    console.print(
        f"{spec.name}: {spec.params_total / 1e9:.2f}B params, weights {spec.weight_dtype}, KV {spec.kv_dtype}, "
        f"{first.kv_bytes_per_token_model:,} B/token KV for the whole model",
        soft_wrap=True,
    )
    setting = {
        "vllm": f"gpu_memory_utilization {cfg.gpu_memory_utilization}",
        "sglang": f"mem_fraction_static {cfg.mem_fraction_static or 'default'}",
        "trtllm": f"kv_cache_free_gpu_memory_fraction {cfg.kv_cache_free_gpu_memory_fraction}",
    }[cfg.engine]
    console.print(
        f"{gpu.name} ({_gib(first.gpu_memory_bytes)} GiB usable), {cfg.engine} sizing, {setting}, "
        f"max_num_seqs {cfg.max_num_seqs}, max_num_batched_tokens {cfg.max_num_batched_tokens}; "
        f"budget {_gib(first.budget_bytes)} GiB per GPU, workspace {_gib(first.workspace_bytes)} GiB, "
        f"max model len {first.max_model_len} (the model's context: {context_limit(spec)}, --max-model-len)",
        soft_wrap=True,
    )
    table = Table("tp", "pp", "weights", "activ.", "KV", "KV B/tok", "KV tokens", "seqs", "fits",
                  box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="GiB per GPU; seqs: sequences of max model len that fit")  # fmt: skip
    for e, _ in rows:
        table.add_row(
            str(e.tp), str(e.pp), _gib(e.weights_bytes_per_gpu), _gib(e.activation_bytes),
            _gib(max(e.kv_budget_bytes, 0)), f"{e.kv_bytes_per_token_per_gpu:,}",
            f"{e.kv_tokens_capacity:,}", str(e.max_concurrent_seqs), "yes" if e.fits else "no",
        )  # fmt: skip
    console.print(table)
    short = next(((e, fb) for e, fb in rows if not e.fits and e.kv_budget_bytes > 0), None)
    if short is not None:
        e, fallbacks = short
        console.print(f"fallbacks for tp={e.tp} pp={e.pp} ({'; '.join(e.reasons)}):", soft_wrap=True)
        for f in fallbacks:
            state = "fits" if f.fits else "still short"
            console.print(
                f"  {f.name}: saves {_gib(f.saves_bytes)} GiB, {f.kv_tokens_capacity:,} KV tokens, {state}",
                soft_wrap=True,
            )


def fit(
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    gpu: str = typer.Option(..., "--gpu", "-g", help=GPU_HELP),
    tp: int | None = typer.Option(None, "--tp", help="Only this tensor-parallel degree (default: 1, 2, 4, 8)."),
    pp: int | None = typer.Option(None, "--pp", help="Only this pipeline-parallel degree (default: 1, 2, 4, 8)."),
    ep: int = typer.Option(
        1, "--ep", help="Expert-parallel degree for MoE models; it must divide tp (degrees it does not are skipped)."
    ),
    weight_dtype: str | None = typer.Option(None, "--weight-dtype", help="bf16, fp16, fp8, int8, int4."),
    kv_dtype: str | None = typer.Option(None, "--kv-dtype", help="auto, fp8, int8, int4."),
    max_model_len: int = typer.Option(
        DEFAULT_MAX_MODEL_LEN,
        "--max-model-len",
        max=MAX_TOKENS,
        help=f"Tokens per sequence (default {DEFAULT_MAX_MODEL_LEN}, as plan, launch and the service; the output "
        "names the model's whole context).",
    ),
    num_seqs: int = typer.Option(1, "--num-seqs", min=1, max=MAX_SEQS, help="Sequences of max length that must fit."),
    engine: str = ENGINE,
    max_num_seqs: int | None = MAX_NUM_SEQS,
    max_num_batched_tokens: int | None = MAX_NUM_BATCHED_TOKENS,
    gpu_memory_utilization: float | None = GPU_MEMORY_UTILIZATION,
    mem_fraction_static: float | None = MEM_FRACTION_STATIC,
    kv_free_fraction: float | None = KV_FREE_FRACTION,
    usable_memory_gib: float | None = USABLE_MEMORY_GIB,
    allow_int4_kv: bool = typer.Option(False, "--allow-int4-kv", help="Offer the INT4 KV fallback."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Which (tp, pp) fit a model on a GPU type: per-GPU memory breakdown and KV capacity."""
    spec = _load(model, weight_dtype, kv_dtype)
    g = get_gpu(gpu)
    _note_variant(gpu)
    if max_model_len < 1:
        raise InfeasibleError(f"--max-model-len must be positive, got {max_model_len}")
    memory_bytes = _usable_bytes(g, usable_memory_gib)
    cfg = _memory_config(g, memory_bytes, engine=engine, gpu_memory_utilization=gpu_memory_utilization,
                         mem_fraction_static=mem_fraction_static, kv_free_fraction=kv_free_fraction,
                         max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, allow_int4_kv=allow_int4_kv)  # fmt: skip
    rows = []
    for t, p in _options(spec, tp, pp, ep):
        kw: dict[str, Any] = dict(gpu_memory_bytes=memory_bytes, tp=t, pp=p, ep=ep,
                                  max_model_len=max_model_len, num_seqs=num_seqs, config=cfg)  # fmt: skip
        rows.append((estimate_memory(spec, **kw), capacity_fallbacks(spec, **kw)))
    if json_out:
        print_json({
            "model": spec.name,
            "gpu": g.name,
            "weight_dtype": spec.weight_dtype,
            "kv_dtype": spec.kv_dtype,
            "params_total": spec.params_total,
            "kv_bytes_per_token_model": rows[0][0].kv_bytes_per_token_model,
            "max_model_len": rows[0][0].max_model_len,
            "model_context": context_limit(spec),
            "gpu_memory_bytes": g.memory_bytes,
            **_engine_json(cfg, memory_bytes),
            "budget_bytes_per_gpu": rows[0][0].budget_bytes,
            "options": [_option_json(e, fb) for e, fb in rows],
        })  # fmt: skip
    else:
        _fit_table(spec, g, rows, cfg)
    if not any(e.fits for e, _ in rows):
        tried = ", ".join(f"tp={e.tp} pp={e.pp}" for e, _ in rows)
        raise InfeasibleError(
            f"{spec.name} ({spec.weight_dtype}, max model len {rows[0][0].max_model_len}) fits on {g.name} "
            f"with none of {tried}",
            fix="try a larger GPU, more GPUs (--pp), --weight-dtype fp8/int4, --kv-dtype fp8 or --max-model-len",
        )


STEP_TERMS = ("gemm_ms", "attention_ms", "comm_ms", "small_kernels_ms", "p2p_ms", "overhead_ms")
"""The terms a pass's ``total_ms`` is the sum of (``gemm_ms``: the smooth roofline of ``memory_ms`` and
``compute_ms``, which are its two parts, not terms of the sum)."""


def _step_json(s: StepTime) -> dict[str, Any]:
    return {
        "memory_ms": s.memory_ms,
        "compute_ms": s.compute_ms,
        "gemm_ms": s.roofline_ms,
        "roofline_p": s.roofline_p,
        "attention_ms": s.attention_ms,
        "comm_ms": s.comm_ms,
        "small_kernels_ms": s.small_kernels_ms,
        "p2p_ms": s.p2p_ms,
        "overhead_ms": s.overhead_ms,
        "total_ms": s.total_ms,
        "terms": list(STEP_TERMS),
        "bound": s.bound,
    }


def _estimate_json(r: LatencyEstimate, point: OperatingPoint, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        **extra,
        "ttft_ms": point.ttft_ms,
        "tpot_ms": point.tpot_ms,
        "e2e_ms": point.ttft_ms + (extra["output_len"] - 1) * point.tpot_ms,
        "tokens_per_s": point.throughput_tokens_per_s,
        "requests_per_s": point.full_rps,
        "batch_prefill_ms": r.ttft_ms,
        "decode_step_ms": r.tpot_ms,
        "prefill": _step_json(r.prefill),
        "decode": _step_json(r.decode),
    }


def estimate(
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    gpu: str = typer.Option(..., "--gpu", "-g", help=GPU_HELP),
    tp: int = typer.Option(..., "--tp", help="Tensor-parallel degree."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel degree."),
    link: str | None = typer.Option(None, "--link", help="Link between TP ranks (default: the GPU's own)."),
    pp_link: str | None = typer.Option(None, "--pp-link", help="Link between pipeline stages (default: --link)."),
    weight_dtype: str | None = typer.Option(None, "--weight-dtype", help="bf16, fp16, fp8, int8, int4."),
    kv_dtype: str | None = typer.Option(None, "--kv-dtype", help="auto, fp8, int8, int4."),
    batch: int = typer.Option(..., "--batch", min=1, max=MAX_SEQS, help="Concurrent sequences."),
    input_len: int = typer.Option(..., "--input-len", min=1, max=MAX_TOKENS, help="Prompt tokens per sequence."),
    output_len: int = typer.Option(..., "--output-len", min=1, max=MAX_TOKENS, help="Generated tokens per sequence."),
    engine: str = ENGINE,
    engine_version: str | None = typer.Option(
        None, "--engine-version", help="The engine's version (e.g. 0.11.0): picks a profile entry fitted on it."
    ),
    max_num_seqs: int | None = MAX_NUM_SEQS,
    max_num_batched_tokens: int | None = MAX_NUM_BATCHED_TOKENS,
    gpu_memory_utilization: float | None = GPU_MEMORY_UTILIZATION,
    mem_fraction_static: float | None = MEM_FRACTION_STATIC,
    kv_free_fraction: float | None = KV_FREE_FRACTION,
    usable_memory_gib: float | None = USABLE_MEMORY_GIB,
    profile: str | None = typer.Option(None, "--profile", help="Calibration profile JSON (toposched calibrate)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """Predicted TTFT, TPOT and throughput of one (tp, pp) instance on a GPU type."""
    spec = _load(model, weight_dtype, kv_dtype)
    g = get_gpu(gpu)
    _note_variant(gpu)
    tp_link = get_link(link or g.native_link)
    between = get_link(pp_link) if pp_link else tp_link
    memory_bytes = _usable_bytes(g, usable_memory_gib)
    cfg = _memory_config(g, memory_bytes, engine=engine, gpu_memory_utilization=gpu_memory_utilization,
                         mem_fraction_static=mem_fraction_static, kv_free_fraction=kv_free_fraction,
                         max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
    version = checked_version(engine_version)
    priced_engine = cost_engine(engine, version)  # the name given: tensorrt-llm is not trtllm's PyTorch backend
    loaded = load_profile(profile) if profile else None
    with use_profile(loaded):
        coefficients, priced = active_entry(g.name, str(spec.weight_dtype), engine=priced_engine,
                                            family=spec.model_type or None)  # fmt: skip
        r = predict_latency(spec, g, tp=tp, pp=pp, link=tp_link, pp_link=between, batch=batch,
                            input_len=input_len, output_len=output_len,
                            max_batched_tokens=cfg.max_num_batched_tokens, config=coefficients,
                            engine=priced_engine)  # fmt: skip
        passes = PassModel(spec, g, tp=tp, pp=pp, link=tp_link, pp_link=between, cfg=coefficients,
                           engine=priced_engine)  # fmt: skip
        point = evaluate(passes, batch, isl=input_len, osl=output_len, budget=cfg.max_num_batched_tokens)
    mem = estimate_memory(spec, gpu_memory_bytes=memory_bytes, tp=tp, pp=pp,
                          max_model_len=input_len + output_len, num_seqs=batch, config=cfg)  # fmt: skip
    context = input_len + output_len // 2
    extra = {
        "model": spec.name, "gpu": g.name, "tp": tp, "pp": pp, "link": tp_link.name,
        "weight_dtype": spec.weight_dtype, "batch": batch, "input_len": input_len, "output_len": output_len,
        "tpot_context_len": context, "profile": loaded.name if loaded is not None else None,
        "cost_engine": engine_of(engine), "engine_version": version, "priced_by": priced.model_dump(),
        "moe_priced_by": _moe_source(passes),
        "client_overhead_ms": coefficients.client_overhead_ms,
        **_engine_json(cfg, memory_bytes), "fits_memory": mem.fits,
        "kv_tokens_capacity": mem.kv_tokens_capacity,
    }  # fmt: skip
    if json_out:
        print_json(_estimate_json(r, point, extra))
        return
    console.print(
        f"{spec.name} ({spec.weight_dtype}) on {tp * pp}x {g.name}, tp={tp} pp={pp}, link {tp_link.name}; "
        f"batch {batch}, {input_len} in / {output_len} out",
        soft_wrap=True,
    )
    first = f"prefill of all {batch} prompts" if r.prefill_passes == 1 else f"prefill pass 1 of {r.prefill_passes}"
    table = Table("ms", first, "decode step", box=box.SIMPLE_HEAD, pad_edge=False)
    for label, attr in (("  HBM reads", "memory_ms"), ("  compute", "compute_ms"),
                        ("GEMMs (roofline of the two)", "roofline_ms"), ("attention", "attention_ms"),
                        ("all-reduce", "comm_ms"), ("small kernels", "small_kernels_ms"), ("pp hand-off", "p2p_ms"),
                        ("engine overhead", "overhead_ms"), ("total", "total_ms")):  # fmt: skip
        table.add_row(label, f"{getattr(r.prefill, attr):.2f}", f"{getattr(r.decode, attr):.2f}")
    console.print(table)
    at = f"{engine_of(engine)}" + (f" {version}" if version else "")
    console.print(f"Priced for {at} by {priced.describe()}.", soft_wrap=True, markup=False)
    moe = _moe_source(passes)
    if moe is not None:
        console.print(
            f"MoE experts priced by {moe['table']}'s fused-MoE tables (measured on {moe['from_version']}; "
            "perf/moe_engines.py), not the profile's moe_tile_m / moe_layer_us.",
            soft_wrap=True,
            markup=False,
        )
    e2e = point.ttft_ms + (output_len - 1) * point.tpot_ms
    console.print(
        f"Serving {batch} requests at once (continuous batching, chunks of {cfg.max_num_batched_tokens} tokens): "
        f"one request's TTFT {point.ttft_ms:.1f} ms (as a client measures it, {coefficients.client_overhead_ms:.1f} ms "
        f"of it the request's HTTP path), TPOT {point.tpot_ms:.2f} ms (the decode step at context "
        f"{context}, {input_len} in + {output_len} out / 2, with arriving prompts riding along); end to end "
        f"{e2e:.1f} ms; {point.throughput_tokens_per_s:.1f} output tokens/s, {point.full_rps:.2f} requests/s",
        soft_wrap=True,
    )
    console.print(
        f"The prefill of all {batch} prompts at once (a static batch's TTFT) takes {r.ttft_ms:.1f} ms; "
        f"a decode step alone {r.tpot_ms:.2f} ms.",
        soft_wrap=True,
    )
    if not mem.fits:
        console.print(f"warning: does not fit in memory as asked: {'; '.join(mem.reasons)}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add this group's commands to ``app``."""
    app.command("fit")(fit)
    app.command("estimate")(estimate)
