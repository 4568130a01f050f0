"""Workload model: model specs (catalog and ``config.json`` loader) and the per-GPU HBM estimator.

spec.py       ModelSpec / MoeSpec / MlaSpec, ``load_config`` and the parameter counts
catalog.py    the built-in catalog (package data ``data/models``) and ``resolve_model``
dtypes.py     weight and KV-cache dtypes, bytes per element
parallel.py   which (tp, pp, ep) a model admits
memory.py     ``estimate_memory`` -> MemoryEstimate, the capacity fallbacks
registry.py   a case-insensitive name registry that fails on duplicates and unknown names
"""

from __future__ import annotations

from toposched.workload.catalog import catalog, resolve_model
from toposched.workload.memory import MemoryConfig, MemoryEstimate, estimate_memory
from toposched.workload.spec import MlaSpec, ModelSpec, MoeSpec, load_config

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
