"""Weight and KV-cache dtypes: bytes per element, including quantisation scale overhead.

Weight dtypes apply to the linear layers inside the decoder blocks. Embeddings, lm_head, norms and
MoE router gates stay in the checkpoint's activation dtype (bf16/fp16), as AWQ/GPTQ and FP8
checkpoints keep them (perf-anchors.md §3.4: a Llama-3.3-70B FP8 checkpoint is a 68.5 GB FP8 body
plus a 2.1 GB BF16 lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from toposched.errors import UnknownNameError

WeightDtype = Literal["bf16", "fp16", "fp8", "int8", "int4"]
KvDtype = Literal["auto", "bf16", "fp16", "fp8", "int8", "int4"]

WEIGHT_DTYPES: tuple[WeightDtype, ...] = get_args(WeightDtype)
KV_DTYPES: tuple[KvDtype, ...] = get_args(KvDtype)

# AWQ and GPTQ store int4 weights in groups of 128 with one fp16 scale and one packed 4-bit zero
# point per group (AutoAWQ / AutoGPTQ defaults: q_group_size=128, zero_point=True; vLLM's
# awq/gptq loaders read `scales` fp16 and `qzeros` int32-packed 4-bit). 2 B + 0.5 B per 128 weights.
INT4_GROUP_SIZE = 128
INT4_GROUP_OVERHEAD_BYTES = 2.0 + 0.5

_BASE_BYTES: dict[str, float] = {
    "bf16": 2.0,
    "fp16": 2.0,
    # FP8 (e4m3) and INT8 keep per-tensor or per-channel fp32 scales (one per output row, or
    # 128x128 blocks for DeepSeek-V3): below 0.03 % of the weight bytes, so not counted.
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}

_WEIGHT_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float8": "fp8", "fp8_e4m3": "fp8"}
_KV_ALIASES = {
    **_WEIGHT_ALIASES,
    "fp8_e5m2": "fp8",
    "int8_per_token_head": "int8",
    "int4_per_token_head": "int4",
}


@dataclass(frozen=True)
class WeightFormat:
    """How one weight is stored: element bytes plus amortised scale/zero-point bytes."""

    dtype: WeightDtype
    element_bytes: float
    scale_bytes: float

    @property
    def bytes_per_param(self) -> float:
        """Bytes one parameter costs on the GPU, scales included."""
        return self.element_bytes + self.scale_bytes


def weight_format(dtype: WeightDtype) -> WeightFormat:
    """The storage format of a quantised (or plain) linear-layer weight."""
    scale = INT4_GROUP_OVERHEAD_BYTES / INT4_GROUP_SIZE if dtype == "int4" else 0.0
    return WeightFormat(dtype, _BASE_BYTES[dtype], scale)


def parse_weight_dtype(name: str) -> WeightDtype:
    """``bf16``, ``fp16``, ``fp8``, ``int8``, ``int4`` (case-insensitive; ``bfloat16`` etc. too)."""
    key = _WEIGHT_ALIASES.get(name.strip().lower(), name.strip().lower())
    for dtype in WEIGHT_DTYPES:
        if dtype == key:
            return dtype
    raise UnknownNameError("weight dtype", name[:40], WEIGHT_DTYPES)  # a 1 MB flag is not echoed whole


def parse_kv_dtype(name: str) -> KvDtype:
    """``auto`` (the model's activation dtype), ``fp8``, ``int8``, ``int4``, ``bf16``, ``fp16``."""
    key = _KV_ALIASES.get(name.strip().lower(), name.strip().lower())
    for dtype in KV_DTYPES:
        if dtype == key:
            return dtype
    raise UnknownNameError("KV-cache dtype", name[:40], KV_DTYPES)


def kv_element_bytes(kv_dtype: KvDtype, activation_dtype: Literal["bf16", "fp16"]) -> float:
    """Bytes per cached K/V element; ``auto`` follows the model's activation dtype (vLLM rule)."""
    if kv_dtype == "auto":
        return _BASE_BYTES[activation_dtype]
    return _BASE_BYTES[kv_dtype]


def activation_bytes(activation_dtype: Literal["bf16", "fp16"]) -> float:
    """Bytes per activation element (bf16 and fp16 are both 2)."""
    return _BASE_BYTES[activation_dtype]
