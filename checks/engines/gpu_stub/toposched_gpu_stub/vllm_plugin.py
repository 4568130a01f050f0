"""vLLM's ``vllm.platform_plugins`` entry point: the stub CUDA platform when ``TOPOSCHED_GPU_STUB`` is set.

vLLM calls ``platform()`` in every process (the API process and the subprocess that inspects model
classes) the first time ``vllm.platforms.current_platform`` is read, before it imports any kernel;
this is where the extension stubs are installed. Unset, the plug-in declines and vLLM detects as usual.
"""

from __future__ import annotations

import toposched_gpu_stub


def platform() -> str | None:
    if not toposched_gpu_stub.active():
        return None
    toposched_gpu_stub.install()
    return "toposched_gpu_stub.vllm_platform.StubCudaPlatform"
