"""What the engine checks stub, and only that: the parts of vLLM and SGLang that need a GPU.

Active only when ``TOPOSCHED_GPU_STUB`` is set (the checks set it; the venv is otherwise untouched).
Its value names the GPU the plan runs on: ``NAME;MAJOR.MINOR;MEMORY_BYTES;SM_COUNT`` (for example
``NVIDIA H100 80GB HBM3;9.0;85520809984;132``).

Stubbed, because each needs a CUDA driver and a GPU:

1. **Compiled CUDA extensions** of the engines (``vllm._C_stable_libtorch``, ``vllm._moe_C...``,
   ``vllm.vllm_flash_attn._vllm_fa2_C``/``_fa3_C``, ``vllm._flashmla_C``, ...; any extension module
   under ``vllm``, ``sglang`` or ``sgl_kernel``): they link ``libcudart``/``libcuda`` and a CUDA build of
   torch. They are replaced by empty modules.
2. **The torch ops those extensions register** (``torch.ops._C.*``, ``torch.ops._moe_C.*``,
   ``torch.ops.sgl_kernel.*``, ...; ``OP_NAMESPACES``): a kernel *capability query* (an op whose name
   says ``_supports_``/``_supported``) answers ``False``; every other op stays missing, as torch
   reports an op whose library did not load, so a check that would run a kernel fails loudly.
3. **Device queries** (compute capability, name, memory, device count): answered from
   ``TOPOSCHED_GPU_STUB`` and from the launch's own ``CUDA_VISIBLE_DEVICES`` (its entry count is the
   device count), through vLLM's platform plug-in (``vllm_plugin``) and SGLang's device helpers
   (``sglang_devices``).

Everything else (argument parsers, config classes, model-config reading, validation) is the engines'
own code, unchanged.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ENV = "TOPOSCHED_GPU_STUB"
PACKAGES = frozenset({"vllm", "sglang"})
"""Packages whose compiled extension modules are replaced by empty modules."""
KERNEL_PACKAGES = frozenset({"sgl_kernel"})
"""Packages of GPU kernels only (SGLang's ``sglang-kernel``), not installed: importing any of their
modules gives a stand-in whose every attribute is a ``KernelStub``."""
OP_NAMESPACES = frozenset({"_C", "_moe_C", "_C_cache_ops", "_C_custom_ar", "_C_cuda_utils", "_qutlass_C", "sgl_kernel"})
"""The torch-op namespaces the stubbed libraries would register."""


def capability_query(namespace: str, op: str) -> bool:
    """A kernel library's "is this kernel built for compute capability X?" question
    (``cutlass_scaled_mm_supports_fp8``, ``cutlass_group_gemm_supported``, ...)."""
    return namespace in OP_NAMESPACES and ("_supports_" in op or op.endswith("_supported"))


STUBBED_MODULES: list[str] = []
"""Extension modules replaced so far in this process (the checks print them)."""


@dataclass(frozen=True)
class Gpu:
    """The GPU a case runs on."""

    name: str
    capability: tuple[int, int]
    memory_bytes: int
    sm_count: int

    def encode(self) -> str:
        return f"{self.name};{self.capability[0]}.{self.capability[1]};{self.memory_bytes};{self.sm_count}"


def active() -> bool:
    return bool(os.environ.get(ENV))


def gpu() -> Gpu:
    """The GPU named by ``TOPOSCHED_GPU_STUB`` (read at every call: the checks change it per case)."""
    name, cap, memory, sms = os.environ[ENV].split(";")
    major, minor = cap.split(".")
    return Gpu(name, (int(major), int(minor)), int(memory), int(sms))


def device_count() -> int:
    """Devices this process may use: the entries of ``CUDA_VISIBLE_DEVICES`` (0 when unset or empty)."""
    return len([d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()])


class _EmptyLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__["__toposched_stub__"] = True


class _DeclareFirst(importlib.abc.Loader):
    """Runs ``before()`` and then the module's own loader."""

    def __init__(self, loader: Any, before: Any) -> None:
        self.loader, self.before = loader, before

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        result: types.ModuleType | None = self.loader.create_module(spec)
        return result

    def exec_module(self, module: types.ModuleType) -> None:
        self.before()
        self.loader.exec_module(module)


def _declare_torchvision_schemas() -> None:
    """Declare the two ops ``torchvision._meta_registrations`` registers without checking they exist.

    PyPI's torchvision is built for CUDA torch; beside CPU torch its ``_C`` library does not load
    (torchvision then runs without its ops, by design), but two of its fake registrations assume the
    library is there. Declaring their schemas (copied from torchvision's ``_C``) lets it import; no
    kernel is added.
    """
    import torch.library  # type: ignore[import-not-found]
    import torchvision.extension  # type: ignore[import-not-found]

    if torchvision.extension._has_ops():
        return
    global _TORCHVISION_LIB
    _TORCHVISION_LIB = torch.library.Library("torchvision", "DEF")
    for schema in TORCHVISION_SCHEMAS:
        _TORCHVISION_LIB.define(schema)


TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_TORCHVISION_LIB: Any = None


class KernelStub:
    """Stands for a GPU kernel of a kernel-only package: importing it works, calling it raises."""

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.qualname} is a GPU kernel, stubbed by the engine checks (toposched_gpu_stub)")

    def __getattr__(self, item: str) -> KernelStub:
        if item.startswith("__"):
            raise AttributeError(item)
        return KernelStub(f"{self.qualname}.{item}")


