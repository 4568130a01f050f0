"""What vLLM, SGLang and TensorRT-LLM are told to serve a placement as planned: the model, the degrees,
the memory plan.

Only flags that exist in the pinned engines are emitted (vLLM 0.33.0, SGLang 0.5.23, ``trtllm-serve``
at the commit named in tests/data/reference/data/trtllm-serve-options.json): ``FLAG_SOURCES`` says
where each is defined (tests/data/reference/engines.md, the options file or the engine's own source
file), a unit test fails on any other flag, and ``make check-engines`` runs every vLLM and SGLang argv
through the engines' own parsers (TensorRT-LLM cannot be installed here: its options are checked
against the options file, values included).

* **Model** (``served_model``, ``model_ref.py``): exactly what the request named: a Hugging Face id as given, a local
  model folder (or the folder of a ``config.json``), or for a catalog name the Hugging Face id the
  catalog gives that name; ``--model-path`` overrides it.
* **Settings** (``serve_settings``): every engine setting the plan's memory and latency figures rely
  on, mapped to each engine's own flag:

  ================  ==============================  ===========================  ==============================
  plan              vLLM 0.33.0                     SGLang 0.5.23                TensorRT-LLM (trtllm-serve)
  ================  ==============================  ===========================  ==============================
  tp / pp           --tensor/--pipeline-parallel-   --tp-size / --pp-size        --tp_size / --pp_size
                    size
  ep > 1            --enable-expert-parallel        --ep-size                    --ep_size
                    (EP = TP)
  hot-expert        --enable-eplb --eplb-config     --ep-num-redundant-experts   (refused)
  copies            {"num_redundant_experts": R}    R --enable-eplb
  max model len     --max-model-len                 --context-length             --max_seq_len
  memory budget     --gpu-memory-utilization 0.92   --mem-fraction-static        --kv_cache_free_gpu_memory_
                    (of the total)                  (weights + KV)               fraction (of the free memory)
  sequences         --max-num-seqs                  --max-running-requests       --max_batch_size
  profiled tokens   --max-num-batched-tokens        --chunked-prefill-size       --max_num_tokens,
                                                                                 --enable_chunked_prefill
  weight dtype      --quantization fp8 (FP8         --quantization fp8,          options YAML ``dtype``
                    checkpoint) or fp8_per_tensor   --dtype
                    (16-bit one), --dtype
  KV dtype          --kv-cache-dtype                --kv-cache-dtype             options YAML ``kv_cache_config``
  ================  ==============================  ===========================  ==============================

  A plan an engine cannot run as planned is refused with one line: ``ep`` other than 1 or ``tp`` on
  vLLM, INT8/INT4 weights from a 16-bit checkpoint (and, on TensorRT-LLM, FP8 from one: it loads
  pre-quantized checkpoints only), redundant experts for a model the engine has none for, an INT8/INT4
  KV cache on SGLang or TensorRT-LLM, a context longer than the model's.
* **Drain on SIGTERM** (``DRAIN_S``): vLLM gets ``--shutdown-timeout 30`` (its default, 0, aborts every
  in-flight request when the pod is deleted or scaled down); Kubernetes pods get
  ``terminationGracePeriodSeconds`` 45 (``POD_GRACE_S``), which also bounds SGLang's own drain.
* **TensorRT-LLM options YAML** (``trtllm_options``): what ``trtllm-serve`` has no flag for goes into
  the LLM-API options file its ``--config`` names (fields of ``tensorrt_llm/llmapi/llm_args.py``,
  ``TRTLLM_YAML_KEYS``): the KV dtype, a 16-bit dtype override, CUDA graphs up to the planned batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from toposched.binding.mooncake import HICACHE_FLAG_SOURCES
from toposched.binding.node_launch import Engine
from toposched.errors import InputError
from toposched.solver.options import RESERVE_SEQS, check_context
from toposched.solver.request import Placement, PlacementRequest
from toposched.workload import MemoryConfig, ModelSpec
from toposched.workload.dtypes import WeightDtype, parse_weight_dtype, weight_format
from toposched.workload.memory import non_torch_memory
from toposched.workload.memory_config import TRTLLM_FREE_FRACTION, trtllm_fraction_for, trtllm_free_bytes

# Where each flag is defined: "engines.md" (tests/data/reference/engines.md, sections 1.1 and 2 and the
# verbatim LWS examples) or the file of the engine's wheel that declares it.
_TRTLLM = "trtllm-serve-options.json"
FLAG_SOURCES: dict[Engine, dict[str, str]] = {
    "vllm": {
        "--tensor-parallel-size": "engines.md 1.1",
        "--pipeline-parallel-size": "engines.md 1.1",
        "--enable-expert-parallel": "engines.md 1.1",
        "--nnodes": "engines.md 1.1",
        "--node-rank": "engines.md 1.1",
        "--master-addr": "engines.md 1.1",
        "--master-port": "engines.md 1.1",
        "--headless": "engines.md 1.1",
        "--numa-bind": "engines.md 1.1",
        "--numa-bind-nodes": "engines.md 1.1",
        "--gpu-memory-utilization": "engines.md 1.1",
        "--max-model-len": "engines.md 1.1",
        "--kv-cache-dtype": "engines.md 1.1",
        "--quantization": "engines.md 1.1",
        "--distributed-executor-backend": "engines.md 1.1",
        "--host": "engines.md 4 (LWS example)",
        "--port": "engines.md 4 (LWS example)",
        "--dtype": "vllm/engine/arg_utils.py: model_group --dtype (ModelConfig.dtype)",
        "--max-num-seqs": "vllm/engine/arg_utils.py: --max-num-seqs (SchedulerConfig.max_num_seqs)",
        "--max-num-batched-tokens": "vllm/engine/arg_utils.py: --max-num-batched-tokens (SchedulerConfig)",
        "--shutdown-timeout": "vllm/engine/arg_utils.py: --shutdown-timeout (VllmConfig.shutdown_timeout: 0 aborts "
        "in-flight requests on SIGTERM, N > 0 waits up to N s; entrypoints/launchers/launcher.py)",
        "--enable-eplb": "vllm/engine/arg_utils.py: parallel_group --enable-eplb (ParallelConfig.enable_eplb)",
        "--eplb-config": "vllm/engine/arg_utils.py: --eplb-config, JSON of vllm/config/parallel.py EPLBConfig",
        "--kv-transfer-config": "vllm/engine/arg_utils.py: --kv-transfer-config, JSON of vllm/config/kv_transfer.py "
        "KVTransferConfig (prefill/decode disaggregation)",
    },
    "sglang": {
        "--model-path": "engines.md 2 (LWS example)",
        "--tp-size": "engines.md 2",
        "--pp-size": "engines.md 2",
        "--ep-size": "engines.md 2",
        "--nnodes": "engines.md 2",
        "--node-rank": "engines.md 2",
        "--dist-init-addr": "engines.md 2",
        "--kv-cache-dtype": "engines.md 2",
        "--mem-fraction-static": "engines.md 2",
        "--host": "engines.md 2 (LWS example)",
        "--port": "engines.md 2 (LWS example)",
        "--context-length": "sglang/srt/arg_groups/fields/model.py: context_length",
        "--quantization": "sglang/srt/arg_groups/fields/model.py: quantization (choices.py: fp8 online)",
        "--dtype": "sglang/srt/arg_groups/fields/model.py: dtype",
        "--max-running-requests": "sglang/srt/arg_groups/fields/schedule.py: max_running_requests",
        "--chunked-prefill-size": "sglang/srt/arg_groups/fields/schedule.py: chunked_prefill_size",
        "--ep-num-redundant-experts": "sglang/srt/arg_groups/fields/exec_.py: ep_num_redundant_experts",
        "--enable-eplb": "sglang/srt/arg_groups/fields/exec_.py: enable_eplb",
        "--disaggregation-mode": "sglang/srt/arg_groups/fields/disagg.py: disaggregation_mode (null|prefill|decode)",
        "--disaggregation-transfer-backend": "sglang/srt/arg_groups/fields/disagg.py: disaggregation_transfer_backend",
        "--disaggregation-bootstrap-port": "sglang/srt/arg_groups/fields/disagg.py: disaggregation_bootstrap_port",
        "--disaggregation-ib-device": "sglang/srt/arg_groups/fields/disagg.py: disaggregation_ib_device (a device, "
        "a comma list or a per-GPU JSON mapping; validation_hook.py validate_ib_devices)",
        **HICACHE_FLAG_SOURCES,
    },
    "trtllm": {
        flag: _TRTLLM
        for flag in (
            "--backend",
            "--tp_size",
            "--pp_size",
            "--ep_size",
            "--max_seq_len",
            "--max_batch_size",
            "--max_num_tokens",
            "--kv_cache_free_gpu_memory_fraction",
            "--enable_chunked_prefill",
            "--config",
            "--gpus_per_node",
            "--host",
            "--port",
        )
    },
}
ROUTER_FLAG_SOURCES: dict[str, str] = {
    flag: "sglang-router 0.3.2 sglang_router/router_args.py: RouterArgs.add_cli_args"
    for flag in ("--pd-disaggregation", "--prefill", "--decode", "--host", "--port")
}
"""Flags of ``python3 -m sglang_router.launch_router`` that toposched emits (the PD router)."""
ROUTER_FLAGS = frozenset(ROUTER_FLAG_SOURCES)
VLLM_FLAGS = frozenset(FLAG_SOURCES["vllm"])
SGLANG_FLAGS = frozenset(FLAG_SOURCES["sglang"])
TRTLLM_FLAGS = frozenset(FLAG_SOURCES["trtllm"])

TRTLLM_YAML_KEYS: dict[str, str] = {
    "kv_cache_config": "llm_args.py KvCacheConfig: free_gpu_memory_fraction, dtype",
    "dtype": "llm_args.py BaseLlmArgs.dtype: auto | float16 | bfloat16",
    "cuda_graph_config": "llm_args.py CudaGraphConfig: max_batch_size, enable_padding",
}
"""Top-level keys of the LLM-API options YAML (``--config``) toposched writes, and their fields. The
options file lists CLI options only; these are the LLM API's own field names, not checked here."""
ENGINE_NAMES: dict[Engine, str] = {"vllm": "vLLM 0.33.0", "sglang": "SGLang 0.5.23", "trtllm": "TensorRT-LLM"}

