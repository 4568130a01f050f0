"""Cost model: GPU and link tables, the all-reduce model and its fit, TTFT/TPOT prediction.

hardware.py   GpuSpec table (A100, H100, H200, B200, GB200, L40S, RTX 4090)
links.py      LinkSpec table (NVLink generations, PCIe, IB, RoCE, TCP) with all-reduce fits
allreduce.py  alpha-beta model, fit to aiconfigurator_allreduce.csv
latency.py    ``predict_latency`` -> LatencyEstimate
"""

from __future__ import annotations

from toposched.perf.coefficients import PerfConfig
from toposched.perf.hardware import GpuSpec, get_gpu, gpu_registry
from toposched.perf.latency import LatencyEstimate, predict_latency
from toposched.perf.links import LinkSpec, get_link, link_registry

__all__ = [
    "GpuSpec",
    "LatencyEstimate",
    "LinkSpec",
    "PerfConfig",
    "get_gpu",
    "get_link",
    "gpu_registry",
    "link_registry",
    "predict_latency",
]
