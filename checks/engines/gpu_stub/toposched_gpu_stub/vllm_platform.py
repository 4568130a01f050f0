"""vLLM's own CUDA platform (``vllm.platforms.cuda``) with the device queries answered by the stub GPU.

Only the methods that ask the driver are replaced; everything else (supported dtypes, FP8 support,
``check_and_update_config``, attention backend choice) is vLLM's CUDA code deciding on the stub's
compute capability.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cuda import NonNvmlCudaPlatform  # type: ignore[import-not-found]
from vllm.platforms.interface import DeviceCapability  # type: ignore[import-not-found]

import toposched_gpu_stub as stub


class StubCudaPlatform(NonNvmlCudaPlatform):  # type: ignore[misc]
    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> Any:
        major, minor = stub.gpu().capability
        return DeviceCapability(major=major, minor=minor)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return stub.gpu().name

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return stub.gpu().memory_bytes

    @classmethod
    def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
        return True

    @classmethod
    def device_count(cls) -> int:
        return stub.device_count()