# KV dtypes toposched plans with -> engine values (vLLM CacheDType; SGLang fields/model.py choices).
DRAIN_S = 30
"""Seconds a serving process finishes its in-flight requests after SIGTERM (a scale-down, a move, a pod
deleted) before it aborts the rest: vLLM's ``--shutdown-timeout`` (0, its default, aborts at once). SGLang
has no flag: it drains until its requests are done, so the pod's grace bounds it (``POD_GRACE_S``). The
simulator's ``drain_grace_s`` defaults to this value."""
POD_GRACE_S = DRAIN_S + 15
"""A pod's ``terminationGracePeriodSeconds``: the drain plus time for the engine to stop its workers
after aborting (Kubernetes kills the pod then; its default is 30 s)."""

_VLLM_KV = {"auto": "auto", "fp8": "fp8", "int8": "int8_per_token_head", "int4": "int4_per_token_head"}
_SGLANG_KV = {"auto": "auto", "fp8": "fp8_e4m3"}
_TORCH_DTYPE: dict[str, Literal["bfloat16", "float16"]] = {"bf16": "bfloat16", "fp16": "float16"}

# Models whose engine implementation takes redundant experts. vLLM: the model classes that implement
# ``MixtureOfExperts`` (model_executor/models/mixtral.py, qwen3_moe.py, deepseek_v2.py, which also holds
# DeepSeek-V3); SGLang: the models that add ``ep_num_redundant_experts`` to their expert count
# (srt/models/qwen2_moe.py, qwen3_moe.py, deepseek_v2.py; mixtral.py does not). Keyed by config.json
# ``model_type``.
REDUNDANT_EXPERT_MODELS: dict[Engine, frozenset[str]] = {
    "vllm": frozenset({"mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3"}),
    "sglang": frozenset({"qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"}),
    # TensorRT-LLM's expert load balancer is configured in the LLM API (not a trtllm-serve option) and
    # is not in the reference list: toposched does not emit it, so no model takes redundant experts.
    "trtllm": frozenset(),
}


