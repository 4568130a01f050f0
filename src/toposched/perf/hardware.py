"""GPU table: memory, HBM bandwidth, dense tensor throughput and the native GPU-to-GPU link.

Figures marked perf-anchors §2 are read from reference/perf-anchors.md section 2 (which cites
NVIDIA datasheets, STAS, AIC system YAMLs, LLMA/LLMV configs). Figures marked [U] come from vendor
datasheets that reference/ does not quote; they are listed in docs/cost-model.md as unverified.
Memory sizes follow AIC's convention (GiB) where it states one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from toposched.registry import Registry
from toposched.workload.dtypes import WeightDtype

GIB = 1024**3
TB = 1e12
TFLOPS = 1e12


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type."""

    name: str
    memory_bytes: int
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense tensor FLOP/s
    fp8_flops: float | None  # dense FP8 tensor FLOP/s; None when the GPU has no FP8 tensor cores
    native_link: str  # link-table key the GPUs of one box use between them
    source: str
    reported_memory_bytes: int | None = None
    """Total the driver reports (``cudaMemGetInfo``, what vLLM/SGLang size against); None = not
    documented, the nominal ``memory_bytes`` is used."""

    @property
    def usable_memory_bytes(self) -> int:
        """The memory the engines see: the driver-reported total where documented, else nominal."""
        return self.reported_memory_bytes or self.memory_bytes

    def gemm_flops(self, weight_dtype: WeightDtype) -> float:
        """Peak dense FLOP/s of the GEMMs for weights of ``weight_dtype``.

        FP8 weights run FP8 GEMMs where the GPU has them (W8A8); INT8/INT4 weight-only kernels
        (AWQ/GPTQ/Marlin) dequantise to BF16, and FP8 on a GPU without FP8 falls back the same way.
        """
        if weight_dtype == "fp8" and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops


