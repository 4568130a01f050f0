"""Exact baseline: the placement objective as an OR-Tools CP-SAT model, for small clusters and batches.

The same objective the fast ``slo`` policy follows greedily, as one weighted sum (lexicographic by
the size of the weights, as far as one instance's options differ), so the two can be compared on equal
terms (``objective``; the fallback and stage terms are the fast policies' option order,
``cpsat.layout_cost``, since issue 35):

    1e9  per instance left unplaced (x (1 + priority))
    1e8  per placed instance whose predicted latency misses its SLO (a soft cost, as in the fast path)
    5e7  per capacity fallback of the chosen option (KV in FP8/INT8, ...)  -- options that fit as asked first
    2e7  per pipeline stage beyond the first, for a request without a latency SLO  -- the default layout rule
    1e6  per GPU used                                   -- the SLO with the fewest GPUs
    1e5  per pipeline stage beyond the first, for a request with an SLO  -- larger TP among equal GPUs
    1e4  per NVLink group that was entirely free and is not afterwards  -- keep large blocks whole
    10   per free GPU in each chosen group before placing (tighter fit is cheaper)
    1    per extra NUMA node a TP group spans            -- locality inside the domain

The model (``solver/cpsat.py``) keeps the fast path's hard constraints: capacity, domain affinity
and the group filters, the cross-domain budget (modelled conservatively) and a launchable layout.

The model predicts latency and traffic from probes (``assess`` on a sample of each group), so each
decision is re-checked with ``assess`` on the GPUs actually chosen before it is returned or
committed: a plan that breaks any constraint but the SLO is never committed. It is cut from the
model (that option on that GPU set) and the model solved again, ``CUT_ROUNDS`` times at most; then
the instance is unplaced with the broken constraints as reasons.

A preferred (not required) role affinity is not modelled: exact ignores ``near`` unless it is required.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from toposched.errors import InfeasibleError
from toposched.solver.cpsat import (
    Choice,
    Cut,
    Instance,
    nvlink_groups,
    solve,
)
from toposched.solver.index import ClusterIndex
from toposched.solver.layout import layout_problem
from toposched.solver.objective import W_BREAK, W_FIT, W_GPU, W_NUMA, W_SLO, W_UNPLACED, layout_cost
from toposched.solver.outcome import Outcome
from toposched.solver.place import Assessment, assess
from toposched.solver.request import Placement, PlacementRequest, Unplaced, instance_ids

if TYPE_CHECKING:  # the scheduler calls the exact policy: no import circle at run time
    from toposched.solver.scheduler import Scheduler

MAX_GPUS = 128
"""Largest cluster exact accepts (the model grows with GPUs x options x stages)."""
CUT_ROUNDS = 4
"""How often a plan the re-check refused is cut from the model and solved again."""
TIME_LIMIT_S = 20.0
"""CP-SAT time limit per solve."""


def size_problem(what: str, gpus: int) -> str | None:
    """Why ``what`` (with ``gpus`` GPUs) is too large for the exact policy, or None (one rule for
    ``plan``, ``simulate`` and the service)."""
    if gpus <= MAX_GPUS:
        return None
    return f"{what} has {gpus} GPUs; exact handles at most {MAX_GPUS} GPUs"


def check_size(index: ClusterIndex) -> None:
    """``InfeasibleError`` naming the fix when the cluster is too large for the exact policy."""
    problem = size_problem(f"cluster {index.cluster.name!r}", len(index.info))
    if problem:
        raise InfeasibleError(f"policy exact: {problem}", fix="use policy slo")


def objective(
    index_before: ClusterIndex,
    placements: Sequence[Placement],
    unplaced: Sequence[Unplaced],
    priorities: dict[str, int],
    requests: Mapping[str, PlacementRequest] | None = None,
) -> int:
    """The cost of an outcome on the free GPUs it started from (lower is better); ``requests`` (by id) price
    the layout terms (``cpsat.layout_cost``), left out without them."""
    free = index_before.free
    used: set[str] = set()
    cost = sum(W_UNPLACED * (1 + priorities.get(u.request_id, 0)) for u in unplaced)
    for p in placements:
        refs = p.gpu_refs
        used.update(refs)
        cost += W_GPU * len(refs)
        request = (requests or {}).get(p.request_id)
        if request is not None:
            cost += layout_cost(request, len([f for f in p.fallbacks if f != "cross-domain"]), p.pp)
        if not p.check("slo").held:
            cost += W_SLO
        for s in range(p.pp):
            stage = [f"{r.node}/{r.gpu}" for r in p.ranks if r.stage == s]
            cost += W_NUMA * (len({index_before.info[r].numa for r in stage}) - 1)
            level = index_before.levels[p.level]
            groups = [g for g in level.of_gpu.get(stage[0], []) if all(g in level.of_gpu.get(r, []) for r in stage)]
            if groups:
                cost += W_FIT * min(sum(1 for r in level.groups[g].gpus if r in free) for g in groups)
    for group in nvlink_groups(index_before):
        if all(r in free for r in group) and any(r in used for r in group):
            cost += W_BREAK
    return cost


# ---------------------------------------------------------------------------------------- entry points


def choose(s: Scheduler, request: PlacementRequest, pid: str, replica_nodes: set[str]) -> Assessment | Unplaced:
    """The policy-registry entry: the best placement of one instance, re-checked, not committed."""
    check_size(s.index)
    cands, dropped = s.candidates(request)
    inst = Instance(request, pid, 0, cands, dropped, frozenset(replica_nodes))
    (result,) = _decide(s, [inst], commit=None, time_limit_s=TIME_LIMIT_S, workers=2)
    return result


def place_exact(
    scheduler: Scheduler,
    requests: Sequence[PlacementRequest],
    *,
    ttl_s: float | None = None,
    meta: Mapping[str, dict[str, str]] | None = None,
    time_limit_s: float = TIME_LIMIT_S,
    workers: int = 2,
) -> Outcome:
    """Place a batch of requests optimally (within ``time_limit_s``) and commit the result.

    Each placement is booked with lease ``ttl_s`` and ``meta[request.id]`` in its record, after the
    re-check; an instance whose plans all break a constraint is unplaced with the reasons. A booking
    the ledger refuses raises ``LedgerConflict`` (instances booked before it stay), as in ``place``.
    """
    check_size(scheduler.index)
    outcome = Outcome()
    instances: list[Instance] = []
    for request in requests:
        scheduler.admit(request)
        cands, dropped = scheduler.candidates(request)
        for replica, pid in enumerate(instance_ids(request.id, request.replicas)):
            existing = scheduler.placements.get(pid)
            if existing is not None:  # idempotent by id
                outcome.placements.append(existing)
                continue
            instances.append(Instance(request, pid, replica, cands, dropped))

    def commit(inst: Instance, result: Assessment) -> None:
        scheduler.commit(result, ttl_s=ttl_s, meta=(meta or {}).get(inst.request.id))

    for result in _decide(scheduler, instances, commit=commit, time_limit_s=time_limit_s, workers=workers):
        if isinstance(result, Unplaced):
            outcome.unplaced.append(result)
        else:
            outcome.placements.append(result.placement)
    return outcome


# ---------------------------------------------------------------------------------------- decide, re-check


def _decide(
    s: Scheduler,
    instances: list[Instance],
    *,
    commit: Callable[[Instance, Assessment], None] | None,
    time_limit_s: float,
    workers: int,
) -> list[Assessment | Unplaced]:
    """Solve, re-check each plan in order (committing it when ``commit`` is given), cut and re-solve."""
    results: dict[int, Assessment | Unplaced] = {}
    cuts: dict[int, list[Cut]] = {}
    broken: dict[int, list[str]] = {}
    committed_nodes: dict[str, set[str]] = {}
    pending = list(range(len(instances)))
    for _round in range(CUT_ROUNDS):
        if not pending:
            break
        batch = [_with_nodes(instances[i], committed_nodes.get(instances[i].request.id, set())) for i in pending]
        choices, notes = solve(s, batch, [cuts.get(i, []) for i in pending], time_limit_s, workers)
        still: list[int] = []
        for i, inst, choice, note in zip(pending, batch, choices, notes, strict=True):
            if choice is None:
                results[i] = _unplaced(inst, [*broken.get(i, []), *note])
                continue
            checked = _recheck(s, inst, choice)
            if isinstance(checked, str):
                broken.setdefault(i, []).append(checked)
                cuts.setdefault(i, []).append((choice.index, frozenset(r for st in choice.stages for r in st)))
                still.append(i)
                continue
            if commit is not None:
                commit(inst, checked)
                committed_nodes.setdefault(inst.request.id, set()).update(r.node for r in checked.placement.ranks)
            results[i] = checked
        pending = still
    for i in pending:
        results[i] = _unplaced(instances[i], [*broken[i], f"exact: {CUT_ROUNDS} plans in a row broke a constraint"])
    return [results[i] for i in range(len(instances))]


def _with_nodes(inst: Instance, nodes: set[str]) -> Instance:
    if not nodes or not inst.request.spread_replicas:
        return inst
    return Instance(inst.request, inst.pid, inst.replica, inst.cands, inst.dropped, inst.replica_nodes | nodes)


def _unplaced(inst: Instance, reasons: Sequence[str]) -> Unplaced:
    return Unplaced(
        request_id=inst.request.id,
        replica=inst.replica,
        status="queued" if inst.cands else "rejected",
        reasons=tuple(dict.fromkeys((*inst.dropped, *reasons))),
    )


def _recheck(s: Scheduler, inst: Instance, choice: Choice) -> Assessment | str:
    """``assess`` on the chosen GPUs with the budget left now; the broken constraints as text, if any."""
    cand = choice.cand
    option = cand.option
    result = assess(
        s.index, cand.options, option, choice.stages, placement_id=inst.pid, request_id=inst.request.id,
        policy="exact", required_level=choice.level,
        budget_left_gbps=s.class_budget_left(inst.request.slo_class),
    )  # fmt: skip
    problems = [f"{c.name}: {c.detail}" for c in result.placement.constraints if not c.held and c.name != "slo"]
    layout = layout_problem(result.placement.ranks, option.tp)
    if layout is not None:
        problems.append(f"layout: {layout}")
    if problems:
        return f"tp={option.tp} pp={option.pp} on {result.placement.gpu_refs}: " + "; ".join(problems)
    return result


__all__ = ["MAX_GPUS", "check_size", "choose", "objective", "place_exact", "size_problem"]
