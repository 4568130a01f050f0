"""Hand-built placements and plans for the launch tests: layouts the solver may not emit (yet)."""

from __future__ import annotations

from collections.abc import Sequence

from toposched.binding.plan_doc import PlanDoc
from toposched.solver.request import HbmShare, Placement, PlacementRequest, Rank
from toposched.topology.model import Cluster
from toposched.topology.presets import load_preset


def make_placement(
    blocks: Sequence[tuple[str, Sequence[int]]],
    *,
    tp: int,
    pp: int = 1,
    model: str = "llama-3.1-405b",
    id: str = "plan-0",
) -> Placement:
    """A placement whose ranks fill ``blocks`` (node, GPUs) in order: rank ``r`` is stage ``r // tp``."""
    cells = [(node, gpu) for node, gpus in blocks for gpu in gpus]
    if len(cells) != tp * pp:
        raise ValueError(f"{len(cells)} GPUs for tp={tp} x pp={pp}")
    ranks = tuple(Rank(rank=r, node=n, gpu=g, stage=r // tp, tp_rank=r % tp) for r, (n, g) in enumerate(cells))
    return Placement(
        id=id, request_id="plan", model=model, policy="hand", tp=tp, pp=pp, ep=1, ranks=ranks,
        level="nvlink", link="nvlink", stage_domains=(None,) * pp, stage_layers=(1,) * pp,
        hbm_per_gpu=HbmShare(weights=0, kv=0, activations=0, workspace=0), kv_dtype="auto",
        kv_tokens_capacity=0, ttft_ms=0.0, tpot_ms=0.0, cross_domain_gbps=0.0, constraints=(),
    )  # fmt: skip


def make_doc(cluster: Cluster, *placements: Placement, model: str = "llama-3.1-405b") -> PlanDoc:
    return PlanDoc(tuple(placements), PlacementRequest(id="plan", model=model), cluster)


def nvl72_doc(
    trays: Sequence[int] = (0, 1), *, tp: int = 8, pp: int = 1, gpus: Sequence[int] = (0, 1, 2, 3)
) -> PlanDoc:
    """A GB200 NVL72 plan with one placement on ``gpus`` of each of ``trays`` (in rank order)."""
    cluster = load_preset("gb200-nvl72")
    names = [cluster.nodes[t].name for t in trays]
    return make_doc(cluster, make_placement([(n, gpus) for n in names], tp=tp, pp=pp))
