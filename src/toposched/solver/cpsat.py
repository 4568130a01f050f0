"""The exact policy's CP-SAT model (``solver/exact.py``): one solve over the free GPUs, with the
objective's weights.

Variables: ``use[i,o]`` (instance i runs degree option o), ``z[i,o,s,g]`` (stage s of it sits in
group g of the affinity level), ``x[i,o,s,gpu]`` (it uses that GPU). Each GPU serves at most one
stage of one instance; a stage's GPUs lie in its group.

Hard constraints, the same as the fast path's:

* capacity: an option whose memory does not fit is never offered to the model;
* domain affinity and the group filters (node type, selectors, racks/zones, spreading, required
  role affinity): a stage may only use groups of its level that ``Scheduler.group_filter`` accepts;
  replicas that must spread use disjoint nodes inside the model too;
* cross-domain budget, modelled conservatively: per option, ``any_out`` (some TP group spans NVLink
  domains) costs the most traffic any such group of the option could cause, and every pipeline
  boundary whose two stages are not surely in one NVLink domain costs one activation hand-over at
  the fastest step rate seen for the option. The sum per SLO class stays within that class's share
  left, and the sum overall within the budget left;
* launchable layout (``layout.layout_problem``): when an option may span nodes, every used node
  holds the same number ``g`` of its GPUs, ``g`` one of ``layout.per_node_choices``, and each node
  holds either whole stages (``g`` a multiple of ``tp``) or an equal share of exactly one TP group
  (``g`` divides ``tp``). Stages are then ordered by their first GPU, so each node's ranks are one
  contiguous block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ortools.sat.python import cp_model

from toposched.solver.candidates import Candidate
from toposched.solver.index import ClusterIndex, Group
from toposched.solver.layout import per_node_choices
from toposched.solver.objective import (
    W_BREAK,
    W_FIT,
    W_GPU,
    W_NUMA,
    W_SLO,
    W_UNPLACED,
    layout_cost,
)
from toposched.solver.options import DegreeOption
from toposched.solver.picking import pick_in_group
from toposched.solver.place import BF16_BYTES, assess
from toposched.solver.request import PlacementRequest

if TYPE_CHECKING:  # the scheduler calls the exact policy: no import circle at run time
    from toposched.solver.scheduler import Scheduler

# the objective's weights (the table in ``solver/exact.py``): ``solver/objective.py``
_SLACK = 1.02
"""Margin on traffic estimates (probe latencies are rounded, and the chosen GPUs may differ)."""


@dataclass(frozen=True)
class Instance:
    request: PlacementRequest
    pid: str
    replica: int
    cands: list[Candidate]
    dropped: list[str]
    replica_nodes: frozenset[str] = frozenset()


@dataclass
class _OptionVars:
    index: int  # position in the instance's candidates
    cand: Candidate
    level: str
    use: cp_model.IntVar
    stages: list[dict[str, cp_model.IntVar]]  # per stage: GPU -> x
    used: dict[str, cp_model.LinearExprT] = field(default_factory=dict)  # GPU -> sum of x over stages


@dataclass(frozen=True)
class Choice:
    index: int
    cand: Candidate
    level: str
    stages: list[list[str]]


Cut = tuple[int, frozenset[str]]


def nvlink_groups(index: ClusterIndex) -> list[tuple[str, ...]]:
    level = index.levels["nvlink"]
    return [g.gpus for g in level.groups if len(g.gpus) > 1]


@dataclass(frozen=True)
class _Slot:
    """Where one stage may go: GPUs of one group, inside one NVLink domain (``domain``) or not surely."""

    group: Group
    gpus: list[str]
    domain: str | None  # the NVLink domain all of ``gpus`` lie in; None: no domain, or several
    spans: bool  # a TP group here may span NVLink domains (charged the cross-domain TP traffic)
    misses_slo: bool
    group_free: int  # free GPUs of the whole group (the best-fit cost)


def _parts(index: ClusterIndex, room: Sequence[str], tp: int) -> list[tuple[list[str], str | None, bool]]:
    """A group's free GPUs split into slots: (GPUs, their NVLink domain, whether a TP group may span domains).

    Each domain with room for a TP group is one slot (no TP traffic leaves it); the whole group is one
    more slot when a TP group could also span domains there (several domains, or GPUs in none).
    """
    by_domain: dict[str | None, list[str]] = {}
    for r in room:
        by_domain.setdefault(index.dmap.gpu_domain.get(r), []).append(r)
    parts: list[tuple[list[str], str | None, bool]] = [
        (gpus, d, False) for d, gpus in by_domain.items() if d is not None and len(gpus) >= tp
    ]
    if tp > 1 and (len(by_domain) > 1 or None in by_domain):
        parts.append((list(room), None, True))
    elif tp == 1 and None in by_domain:
        parts.append((by_domain[None], None, False))
    return parts


def _spanning_sample(index: ClusterIndex, free_refs: Sequence[str], tp: int) -> list[str] | None:
    """``tp`` free GPUs of a group taken round-robin over its NVLink domains (so not inside one)."""
    by_domain: dict[str | None, list[str]] = {}
    for r in sorted(free_refs, key=lambda r: index.info[r].order):
        by_domain.setdefault(index.dmap.gpu_domain.get(r), []).append(r)
    picked: list[str] = []
    queues = list(by_domain.values())
    while len(picked) < tp:
        for q in queues:
            if q and len(picked) < tp:
                picked.append(q.pop(0))
    return picked


def solve(
    s: Scheduler,
    instances: list[Instance],
    cuts: list[list[Cut]],
    time_limit_s: float,
    workers: int,
) -> tuple[list[Choice | None], list[list[str]]]:
    """One CP-SAT solve over the free GPUs: a choice (or None) and notes per instance."""
    index = s.index
    free = index.free
    model = cp_model.CpModel()
    per_gpu: dict[str, list[cp_model.IntVar]] = {r: [] for r in free}
    terms: list[cp_model.LinearExprT] = []
    traffic: dict[str, list[cp_model.LinearExprT]] = {}  # SLO class -> MB/s estimates
    node_use: dict[tuple[str, str], dict[int, list[cp_model.IntVar]]] = {}  # (request id, node) -> i -> x
    all_options: list[list[_OptionVars]] = []
    notes: list[list[str]] = []
    for i, inst in enumerate(instances):
        request = inst.request
        here: list[_OptionVars] = []
        note: list[str] = []
        for o, cand in enumerate(inst.cands):
            built = _option(model, s, inst, i, o, cand, per_gpu, terms, note)
            if built is None:
                continue
            ov, estimate = built
            if estimate is not None:
                traffic.setdefault(request.slo_class, []).append(estimate)
            if request.spread_replicas and request.replicas > 1:
                for xs in ov.stages:
                    for r, x in xs.items():
                        node_use.setdefault((request.id, index.info[r].node), {}).setdefault(i, []).append(x)
            for idx, refs in cuts[i]:
                if idx == o:
                    model.add(sum(ov.used[r] for r in refs if r in ov.used) <= len(refs) - 1)
            here.append(ov)
        uses = [ov.use for ov in here]
        if uses:
            model.add(sum(uses) <= 1)
            terms.append(W_UNPLACED * (1 + request.priority) * (1 - sum(uses)))
        all_options.append(here)
        notes.append(note)
    for xs_list in per_gpu.values():
        if len(xs_list) > 1:
            model.add(sum(xs_list) <= 1)
    _spread(model, node_use)
    _budget(model, s, traffic)
    for group in nvlink_groups(index):
        if all(r in free for r in group):
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
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return [None] * len(instances), [[*n, "CP-SAT found no solution in time"] for n in notes]
    choices: list[Choice | None] = []
    for here, note in zip(all_options, notes, strict=True):
        picked = next((ov for ov in here if solver.value(ov.use)), None)
        if picked is None:
            note.append(
                "no room in the optimal plan that keeps capacity, the cross-domain budget, a launchable layout "
                "and the group filters"
            )
            note.extend(s.why_not(min((ov.cand.option.tp for ov in here), default=1)))
            choices.append(None)
            continue
        stages = [
            sorted((r for r, x in xs.items() if solver.value(x)), key=lambda r: index.info[r].order)
            for xs in picked.stages
        ]
        stages.sort(key=lambda st: index.info[st[0]].order)  # each node's ranks in one contiguous block
        choices.append(Choice(picked.index, picked.cand, picked.level, stages))
    return choices, notes


def _option(
    model: cp_model.CpModel,
    s: Scheduler,
    inst: Instance,
    i: int,
    o: int,
    cand: Candidate,
    per_gpu: dict[str, list[cp_model.IntVar]],
    terms: list[cp_model.LinearExprT],
    note: list[str],
) -> tuple[_OptionVars, cp_model.LinearExprT | None] | None:
    """Variables and costs of one degree option of one instance, with its traffic estimate (MB/s)."""
    index, request, option = s.index, inst.request, cand.option
    tp, pp = option.tp, option.pp
    free = index.free
    level = index.resolve_level(request.affinity, tp)
    accept = s.group_filter(request, cand.nodes, set(inst.replica_nodes))
    groups: list[tuple[Group, list[str]]] = []
    for g in index.levels[level].groups:
        if accept(g):
            room = [r for r in g.gpus if r in free]
            if len(room) >= tp:
                groups.append((g, room))
    what = f"tp={tp} pp={pp} on {cand.options.gpu.name}"
    if sum(len(room) for _, room in groups) < tp * pp:  # groups may overlap: a bound, not a check
        note.append(f"{what}: no {level} group with {tp} free GPUs for each of {pp} stage(s)")
        return None
    # slots: where a stage may go (a group, or the part of it inside one NVLink domain), each probed
    # for latency and traffic on a launchable sample
    tpots: list[float] = []
    batches: list[int] = []  # the running batch of each probe (its operating point)
    out_per_step = 0.0  # GB per step of traffic when a TP group spans NVLink domains
    slots: list[_Slot] = []
    for g, room in groups:
        for part, dom, spans in _parts(index, room, tp):
            sample = _spanning_sample(index, part, tp) if spans else pick_in_group(index, part, tp)
            if sample is None:
                continue
            probe = assess(
                index, cand.options, option, [sample] * pp, placement_id="probe", request_id=request.id,
                policy="exact", required_level=level, budget_left_gbps=float("inf"),
            )  # fmt: skip
            capacity = probe.placement.check("capacity")
            if not capacity.held:
                note.append(f"{what}: {capacity.detail}: not enough KV left")
                return None
            slots.append(_Slot(g, part, dom, spans, not probe.meets_slo, len(room)))
            tpots.append(probe.placement.tpot_ms)
            batches.append(probe.placement.max_num_seqs or option.max_batch)
            if spans:
                out_per_step = max(out_per_step, probe.cross_gbps * probe.placement.tpot_ms / 1000)
    if not slots:
        note.append(f"{what}: no launchable set of {tp} GPUs in any {level} group")
        return None
    position = {n.name: k for k, n in enumerate(index.cluster.nodes)}
    nodes_here = sorted({n for slot in slots for n in slot.group.nodes}, key=position.__getitem__)
    free_on = {n: sum(1 for r in free if index.info[r].node == n) for n in nodes_here}
    shares = per_node_choices(tp, pp, list(free_on.values())) if len(nodes_here) > 1 else [tp * pp]
    if not shares:
        note.append(f"{what}: no launchable split over nodes with {sorted(free_on.values())} free GPUs")
        return None

    use = model.new_bool_var(f"use_{i}_{o}")
    terms.append((W_GPU * option.gpus + layout_cost(request, len(option.fallbacks), pp)) * use)
    ov = _OptionVars(o, cand, level, use, [])
    stage_in: list[dict[str, cp_model.LinearExprT]] = []  # per stage: NVLink domain -> "lies in it"
    misses: list[cp_model.IntVar] = []
    out_flags: list[cp_model.IntVar] = []
    for st in range(pp):
        zs: list[tuple[cp_model.IntVar, _Slot]] = []
        for k, slot in enumerate(slots):
            z = model.new_bool_var(f"z_{i}_{o}_{st}_{k}")
            zs.append((z, slot))
            terms.append(W_FIT * slot.group_free * z)
            if slot.misses_slo:
                misses.append(z)
            if slot.spans:
                out_flags.append(z)
        model.add(sum(z for z, _ in zs) == use)
        in_slots: dict[str, list[cp_model.IntVar]] = {}
        for z, slot in zs:
            for r in slot.gpus:
                in_slots.setdefault(r, []).append(z)
        xs: dict[str, cp_model.IntVar] = {}
        for r, zlist in in_slots.items():
            x = model.new_bool_var(f"x_{i}_{o}_{st}_{r}")
            model.add(x <= sum(zlist))
            xs[r] = x
            per_gpu[r].append(x)
        model.add(sum(xs.values()) == tp * use)
        for z, slot in zs:  # every chosen GPU lies in the chosen slot
            model.add(sum(xs[r] for r in slot.gpus) >= tp * z)
        by_domain: dict[str, list[cp_model.IntVar]] = {}
        for z, slot in zs:
            if slot.domain is not None:
                by_domain.setdefault(slot.domain, []).append(z)
        stage_in.append({d: sum(zl) for d, zl in by_domain.items()})
        numas = sorted({index.info[r].numa for r in xs}, key=lambda n: -1 if n is None else n)
        if len(numas) > 1:
            numa_flags = []
            for n in numas:
                y = model.new_bool_var(f"numa_{i}_{o}_{st}_{n}")
                for r, x in xs.items():
                    if index.info[r].numa == n:
                        model.add(y >= x)
                numa_flags.append(y)
            terms.append(W_NUMA * (sum(numa_flags) - use))
        ov.stages.append(xs)
    for r in {r for xs in ov.stages for r in xs}:
        ov.used[r] = sum(xs[r] for xs in ov.stages if r in xs)
    if misses:
        missed = model.new_bool_var(f"miss_{i}_{o}")
        for z in misses:
            model.add(missed >= z)
        terms.append(W_SLO * missed)
    if len(nodes_here) > 1:
        _layout(model, index, ov, nodes_here, shares, f"{i}_{o}")
    estimate = _traffic(model, option, max(batches), ov, stage_in, out_flags, tpots, out_per_step, f"{i}_{o}")
    if out_per_step > 0:
        worst = out_per_step * 1000.0 / min(tpots)
        left = s.class_budget_left(request.slo_class)
        if worst > left:
            note.append(
                f"{what}: a TP group spanning NVLink domains here moves about {worst:.2f} GB/s cross-domain, "
                f"{left:.2f} GB/s left in the budget for class {request.slo_class}"
            )
    return ov, estimate


def _traffic(
    model: cp_model.CpModel,
    option: DegreeOption,
    batch: int,
    ov: _OptionVars,
    stage_in: list[dict[str, cp_model.LinearExprT]],
    out_flags: list[cp_model.IntVar],
    tpots: list[float],
    out_per_step: float,
    tag: str,
) -> cp_model.LinearExprT | None:
    """Conservative cross-domain MB/s of this option: spanning TP groups plus crossing stage boundaries."""
    steps = 1000.0 / min(tpots) * _SLACK  # the fastest step rate seen for this option
    parts: list[cp_model.LinearExprT] = []
    if out_flags and out_per_step > 0:
        any_out = model.new_bool_var(f"out_{tag}")
        for z in out_flags:
            model.add(any_out >= z)
        parts.append(math.ceil(out_per_step * steps * 1000) * any_out)
    # each stage hands the running batch's activations on per step (the largest the probes ran at)
    handover_mbps = math.ceil(batch * option.spec.hidden_size * BF16_BYTES * steps / 1e6)
    for st in range(len(stage_in) - 1):
        a, b = stage_in[st], stage_in[st + 1]
        same = []
        for d in set(a) & set(b):
            y = model.new_bool_var(f"same_{tag}_{st}_{d}")
            model.add(y <= a[d])
            model.add(y <= b[d])
            same.append(y)
        crossing = model.new_bool_var(f"cross_{tag}_{st}")
        model.add(crossing >= ov.use - sum(same))
        parts.append(handover_mbps * crossing)
    return sum(parts) if parts else None


def _layout(
    model: cp_model.CpModel, index: ClusterIndex, ov: _OptionVars, nodes: list[str], shares: list[int], tag: str
) -> None:
    """Every used node holds ``g`` GPUs (one of ``shares``): whole stages, or a share of one TP group."""
    tp = ov.cand.option.tp
    sel = {g: model.new_bool_var(f"share_{tag}_{g}") for g in shares}
    model.add(sum(sel.values()) == ov.use)
    for n in nodes:
        per_stage = [sum(x for r, x in xs.items() if index.info[r].node == n) for xs in ov.stages]
        picks = {g: model.new_bool_var(f"on_{tag}_{n}_{g}") for g in shares}
        model.add(sum(picks.values()) <= 1)
        for g, y in picks.items():
            model.add(y <= sel[g])
        model.add(sum(per_stage) == sum(g * y for g, y in picks.items()))
        for st, count in enumerate(per_stage):
            here = model.new_bool_var(f"stage_{tag}_{n}_{st}")
            for g in shares:
                block = tp if g % tp == 0 else g
                model.add(count == block * here).only_enforce_if(sel[g])


def _spread(model: cp_model.CpModel, node_use: dict[tuple[str, str], dict[int, list[cp_model.IntVar]]]) -> None:
    """Replicas of a request that must spread use different nodes: at most one instance per node."""
    for (rid, node), per_instance in node_use.items():
        if len(per_instance) < 2:
            continue
        flags = []
        for i, xs in per_instance.items():
            u = model.new_bool_var(f"node_{rid}_{i}_{node}")
            for x in xs:
                model.add(u >= x)
            flags.append(u)
        model.add(sum(flags) <= 1)


def _budget(model: cp_model.CpModel, s: Scheduler, traffic: dict[str, list[cp_model.LinearExprT]]) -> None:
    """Per SLO class within its share left, and all together within the budget left (MB/s, floored)."""
    if not traffic:
        return
    for cls, parts in traffic.items():
        model.add(sum(parts) <= math.floor(s.class_budget_left(cls) * 1000))
    total_left = max(0.0, s.budget_gbps - sum(s.cross_used.values()))
    model.add(sum(p for parts in traffic.values() for p in parts) <= math.floor(total_left * 1000))


__all__ = [  # the objective's weights: solver/objective.py
    "Choice",
    "Cut",
    "Instance",
    "nvlink_groups",
    "solve",
]
