"""``torch.cuda``'s device queries answered from the stub GPU, for SGLang.

SGLang asks torch directly (``torch.cuda.is_available()``, ``get_device_capability()``,
``mem_get_info()``, ``get_device_properties()``...) where vLLM asks its platform object. With CPU torch
these report no GPU; here they report ``device_count()`` GPUs of the ``TOPOSCHED_GPU_STUB`` kind, and
``torch.version.cuda`` names the CUDA release the engines' wheels are built for. Nothing that would
allocate on or launch work on a GPU is replaced: ``torch.cuda.set_device``, tensors on ``cuda``,
streams and kernels still fail.
"""

from __future__ import annotations

import types
from typing import Any

import toposched_gpu_stub as stub

CUDA_RELEASE = "13.0"
"""What ``torch.version.cuda`` reports: the CUDA major of the vLLM 0.33.0 / SGLang 0.5.23 wheels (cu13)."""


def _properties(device: Any = None) -> Any:
    gpu = stub.gpu()
    major, minor = gpu.capability
    return types.SimpleNamespace(
        name=gpu.name,
        major=major,
        minor=minor,
        total_memory=gpu.memory_bytes,
        multi_processor_count=gpu.sm_count,
        is_integrated=False,
        uuid=None,
    )


def install() -> None:
    """Replace the device queries (idempotent); nothing else in ``torch.cuda`` changes."""
    import torch  # type: ignore[import-not-found]
    import torch.cuda  # type: ignore[import-not-found]

    cuda: Any = torch.cuda
    if getattr(cuda, "__toposched_stub__", False):
        return
    cuda.__toposched_stub__ = True
    version: Any = torch.version
    version.cuda = CUDA_RELEASE
    cuda.is_available = lambda: stub.device_count() > 0
    cuda.device_count = stub.device_count
    cuda.is_initialized = lambda: False
    cuda.current_device = lambda: 0
    cuda.get_device_capability = lambda device=None: stub.gpu().capability
    cuda.get_device_name = lambda device=None: stub.gpu().name
    cuda.get_device_properties = _properties
    cuda.mem_get_info = lambda device=None: (stub.gpu().memory_bytes, stub.gpu().memory_bytes)