@dataclass(frozen=True)
class ServeSettings:
    """What an engine must be told to run one placement as planned: every setting the plan relies on."""

    placement: str
    model: str
    """What the engine loads (``served_model`` or ``--model-path``)."""
    model_type: str | None
    """config.json ``model_type`` of the checkpoint, when the launch can read it."""
    tp: int
    pp: int
    ep: int
    max_model_len: int
    max_num_seqs: int
    """The request's concurrent sequences: the batch the latency was predicted for and the KV was sized for."""
    max_num_batched_tokens: int
    """Tokens of the profiling pass the activation peak was sized for (vLLM; SGLang's prefill chunk)."""
    gpu_memory_utilization: float
    mem_fraction_static: float | None
    """SGLang: (weights + KV) / GPU memory as planned; None when the plan records no memory."""
    kv_free_fraction: float
    """TensorRT-LLM: the share of the memory free after weights, activations and buffers that makes its KV
    pool the plan's KV bytes (``workload/memory.py``); its default when the plan records no memory."""
    dtype: Literal["bfloat16", "float16"] | None
    quantization: Literal["fp8"] | None
    kv_dtype: str
    redundant_experts: int
    quantize_online: bool = False
    """FP8 weights quantized while loading a 16-bit checkpoint (vLLM 0.33 names that method
    ``fp8_per_tensor``; its ``fp8`` reads pre-quantized FP8 checkpoints only, fp8.py: "The `fp8`
    quantization method no longer supports online quantization")."""