class _KernelPackage(types.ModuleType):
    def __getattr__(self, item: str) -> KernelStub:
        if item.startswith("__"):
            raise AttributeError(item)
        return KernelStub(f"{self.__name__}.{item}")


class _KernelPackageLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _KernelPackage(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__["__toposched_stub__"] = True


class _ExtensionStub(importlib.abc.MetaPathFinder):
    """Finds the engines' compiled extension modules and hands out empty modules instead."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in KERNEL_PACKAGES:
            STUBBED_MODULES.append(fullname)
            return importlib.machinery.ModuleSpec(fullname, _KernelPackageLoader(), is_package=True)
        if fullname == "torchvision._meta_registrations":
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _DeclareFirst(spec.loader, _declare_torchvision_schemas)
            return spec
        if fullname.split(".")[0] not in PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            return None
        STUBBED_MODULES.append(fullname)
        return importlib.machinery.ModuleSpec(fullname, _EmptyLoader(), origin=spec.origin)


def _answer_false(*args: Any, **kwargs: Any) -> bool:
    return False


def _stub_torch_ops() -> None:
    """Kernel capability queries answer ``False``: no kernel is built here. The engines ask them while
    building their configs only to choose a kernel (per-token or per-tensor FP8 scales, CUTLASS or
    Triton), never to accept or refuse an argument.

    Every other op of the stubbed extensions stays missing, exactly as torch reports an op whose
    library was not loaded (``hasattr(torch.ops._C, name)`` is false, calling it raises).
    """
    import torch._ops  # type: ignore[import-not-found]

    namespace_type: Any = torch._ops._OpNamespace
    real = namespace_type.__getattr__
    if getattr(real, "__toposched_stub__", False):
        return

    def getattr_(self: Any, op: str) -> Any:
        if capability_query(self.name, op):
            return _answer_false
        return real(self, op)

    getattr_.__toposched_stub__ = True  # type: ignore[attr-defined]
    namespace_type.__getattr__ = getattr_


def install(*, torch_cuda: bool = False) -> None:
    """Stub the extensions and their ops in this process (idempotent); a no-op unless ``active()``.

    ``torch_cuda`` also answers ``torch.cuda``'s device queries (``torch_cuda.install``), for SGLang.
    """
    if not active():
        return
    if not any(isinstance(f, _ExtensionStub) for f in sys.meta_path):
        sys.meta_path.insert(0, _ExtensionStub())
    _stub_torch_ops()
    if torch_cuda:
        from toposched_gpu_stub import torch_cuda as cuda_queries

        cuda_queries.install()
