"""MoE kernels per engine version: the fused-MoE tables an engine's own kernels were measured in (issue 34).

NVIDIA's aiconfigurator-core 0.12.0 measured one fused MoE layer (grouped expert GEMMs with their routing
permutes) inside vLLM 0.24, SGLang 0.5.14 (0.5.10 on A100) and TensorRT-LLM 1.3.0rc20 (A100, H100, H200;
BF16, per-tensor FP8, block-scaled FP8). ``benchmarks/moe_tables.py --per-engine`` fits each engine's rows on
their own (the model's MoE form with an HBM fraction and a grouped-GEMM efficiency per dtype, a curve over
the expert's width per GPU, the engine's tile and routing cost; 7.4 % / 13.3 % / 15.4 % mean error in sample
for TensorRT-LLM / vLLM / SGLang) and ``--write`` keeps the fits in ``data/moe_engines.json``.

The same shape and dtype run 2-4x apart between these engines, and the published serving runs of older
versions (vLLM 0.11, SGLang 0.5.5-0.5.7, TensorRT-LLM 0.15-1.0) were predicted worse with them than with the
pooled MoE term (docs/cost-model.md): the kernels change between versions. So a fit prices an engine only at
the version its tables measured or a later one, and only when the version is given (``--engine-version``,
``engine_version``); anything else keeps the pooled MoE term of the profile (``moe_tile_m``,
``moe_layer_us``). NIM is not switched by version: its version numbers are not TensorRT-LLM's. The fits'
``t_half`` (a curve over tokens per expert) is not read: the recommended form has none (it is 0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from packaging.version import InvalidVersion, Version

from toposched.perf.engine_names import engine_of, version_of
from toposched.perf.hardware import GpuSpec

ENGINE_TABLE = {"vllm": "vllm", "sglang": "sglang", "tensorrt-llm-pytorch": "trtllm", "tensorrt-llm": "trtllm"}
"""The engine whose tables price a cost-model engine name (``engine_names.engine_of``); TensorRT engines
take TensorRT-LLM's MoE kernels."""


@dataclass(frozen=True)
class MoeKernels:
    """One engine's fused-MoE fit for one weight dtype (``benchmarks/moe_tables.py`` ``EngineFit``)."""

    table: str
    from_version: str
    moe_tile_m: float
    moe_layer_us: float
    moe_n_half: float
    eta_moe: float
    """Grouped-GEMM efficiency as a fraction of the dense GEMM efficiency of the dtype."""
    mem_moe: float
    """HBM fraction of the expert read as a fraction of ``eta_mem``."""


@cache
def _fits() -> dict[str, dict[str, object]]:
    ref = resources.files("toposched") / "data" / "moe_engines.json"
    data: dict[str, dict[str, dict[str, object]]] = json.loads(ref.read_text())
    return data["engines"]


def _dtype_key(weight_dtype: str, fp8_block: bool, gpu: GpuSpec) -> str | None:
    """The tables' dtype of a weight dtype on ``gpu`` (FP8 only where the GPU runs FP8); None: not measured."""
    if weight_dtype in ("bf16", "fp16"):
        return "bfloat16"
    if weight_dtype == "fp8" and gpu.fp8_flops:
        return "fp8_block" if fp8_block else "fp8"
    return None


def moe_kernels(engine: str | None, weight_dtype: str, fp8_block: bool, gpu: GpuSpec) -> MoeKernels | None:
    """The fused-MoE fit that prices ``engine`` (``name==version``, ``engine_names.cost_engine``), or None:
    no version, a version before its tables', an engine or dtype without a table, an unreadable version."""
    table = ENGINE_TABLE.get(engine_of(engine) or "")
    version = version_of(engine)
    dtype = _dtype_key(weight_dtype, fp8_block, gpu)
    if table is None or version is None or dtype is None:
        return None
    fit = _fits().get(table)
    if fit is None:
        return None
    eta, mem = fit["eta_moe"], fit["mem_moe"]
    assert isinstance(eta, dict) and isinstance(mem, dict)
    if dtype not in eta:
        return None
    try:
        if Version(version) < Version(str(fit["from_version"])):
            return None
    except InvalidVersion:
        return None
    return MoeKernels(
        table=table,
        from_version=str(fit["from_version"]),
        moe_tile_m=float(fit["moe_tile_m"]),  # type: ignore[arg-type]
        moe_layer_us=float(fit["moe_layer_us"]),  # type: ignore[arg-type]
        moe_n_half=float(fit["moe_n_half"]),  # type: ignore[arg-type]
        eta_moe=float(eta[dtype]),
        mem_moe=float(mem[dtype]),
    )


__all__ = ["ENGINE_TABLE", "MoeKernels", "moe_kernels"]