def _weights(
    p: Placement, request: PlacementRequest, checkpoint: ModelSpec | None
) -> tuple[Literal["bfloat16", "float16"] | None, Literal["fp8"] | None]:
    """(``--dtype``, ``--quantization``) that make the engine hold the weights the plan sized.

    Nothing when the checkpoint already is what was planned (the engines read ``quantization_config``
    and ``torch_dtype`` themselves) or is smaller than planned (a quantized checkpoint, planned as 16-bit).
    FP8 from a 16-bit checkpoint is quantized while loading (SGLang ``--quantization fp8``, vLLM 0.33
    ``--quantization fp8_per_tensor``: ``ServeSettings.quantize_online``); no
    engine quantizes to INT8/INT4 while loading, so such a plan needs a pre-quantized checkpoint.
    """
    planned: WeightDtype | None = parse_weight_dtype(request.weight_dtype) if request.weight_dtype else None
    if checkpoint is None:  # only --model-path knows the model: pass what the request asked
        return (_TORCH_DTYPE.get(planned) if planned else None), ("fp8" if planned == "fp8" else None)
    have = checkpoint.weight_dtype
    if planned is None or planned == have:
        return None, None
    if planned in _TORCH_DTYPE and have in _TORCH_DTYPE:
        return _TORCH_DTYPE[planned], None
    if planned == "fp8" and have in _TORCH_DTYPE:
        return None, "fp8"
    if weight_format(planned).bytes_per_param >= weight_format(have).bytes_per_param:
        return None, None
    raise InputError(
        f"placement {p.id} plans {planned} weights, but {checkpoint.name} is a {have} checkpoint and neither "
        f"vLLM nor SGLang quantizes to {planned} while loading",
        fix="plan with --weight-dtype fp8 (quantized while loading), or with a pre-quantized checkpoint as --model",
    )


def _kv_dtype(p: Placement, dtype: str | None, checkpoint: ModelSpec | None) -> str:
    """The plan's KV dtype; a 16-bit one must be the engine's activation dtype (engines.md 1.1)."""
    if p.kv_dtype not in ("bf16", "fp16"):
        return p.kv_dtype
    act = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype or "") or (
        checkpoint.activation_dtype if checkpoint else None
    )
    if act is not None and act != p.kv_dtype:
        raise InputError(
            f"placement {p.id} plans a {p.kv_dtype} KV cache, but the engine computes in {act}: an explicit "
            "16-bit KV dtype must match the model's dtype",
            fix="plan with --kv-dtype auto",
        )
    return "auto"


