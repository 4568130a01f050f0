"""Which parallel degrees a model admits, and how vLLM splits layers over pipeline stages."""

from __future__ import annotations

from toposched.errors import InfeasibleError
from toposched.workload.spec import ModelSpec

# Degrees ``toposched fit`` considers by default: powers of two up to one 8-GPU node for TP (TP must
# stay inside one NVLink domain, DESIGN.md "the four constraints") and up to 8 stages for PP.
DEFAULT_TPS = (1, 2, 4, 8)
DEFAULT_PPS = (1, 2, 4, 8)


def tp_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why ``tp`` cannot shard this model's attention, or ``None`` when it can.

    vLLM splits query heads evenly (``num_heads % tp == 0``) and KV heads either evenly or by
    replication (``num_kv_heads % tp == 0`` or ``tp % num_kv_heads == 0``). MLA caches one latent,
    so only the query heads matter there.
    """
    if tp < 1:
        return f"tp={tp} must be at least 1"
    if spec.num_heads % tp:
        return f"tp={tp} does not divide the {spec.num_heads} attention heads of {spec.name}"
    kv = spec.num_kv_heads
    if spec.mla is None and kv % tp and tp % kv:
        return f"tp={tp} neither divides nor is a multiple of the {kv} KV heads of {spec.name}"
    return None


def valid_tps(spec: ModelSpec, limit: int = 64) -> list[int]:
    """Powers of two up to ``limit`` that shard this model."""
    out, tp = [], 1
    while tp <= limit:
        if tp_problem(spec, tp) is None:
            out.append(tp)
        tp *= 2
    return out


def check_degrees(spec: ModelSpec, tp: int, pp: int = 1, ep: int = 1) -> None:
    """Raise ``InfeasibleError`` naming the bad degree; return quietly when (tp, pp, ep) is valid."""
    problem = tp_problem(spec, tp)
    if problem:
        raise InfeasibleError(problem, fix="valid tp: " + ", ".join(str(t) for t in valid_tps(spec)))
    if pp < 1 or pp > spec.num_layers:
        raise InfeasibleError(f"pp={pp} must be between 1 and the {spec.num_layers} layers of {spec.name}")
    problem = ep_problem(spec, tp, ep)
    if problem:
        multiples = "" if spec.moe is None or ep < 1 else f", or a tp that is a multiple of {ep}"
        raise InfeasibleError(problem, fix=f"use ep=1{multiples}")


def ep_problem(spec: ModelSpec, tp: int, ep: int) -> str | None:
    """Why expert parallelism of degree ``ep`` cannot run with ``tp``, or ``None`` when it can."""
    if ep < 1:
        return f"ep={ep} must be at least 1"
    if ep == 1:
        return None
    if spec.moe is None:
        return f"ep={ep} needs a mixture-of-experts model; {spec.name} is dense"
    if tp % ep:
        return f"ep={ep} must divide tp={tp} (vLLM's expert parallelism spans the TP group)"
    return None


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Layer ranges per pipeline stage, as vLLM's ``get_pp_indices`` assigns them.

    Every stage gets ``num_layers // pp``; the remainder goes one each to the stages before the
    last (the last stage also holds the lm_head).
    """
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def partition_ranges(num_layers: int, pp: int, partition: tuple[int, ...] | None = None) -> list[range]:
    """Layer ranges from explicit per-stage layer counts, or vLLM's default split when None."""
    if partition is None:
        return stage_layers(num_layers, pp)
    if len(partition) != pp or sum(partition) != num_layers or min(partition) < 1:
        raise InfeasibleError(
            f"layer partition {list(partition)} must give {pp} stages of at least one layer summing to {num_layers}"
        )
    out, start = [], 0
    for size in partition:
        out.append(range(start, start + size))
        start += size
    return out