GPUS_TABLE: tuple[tuple[GpuSpec, tuple[str, ...]], ...] = (
    (
        GpuSpec(
            "A100-SXM-40GB",
            40 * GIB,  # perf-anchors §2: 40 GB
            1.555 * TB,  # perf-anchors §2: 1.555 TB/s (LLMV)
            312 * TFLOPS,  # perf-anchors §2: 312 dense BF16
            None,  # perf-anchors §2: no FP8
            "nvlink3",  # perf-anchors §2: NVLink 3, 300 GB/s per direction
            "perf-anchors §2",
        ),
        ("A100-40GB", "A100-SXM4-40GB"),
    ),
    (
        GpuSpec(
            "A100-SXM-80GB",
            80 * GIB,  # perf-anchors §2: 80 GB (AIC: 80 GiB)
            2.039 * TB,  # perf-anchors §2: 2.039 TB/s (AIC, LLMA)
            312 * TFLOPS,  # perf-anchors §2
            None,
            "nvlink3",
            "perf-anchors §2",
        ),
        ("A100", "A100-80GB", "A100-SXM4-80GB", "A100-SXM"),
    ),
    (
        GpuSpec(
            "H100-SXM",
            80 * GIB,  # perf-anchors §2: 80 GB
            3.35 * TB,  # perf-anchors §2: 3.35 TB/s
            989 * TFLOPS,  # perf-anchors §2: 989 dense BF16
            1979 * TFLOPS,  # perf-anchors §2: 1979 dense FP8
            "nvlink4",  # perf-anchors §2: NVLink 4, 450 GB/s per direction
            "perf-anchors §2",
            # anchors-train.json: vLLM v0.19 logs on "NVIDIA H100 80GB HBM3", total_gib 79.19
            # (gpu_memory_total_gib_reported; vLLM PR #10511 logged 79.22 on an older driver)
            round(79.19 * GIB),
        ),
        ("H100", "H100-80GB", "H100-SXM5", "H100-SXM-80GB"),
    ),
    (
        GpuSpec(
            "H100-PCIe",
            80 * GIB,  # perf-anchors §2: 80 GB
            2.0 * TB,  # perf-anchors §2: 2.0 TB/s (STAS)
            756 * TFLOPS,  # perf-anchors §2
            1513 * TFLOPS,  # perf-anchors §2
            "pcie5",  # perf-anchors §2: host PCIe Gen5 (NVLink only as a 2-GPU bridge)
            "perf-anchors §2",
        ),
        ("H100-PCIE-80GB",),
    ),
    (
        GpuSpec(
            "H200",
            141 * GIB,  # perf-anchors §2: 141 GB (AIC: 141 GiB)
            4.8 * TB,  # perf-anchors §2: 4.8 TB/s
            989 * TFLOPS,  # perf-anchors §2
            1979 * TFLOPS,  # perf-anchors §2
            "nvlink4",  # perf-anchors §2: 450 / 900 GB/s
            "perf-anchors §2",
            # Approximate: issue 16 gives "about 140 GiB" for what engines see on an H200; no logged
            # total is in reference/. Replace with a logged cudaMemGetInfo total when one is published.
            140 * GIB,
        ),
        ("H200-SXM", "H200-141GB"),
    ),
    (
        GpuSpec(
            "B200",
            180 * 10**9,  # perf-anchors §2: 180 GB usable (NVIDIA HGX page)
            8.0 * TB,  # perf-anchors §2: 8.0 TB/s (STAS; AIC YAML says 7.7)
            2250 * TFLOPS,  # perf-anchors §2
            4500 * TFLOPS,  # perf-anchors §2
            "nvlink5",  # perf-anchors §2: NVLink 5, 900 GB/s per direction
            "perf-anchors §2",
        ),
        ("B200-SXM",),
    ),
    (
        GpuSpec(
            "GB200",
            186 * 10**9,  # [U] NVIDIA GB200 NVL72 page: 13.4 TB HBM3e over 72 GPUs
            8.0 * TB,  # [U] NVIDIA GB200 NVL72 page: 576 TB/s over 72 GPUs
            2500 * TFLOPS,  # [U] NVIDIA GB200 NVL72 page: 180 PFLOPS dense FP16/BF16 over 72 GPUs
            5000 * TFLOPS,  # [U] NVIDIA GB200 NVL72 page: 360 PFLOPS dense FP8 over 72 GPUs
            "mnnvl",  # multi-node NVLink across the NVL72 rack (DESIGN.md vocabulary)
            "NVIDIA GB200 NVL72 datasheet [U]",
        ),
        ("GB200-NVL72",),
    ),
    (
        GpuSpec(
            "L40S",
            48 * 10**9,  # [U] NVIDIA L40S datasheet: 48 GB GDDR6
            864e9,  # [U] NVIDIA L40S datasheet: 864 GB/s
            362 * TFLOPS,  # [U] NVIDIA L40S datasheet: 362.05 dense BF16 (733 with sparsity)
            733 * TFLOPS,  # [U] NVIDIA L40S datasheet: 733 dense FP8 (1466 with sparsity)
            "pcie4",  # perf-anchors §1.3: L40S boxes talk over PCIe Gen4
            "NVIDIA L40S datasheet [U]",
        ),
        ("L40S-48GB",),
    ),
    (
        GpuSpec(
            "RTX-4090",
            24 * GIB,  # [U] NVIDIA Ada whitepaper: 24 GB GDDR6X
            1008e9,  # [U] NVIDIA Ada whitepaper: 1008 GB/s
            165.2 * TFLOPS,  # [U] Ada whitepaper: BF16 tensor with FP32 accumulate, dense
            None,  # FP8 GEMMs are not used for serving on GeForce in this model: BF16 fallback
            "pcie4",  # GeForce has no NVLink; PCIe Gen4 x16 (perf-anchors §1.3 notes poor ring bw)
            "NVIDIA Ada Lovelace whitepaper [U]",
        ),
        ("RTX4090", "GeForce-RTX-4090"),
    ),
)


@cache
def gpu_registry() -> Registry[GpuSpec]:
    """The GPU table as a registry (case-insensitive names and aliases)."""
    reg: Registry[GpuSpec] = Registry("GPU")
    for spec, aliases in GPUS_TABLE:
        reg.register(spec.name, spec, aliases)
    return reg


AMBIGUOUS = {"h100": "H100-PCIe", "h100-80gb": "H100-PCIe", "a100": "A100-SXM-40GB", "a100-sxm": "A100-SXM-40GB"}
"""Short names that pick one variant of a GPU sold in several (issue 38: ``--gpu H100`` was taken as H100-SXM
without a word): the other variant to name if that is the one meant."""


def variant_note(name: str) -> str | None:
    """A one-line note when ``name`` is a short name that picks one of several variants, else None."""
    other = AMBIGUOUS.get(name.strip().lower())
    if other is None:
        return None
    chosen = get_gpu(name).name
    return f"note: --gpu {name} is taken as {chosen}; pass --gpu {other} for the other variant"


def get_gpu(name: str) -> GpuSpec:
    """The GPU named ``name`` (``UnknownNameError`` with suggestions otherwise)."""
    return gpu_registry().get(name)