def serve_settings(p: Placement, request: PlacementRequest, model: str, checkpoint: ModelSpec | None) -> ServeSettings:
    """The engine settings of one placement, from the plan (see the module docstring's table)."""
    if checkpoint is not None:
        check_context(request, checkpoint)
    # The operating point the plan chose (solver/place.py); a plan made before operating points runs the
    # request's concurrent sequences, else the 8 every plan reserved then.
    seqs = p.max_num_seqs or request.concurrent_seqs or RESERVE_SEQS
    cfg = MemoryConfig(max_num_seqs=seqs)  # as the solver sized it (solver/options.py)
    dtype, quantization = _weights(p, request, checkpoint)
    online = quantization == "fp8" and checkpoint is not None and checkpoint.weight_dtype in _TORCH_DTYPE
    # The activation peak was sized for this many tokens (workload/memory.py estimate_memory; the
    # activation-checkpointing fallback lowers it); vLLM needs it at least max_num_seqs.
    batched = p.max_num_batched_tokens
    if batched is None:
        ckpt = "activation-checkpointing" in p.fallbacks
        batched = cfg.checkpoint_batched_tokens if ckpt else cfg.max_num_batched_tokens
        batched = max(min(batched, request.max_model_len * seqs), seqs)
    hbm = p.hbm_per_gpu
    # The plan's per-GPU total is the whole budget (KV takes what is left), i.e. memory x utilization.
    static = (
        math.floor((hbm.weights + hbm.kv) / hbm.total * cfg.gpu_memory_utilization * 1000) / 1000
        if hbm.total > 0 and hbm.weights + hbm.kv > 0
        else None
    )
    free = trtllm_free_bytes(
        round(hbm.total / cfg.gpu_memory_utilization), hbm.weights, hbm.activations, non_torch_memory(p.tp, p.pp, cfg)
    )
    return ServeSettings(
        placement=p.id,
        model=model,
        model_type=checkpoint.model_type if checkpoint is not None else None,
        tp=p.tp,
        pp=p.pp,
        ep=p.ep,
        max_model_len=request.max_model_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=batched,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        mem_fraction_static=static,
        kv_free_fraction=trtllm_fraction_for(hbm.kv, free) if hbm.kv > 0 and free > 0 else TRTLLM_FREE_FRACTION,
        dtype=dtype,
        quantization=quantization,
        quantize_online=online,
        kv_dtype=_kv_dtype(p, dtype, checkpoint),
        redundant_experts=p.experts.redundant_experts if p.experts is not None else 0,
    )


def _check_redundant(s: ServeSettings, engine: Engine) -> None:
    unknown_ok = engine != "trtllm"  # a model only --model-path knows: vLLM/SGLang decide at load time
    if (
        s.redundant_experts
        and (s.model_type is not None or not unknown_ok)
        and (s.model_type not in REDUNDANT_EXPERT_MODELS[engine])
    ):
        raise InputError(
            f"placement {s.placement} reserves memory for {s.redundant_experts} redundant experts, but "
            f"{ENGINE_NAMES[engine]} has no redundant experts for "
            + (f"{s.model_type!r} models" if s.model_type else "this model"),
            fix="plan without --expert-replicas"
            + (", or launch with vllm" if s.model_type in REDUNDANT_EXPERT_MODELS["vllm"] else ""),
        )


