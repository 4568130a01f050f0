"""What vLLM and SGLang are told to serve a placement as planned: the model, the degrees, the memory plan.

Only flags that exist in the pinned engines are emitted (vLLM 0.33.0, SGLang 0.5.23): ``FLAG_SOURCES``
says where each is defined (../shared/reference/engines.md or the engine's own source file), a unit
test fails on any other flag, and ``make check-engines`` runs every argv through the engines' own
parsers.

* **Model** (``served_model``): exactly what the request named: a Hugging Face id as given, a local
  model folder (or the folder of a ``config.json``), or for a catalog name the Hugging Face id the
  catalog gives that name; ``--model-path`` overrides it.
* **Settings** (``serve_settings``): every engine setting the plan's memory and latency figures rely
  on, mapped to each engine's own flag:

  =========================  =================================  ==================================
  plan                       vLLM 0.33.0                        SGLang 0.5.23
  =========================  =================================  ==================================
  tp / pp                    --tensor/--pipeline-parallel-size  --tp-size / --pp-size
  ep > 1                     --enable-expert-parallel (EP=TP)   --ep-size
  hot-expert copies          --enable-eplb --eplb-config        --ep-num-redundant-experts R
                             {"num_redundant_experts": R}       --enable-eplb
  max model len              --max-model-len                    --context-length
  memory budget              --gpu-memory-utilization 0.92      --mem-fraction-static (weights+KV)
  sequences (batch)          --max-num-seqs                     --max-running-requests
  profiled tokens            --max-num-batched-tokens           --chunked-prefill-size
  weight dtype               --quantization fp8 / --dtype       --quantization fp8 / --dtype
  KV dtype                   --kv-cache-dtype                   --kv-cache-dtype
  =========================  =================================  ==================================

  A plan an engine cannot run as planned is refused with one line: ``ep`` other than 1 or ``tp`` on
  vLLM, INT8/INT4 weights from a 16-bit checkpoint, redundant experts for a model the engine has
  none for, an INT8/INT4 KV cache on SGLang, a context longer than the model's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from toposched.errors import InputError
from toposched.solver.options import check_context
from toposched.solver.request import Placement, PlacementRequest
from toposched.workload import MemoryConfig, ModelSpec, resolve_model
from toposched.workload.catalog import catalog_entry
from toposched.workload.dtypes import WeightDtype, parse_weight_dtype, weight_format

Engine = Literal["vllm", "sglang"]

# Where each flag is defined: "engines.md" (../shared/reference/engines.md, sections 1.1 and 2 and the
# verbatim LWS examples) or the file of the engine's wheel that declares it.
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
        "--enable-eplb": "vllm/engine/arg_utils.py: parallel_group --enable-eplb (ParallelConfig.enable_eplb)",
        "--eplb-config": "vllm/engine/arg_utils.py: --eplb-config, JSON of vllm/config/parallel.py EPLBConfig",
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
    },
}
VLLM_FLAGS = frozenset(FLAG_SOURCES["vllm"])
SGLANG_FLAGS = frozenset(FLAG_SOURCES["sglang"])

# KV dtypes toposched plans with -> engine values (vLLM CacheDType; SGLang fields/model.py choices).
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
}


MAX_MODEL_ARG = 4096
"""Longest model name or path written into a launch (PATH_MAX on Linux)."""


def check_model_arg(value: str, what: str = "model") -> str:
    """``value`` if it can be the engine's model argument: printable text (no newline, no NUL), not too long."""
    if len(value) > MAX_MODEL_ARG or not value.isprintable():
        shown = repr(value[:40]) + ("..." if len(value) > 40 else "")
        raise InputError(
            f"{what} {shown} is not a catalog name or a path: "
            + (
                f"longer than {MAX_MODEL_ARG} characters" if len(value) > MAX_MODEL_ARG else "it has control characters"
            ),
            fix="use a catalog model name or the path of a config.json",
        )
    return value


def _repo_key(name: str) -> str:
    """A catalog short name or a Hugging Face repo name, compared without case and Meta's ``Meta-`` prefix."""
    return name.rsplit("/", 1)[-1].casefold().removeprefix("meta-")


