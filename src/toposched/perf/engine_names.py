"""The engine names the cost model and the calibration profiles use (``engine_of``).

The CLI, the service, scenarios and calibration samples name engines as users do (``vllm``, ``sglang``,
``trtllm``, ``nim``, any case); the cost model (``perf/latency.py``) and a profile entry's ``engine`` scope
(``perf/profile.py``) use one name per engine. A leaf module, so that both can import it.
"""

from __future__ import annotations

ENGINE_ALIASES = {
    "vllm": "vllm",
    "sglang": "sglang",
    "trtllm": "tensorrt-llm-pytorch",  # toposched's `launch trtllm`: trtllm-serve --backend pytorch
    "trtllm-pytorch": "tensorrt-llm-pytorch",
    "tensorrt-llm-pytorch": "tensorrt-llm-pytorch",
    "tensorrt-llm": "tensorrt-llm",
    "trtllm-tensorrt": "tensorrt-llm",
    "nim": "nvidia-nim",
    "nvidia-nim": "nvidia-nim",
}
"""The engine names the CLI, the service, scenarios and samples take, to the name the cost model and the
profiles use (``engine_of``): ``trtllm`` is what ``launch trtllm`` starts, TensorRT-LLM's PyTorch backend."""


def engine_of(engine: str | None) -> str | None:
    """The cost model's name of ``engine`` (``ENGINE_ALIASES``); None for None or an empty name; any
    other name lower-cased as it is (priced like vLLM and matched by a profile's ``*`` engine only)."""
    name = (engine or "").strip().lower()
    return ENGINE_ALIASES.get(name, name) or None


def known_engine(engine: str | None) -> bool:
    """Whether ``engine`` names an engine the cost model knows (``ENGINE_ALIASES``)."""
    return (engine or "").strip().lower() in ENGINE_ALIASES


__all__ = ["ENGINE_ALIASES", "engine_of", "known_engine"]