def vllm_serve_argv(s: ServeSettings) -> list[str]:
    """``vllm serve`` with the degrees, context, memory and dtypes: what every executor's command shares."""
    if s.ep not in (1, s.tp):
        raise InputError(
            f"placement {s.placement} has ep={s.ep} with tp={s.tp}; vLLM has no expert-parallel size of its own "
            "(--enable-expert-parallel makes EP = TP x DP)",
            fix=f"plan with --ep {s.tp} or --ep 1, or launch with sglang (--ep-size)",
        )
    _check_redundant(s, "vllm")
    argv = ["vllm", "serve", s.model, "--tensor-parallel-size", str(s.tp), "--pipeline-parallel-size", str(s.pp)]
    if s.ep > 1:
        argv.append("--enable-expert-parallel")
        if s.redundant_experts:  # redundant experts need EPLB (config/parallel.py), which moves them to the load
            eplb = json.dumps({"num_redundant_experts": s.redundant_experts}, separators=(",", ":"))
            argv += ["--enable-eplb", "--eplb-config", eplb]
    argv += ["--max-model-len", str(s.max_model_len), "--gpu-memory-utilization", f"{s.gpu_memory_utilization:g}"]
    argv += ["--max-num-seqs", str(s.max_num_seqs), "--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    argv += ["--shutdown-timeout", str(DRAIN_S)]  # finish in-flight requests on SIGTERM instead of aborting them
    if s.dtype:
        argv += ["--dtype", s.dtype]
    if s.quantization:
        argv += ["--quantization", "fp8_per_tensor" if s.quantize_online else s.quantization]
    if s.kv_dtype != "auto":
        argv += ["--kv-cache-dtype", _VLLM_KV[s.kv_dtype]]
    return argv


def sglang_serve_argv(s: ServeSettings) -> list[str]:
    """``python3 -m sglang.launch_server`` with the degrees, context, memory and dtypes."""
    _check_redundant(s, "sglang")
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", s.model]
    argv += ["--tp-size", str(s.tp), "--pp-size", str(s.pp)]
    if s.ep > 1:
        argv += ["--ep-size", str(s.ep)]
        if s.redundant_experts:  # EPLB moves the redundant copies to the hot experts as it measures them
            argv += ["--ep-num-redundant-experts", str(s.redundant_experts), "--enable-eplb"]
    argv += ["--context-length", str(s.max_model_len), "--max-running-requests", str(s.max_num_seqs)]
    argv += ["--chunked-prefill-size", str(s.max_num_batched_tokens)]
    if s.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", f"{s.mem_fraction_static:.3f}"]
    if s.dtype:
        argv += ["--dtype", s.dtype]
    if s.quantization:
        argv += ["--quantization", s.quantization]
    if s.kv_dtype != "auto":
        if s.kv_dtype not in _SGLANG_KV:
            raise InputError(
                f"placement {s.placement} needs a {s.kv_dtype} KV cache, which SGLang 0.5.23 does not offer",
                fix="plan with --kv-dtype fp8 or use --engine vllm",
            )
        argv += ["--kv-cache-dtype", _SGLANG_KV[s.kv_dtype]]
    return argv


def _trtllm_kv_dtype(s: ServeSettings) -> str | None:
    """The options YAML's ``kv_cache_config.dtype``, or None for the checkpoint's own."""
    if s.kv_dtype == "auto":
        return None
    if s.kv_dtype != "fp8":
        raise InputError(
            f"placement {s.placement} needs a {s.kv_dtype} KV cache; toposched launches TensorRT-LLM with an fp8 "
            "or 16-bit KV cache only",
            fix="plan with --kv-dtype fp8 or --kv-dtype auto, or launch with vllm",
        )
    return "fp8"


def trtllm_options(s: ServeSettings) -> dict[str, Any]:
    """The LLM-API options YAML (``--config``) for what ``trtllm-serve`` has no flag for.

    ``kv_cache_config`` repeats the flag's fraction: trtllm-serve applies the YAML over the settings it
    builds from its flags, so a ``kv_cache_config`` there must hold the planned fraction too.
    CUDA graphs cover batches up to the planned one, padded to the nearest captured size.
    """
    kv: dict[str, Any] = {"free_gpu_memory_fraction": s.kv_free_fraction}
    kv_dtype = _trtllm_kv_dtype(s)
    if kv_dtype:
        kv["dtype"] = kv_dtype
    options: dict[str, Any] = {"kv_cache_config": kv}
    if s.dtype:
        options["dtype"] = s.dtype
    options["cuda_graph_config"] = {"max_batch_size": s.max_num_seqs, "enable_padding": True}
    return options


def trtllm_serve_argv(s: ServeSettings, config: str) -> list[str]:
    """``trtllm-serve`` on the PyTorch backend with the degrees, lengths, batch and KV fraction; the rest
    goes into the options YAML named ``config`` (:func:`trtllm_options`)."""
    if s.quantization:
        raise InputError(
            f"placement {s.placement} plans {s.quantization} weights from a 16-bit checkpoint; TensorRT-LLM loads "
            "pre-quantized checkpoints and does not quantize while loading",
            fix="plan with a pre-quantized FP8 checkpoint as --model (a ModelOpt or fp8 config.json), or launch with "
            "vllm or sglang",
        )
    _check_redundant(s, "trtllm")
    _trtllm_kv_dtype(s)
    argv = ["trtllm-serve", s.model, "--backend", "pytorch", "--tp_size", str(s.tp), "--pp_size", str(s.pp)]
    if s.ep > 1:
        argv += ["--ep_size", str(s.ep)]
    argv += ["--max_seq_len", str(s.max_model_len), "--max_batch_size", str(s.max_num_seqs)]
    argv += ["--max_num_tokens", str(s.max_num_batched_tokens), "--enable_chunked_prefill"]
    argv += ["--kv_cache_free_gpu_memory_fraction", f"{s.kv_free_fraction:g}", "--config", config]
    return argv
