"""Builders that keep solver tests short (vLLM's create_scheduler()/create_requests() style)."""

from __future__ import annotations

from typing import Any

from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.presets import hgx_h100_cluster, load_preset


def make_scheduler(preset: str = "hgx-h100", *, nodes: int | None = None, **kw: Any) -> Scheduler:
    cluster = hgx_h100_cluster(nodes=nodes) if nodes is not None else load_preset(preset)
    return Scheduler(cluster, **kw)


def make_request(model: str = "llama-3.1-70b", **kw: Any) -> PlacementRequest:
    kw.setdefault("max_model_len", 8192)
    kw.setdefault("concurrent_seqs", 16)
    return PlacementRequest(model=model, **kw)
