"""Exact baseline: the placement objective as an OR-Tools CP-SAT model, for small clusters and batches.

The same objective the fast ``slo`` policy follows greedily, as one weighted sum (lexicographic by
the size of the weights), so the two can be compared on equal terms (``objective``):

    1e9  per instance left unplaced (x (1 + priority))
    1e8  per placed instance whose predicted latency misses its SLO
    1e6  per GPU used                                   -- the SLO with the fewest GPUs
    1e4  per NVLink group that was entirely free and is not afterwards  -- keep large blocks whole
    10   per free GPU in each chosen group before placing (tighter fit is cheaper)
    1    per extra NUMA node a TP group spans            -- locality inside the domain

Variables: ``use[i,o]`` (instance i runs degree option o), ``z[i,o,s,g]`` (stage s of it sits in
group g of the affinity level), ``x[i,o,s,gpu]`` (it uses that GPU). Each GPU serves at most one
stage of one instance; a stage's GPUs lie in its group. Latency per option is predicted over the
link its level implies (as the fast solver would see it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from toposched.errors import InfeasibleError
from toposched.solver.index import ClusterIndex
from toposched.solver.place import assess
from toposched.solver.request import Placement, PlacementRequest, Unplaced
from toposched.solver.scheduler import Candidate, Outcome, Scheduler

W_UNPLACED = 10**9
W_SLO = 10**8
W_GPU = 10**6
W_BREAK = 10**4
W_FIT = 10
W_NUMA = 1
MAX_GPUS = 128


@dataclass(frozen=True)
class _Instance:
    request: PlacementRequest
    pid: str
    cands: list[Candidate]


def _nvlink_groups(index: ClusterIndex) -> list[tuple[str, ...]]:
    level = index.levels["nvlink"]
    return [g.gpus for g in level.groups if len(g.gpus) > 1]


def objective(
    index_before: ClusterIndex,
    placements: Sequence[Placement],
    unplaced: Sequence[Unplaced],
    priorities: dict[str, int],
) -> int:
    """The cost of an outcome on the free GPUs it started from (lower is better)."""
    free = index_before.free
    used: set[str] = set()
    cost = sum(W_UNPLACED * (1 + priorities.get(u.request_id, 0)) for u in unplaced)
    for p in placements:
        refs = p.gpu_refs
        used.update(refs)
        cost += W_GPU * len(refs)
        if not next(c for c in p.constraints if c.name == "slo").held:
            cost += W_SLO
        for s in range(p.pp):
            stage = [f"{r.node}/{r.gpu}" for r in p.ranks if r.stage == s]
            cost += W_NUMA * (len({index_before.info[r].numa for r in stage}) - 1)
            level = index_before.levels[p.level]
            groups = [g for g in level.of_gpu.get(stage[0], []) if all(g in level.of_gpu.get(r, []) for r in stage)]
            if groups:
                cost += W_FIT * min(sum(1 for r in level.groups[g].gpus if r in free) for g in groups)
    for group in _nvlink_groups(index_before):
        if all(r in free for r in group) and any(r in used for r in group):
            cost += W_BREAK
    return cost


def place_exact(
    scheduler: Scheduler, requests: Sequence[PlacementRequest], *, time_limit_s: float = 20.0, workers: int = 2
) -> Outcome:
    """Place a batch of requests optimally (within ``time_limit_s``) and commit the result."""
    index = scheduler.index
    if len(index.info) > MAX_GPUS:
        raise InfeasibleError(
            f"--policy exact is for clusters of at most {MAX_GPUS} GPUs (this one has {len(index.info)})",
            fix="use --policy slo",
        )
    instances: list[_Instance] = []
    for request in requests:
        scheduler._class_of[request.id] = request.slo_class
        cands, _ = scheduler.candidates(request)
        for replica in range(request.replicas):
            pid = f"{request.id}-{replica}" if request.replicas > 1 else request.id
            instances.append(_Instance(request, pid, cands))

    model = cp_model.CpModel()
    free = sorted(index.free, key=lambda r: index.info[r].order)
    per_gpu: dict[str, list[cp_model.IntVar]] = {r: [] for r in free}
    terms: list[cp_model.LinearExprT] = []
    chosen_vars: list[list[tuple[Candidate, str, cp_model.IntVar, list[dict[str, cp_model.IntVar]]]]] = []
    for i, inst in enumerate(instances):
        options_here = []
        uses = []
        for o, cand in enumerate(inst.cands):
            option = cand.option
            level = index.resolve_level(inst.request.affinity, option.tp)
            accept = scheduler.group_filter(inst.request, cand.nodes, set())
            groups = [
                g
                for g in index.levels[level].groups
                if accept(g) and sum(1 for r in g.gpus if r in index.free) >= option.tp
            ]
            if len(groups) == 0:
                continue
            use = model.new_bool_var(f"use_{i}_{o}")
            uses.append(use)
            # latency over the link the level implies, judged on a representative group
            sample = [r for r in groups[0].gpus if r in index.free][: option.tp]
            probe = assess(
                index, cand.options, option, [sample] * option.pp, placement_id="probe",
                request_id=inst.request.id, policy="exact",
                required_level=level, budget_left_gbps=float("inf"),
            )  # fmt: skip
            terms.append(W_GPU * option.gpus * use)
            if not probe.meets_slo:
                terms.append(W_SLO * use)
            stage_x: list[dict[str, cp_model.IntVar]] = []
            for s in range(option.pp):
                zs = {}
                for g_i, g in enumerate(groups):
                    z = model.new_bool_var(f"z_{i}_{o}_{s}_{g_i}")
                    zs[g.id] = (z, g)
                    free_in_g = sum(1 for r in g.gpus if r in index.free)
                    terms.append(W_FIT * free_in_g * z)
                model.add(sum(z for z, _ in zs.values()) == use)
                xs: dict[str, cp_model.IntVar] = {}
                in_groups: dict[str, list[cp_model.IntVar]] = {}
                for z, g in zs.values():
                    for r in g.gpus:
                        if r in index.free:
                            in_groups.setdefault(r, []).append(z)
                for r, zlist in in_groups.items():
                    x = model.new_bool_var(f"x_{i}_{o}_{s}_{r}")
                    model.add(x <= sum(zlist))
                    xs[r] = x
                    per_gpu[r].append(x)
                model.add(sum(xs.values()) == option.tp * use)
                # group membership: every chosen GPU lies in the chosen group
                for z, g in zs.values():
                    inside = [xs[r] for r in g.gpus if r in xs]
                    model.add(sum(inside) >= option.tp * z)
                numas = sorted({index.info[r].numa for r in xs}, key=lambda n: -1 if n is None else n)
                if len(numas) > 1:
                    spans = []
                    for n in numas:
                        y = model.new_bool_var(f"numa_{i}_{o}_{s}_{n}")
                        for r, x in xs.items():
                            if index.info[r].numa == n:
                                model.add(y >= x)
                        spans.append(y)
                    terms.append(W_NUMA * (sum(spans) - use))
                stage_x.append(xs)
            options_here.append((cand, level, use, stage_x))
        if uses:
            model.add(sum(uses) <= 1)
            terms.append(W_UNPLACED * (1 + inst.request.priority) * (1 - sum(uses)))
        else:
            terms.append(W_UNPLACED * (1 + inst.request.priority))
        chosen_vars.append(options_here)
    for xs_list in per_gpu.values():
        if len(xs_list) > 1:
            model.add(sum(xs_list) <= 1)
    for group in _nvlink_groups(index):
        if all(r in index.free for r in group):
            broken = model.new_bool_var(f"broken_{group[0]}")
            for r in group:
                for x in per_gpu.get(r, []):
                    model.add(broken >= x)
            terms.append(W_BREAK * broken)
    model.minimize(sum(terms))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = 0
    status = solver.solve(model)
    outcome = Outcome()
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        for inst in instances:
            outcome.unplaced.append(
                Unplaced(request_id=inst.request.id, replica=0, status="queued", reasons=("CP-SAT found no solution",))
            )
        return outcome
    for inst, options_here in zip(instances, chosen_vars, strict=True):
        picked = next(((c, lv, sx) for c, lv, use, sx in options_here if solver.value(use)), None)
        if picked is None:
            outcome.unplaced.append(
                Unplaced(
                    request_id=inst.request.id,
                    replica=0,
                    status="queued",
                    reasons=("no room in the optimal batch plan",),
                )
            )
            continue
        cand, level, stage_x = picked
        stages = [
            sorted((r for r, x in xs.items() if solver.value(x)), key=lambda r: index.info[r].order) for xs in stage_x
        ]
        result = assess(
            index, cand.options, cand.option, stages, placement_id=inst.pid, request_id=inst.request.id, policy="exact",
            required_level=level, budget_left_gbps=scheduler._class_budget_left(inst.request.slo_class),
        )  # fmt: skip
        scheduler.commit(result)
        outcome.placements.append(result.placement)
    return outcome
