"""Workload model: model specs (catalog and ``config.json`` loader) and the per-GPU HBM estimator.

spec.py       ModelSpec / MoeSpec / MlaSpec and the parameter counts
hf_config.py  ``load_config``: a Hugging Face ``config.json`` read into a ModelSpec
catalog.py    the built-in catalog (package data ``data/models``) and ``resolve_model``
dtypes.py     weight and KV-cache dtypes, bytes per element
parallel.py   which (tp, pp, ep) a model admits
memory.py     ``estimate_memory`` -> MemoryEstimate, the capacity fallbacks
memory_config.py  ``MemoryConfig``: engine memory settings, the engines' defaults, the fitted constants
registry.py   a case-insensitive name registry that fails on duplicates and unknown names
"""

from __future__ import annotations

from toposched.workload.catalog import catalog, resolve_model
from toposched.workload.hf_config import load_config
from toposched.workload.memory import MemoryEstimate, estimate_memory
from toposched.workload.memory_config import MemoryConfig
from toposched.workload.spec import MlaSpec, ModelSpec, MoeSpec

__all__ = [
    "MemoryConfig",
    "MemoryEstimate",
    "MlaSpec",
    "ModelSpec",
    "MoeSpec",
    "catalog",
    "estimate_memory",
    "load_config",
    "resolve_model",
]