def _catalog_hf_id(ref: str) -> str:
    """The Hugging Face id a catalog name stands for.

    The entry's own name serves its ``hf_id``. A short alias (``llama-3.1-70b-instruct``) names a sibling
    checkpoint of the same architecture, which the catalog lists among the entry's Hugging Face ids
    (``meta-llama/Llama-3.1-70B-Instruct``): the id whose repo name is the alias, else the one id that
    starts with it (``mixtral-8x7b-instruct`` -> ``mistralai/Mixtral-8x7B-Instruct-v0.1``). An alias that
    matches none, or several, is refused rather than served as another checkpoint.
    """
    entry = catalog_entry(ref)
    if ref.casefold() == entry.name.casefold():
        return entry.hf_id
    ids = list(dict.fromkeys([entry.hf_id, *(a for a in entry.aliases if "/" in a)]))
    key = _repo_key(ref)
    exact = [i for i in ids if _repo_key(i) == key]
    found = exact or [i for i in ids if _repo_key(i).startswith(key)]
    if len(found) != 1:
        raise InputError(
            f"catalog name {ref!r} names no single Hugging Face id "
            + (f"(it could be {', '.join(found)})" if found else f"(the entry {entry.name} lists {', '.join(ids)})"),
            fix="plan with the Hugging Face id itself (--model ORG/NAME), or pass --model-path",
        )
    return found[0]


def served_model(ref: str) -> str:
    """What the engine loads for the model a request names: exactly that id or path.

    A local path serves that folder (a ``config.json``'s folder); a Hugging Face id (``ORG/NAME``) is
    served as given; a catalog name serves the Hugging Face id the catalog gives that name.
    """
    check_model_arg(ref)
    try:
        path = Path(ref).expanduser()
    except RuntimeError:  # "~user" of an unknown user: not a path here
        path = Path(ref)
    try:
        if path.exists():
            return str(path.parent if path.is_file() else path)
    except OSError as exc:
        raise InputError(f"model path {ref[:60]!r} cannot be read: {exc.strerror}") from None
    resolve_model(ref)  # an unknown name or a missing config.json fails here, with "did you mean"
    return ref if "/" in ref else _catalog_hf_id(ref)


def checkpoint_of(request: PlacementRequest, model_path: str | None) -> ModelSpec | None:
    """The model as its checkpoint is (dtypes, context), or None when only ``--model-path`` knows it."""
    try:
        return resolve_model(request.model)
    except InputError:
        if model_path is None:
            raise
        return None


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
    dtype: Literal["bfloat16", "float16"] | None
    quantization: Literal["fp8"] | None
    kv_dtype: str
    redundant_experts: int


def _weights(
    p: Placement, request: PlacementRequest, checkpoint: ModelSpec | None
) -> tuple[Literal["bfloat16", "float16"] | None, Literal["fp8"] | None]:
    """(``--dtype``, ``--quantization``) that make the engine hold the weights the plan sized.

    Nothing when the checkpoint already is what was planned (the engines read ``quantization_config``
    and ``torch_dtype`` themselves) or is smaller than planned (a quantized checkpoint, planned as 16-bit).
    FP8 from a 16-bit checkpoint is quantized while loading (``--quantization fp8``, both engines); no
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
    cfg = MemoryConfig(max_num_seqs=request.concurrent_seqs)  # as the solver sized it (solver/options.py)
    dtype, quantization = _weights(p, request, checkpoint)
    # The activation peak was sized for this many tokens (workload/memory.py estimate_memory; the
    # activation-checkpointing fallback lowers it); vLLM needs it at least max_num_seqs.
    batched = cfg.checkpoint_batched_tokens if "activation-checkpointing" in p.fallbacks else cfg.max_num_batched_tokens
    batched = max(min(batched, request.max_model_len * cfg.max_num_seqs), request.concurrent_seqs)
    hbm = p.hbm_per_gpu
    # The plan's per-GPU total is the whole budget (KV takes what is left), i.e. memory x utilization.
    static = (
        math.floor((hbm.weights + hbm.kv) / hbm.total * cfg.gpu_memory_utilization * 1000) / 1000
        if hbm.total > 0 and hbm.weights + hbm.kv > 0
        else None
    )
    return ServeSettings(
        placement=p.id,
        model=model,
        model_type=checkpoint.model_type if checkpoint is not None else None,
        tp=p.tp,
        pp=p.pp,
        ep=p.ep,
        max_model_len=request.max_model_len,
        max_num_seqs=request.concurrent_seqs,
        max_num_batched_tokens=batched,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        mem_fraction_static=static,
        dtype=dtype,
        quantization=quantization,
        kv_dtype=_kv_dtype(p, dtype, checkpoint),
        redundant_experts=p.experts.redundant_experts if p.experts is not None else 0,
    )


def _check_redundant(s: ServeSettings, engine: Engine) -> None:
    if s.redundant_experts and s.model_type is not None and s.model_type not in REDUNDANT_EXPERT_MODELS[engine]:
        raise InputError(
            f"placement {s.placement} reserves memory for {s.redundant_experts} redundant experts, but "
            f"{'vLLM 0.33.0' if engine == 'vllm' else 'SGLang 0.5.23'} has no redundant experts for "
            f"{s.model_type!r} models",
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
    if s.dtype:
        argv += ["--dtype", s.dtype]
    if s.quantization:
        argv += ["--quantization", s.quantization]
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
