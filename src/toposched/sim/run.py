"""Run a scenario under several policies on the same workload and collect the metrics.

Each policy gets a fresh scheduler and ledger on the same cluster, the same pre-drawn requests (or
trace) and, in churn scenarios, the same instance arrivals and per-instance request streams (seeded
by the run's seed). Metric definitions: ``sim/metrics.py`` and docs/simulator.md.

A disaggregated scenario (``Scenario.pd``) runs once per policy and layout, on the same requests;
its results are named ``POLICY/LAYOUT`` (``slo/rack-local``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from toposched.errors import InputError, InvariantError
from toposched.ledger.base import GIB
from toposched.sim.deployment import Deployment, build_deployment, label_nodes, place_pd_layout
from toposched.sim.disaggregated import PdSimulation
from toposched.sim.engine import Simulation
from toposched.sim.loading import load_cluster
from toposched.sim.metrics import DomainOccupancy, check_conservation, compute, per_token_ms
from toposched.sim.oracle import placement_policy
from toposched.sim.scenario import MAX_INSTANCES, PdLayout, Scenario, expected_instance_arrivals
from toposched.sim.workload import SimRequest, make_arrivals, read_trace
from toposched.solver.pd import cluster_kv_links
from toposched.solver.scheduler import Scheduler
from toposched.topology.model import Cluster


def check_scenario_fits(scenario: Scenario, cluster: Cluster, *, source: str | None = None) -> None:
    """Refuse what the cluster cannot mean: failures of GPUs it does not have, more instances than GPUs.

    ``source`` names the scenario in errors (the file or built-in name; default: its ``name``).
    """
    where = source or f"scenario {scenario.name!r}"
    gpus = {f"{n.name}/{g.index}" for n in cluster.nodes for g in n.gpus}
    for k, failure in enumerate(scenario.failures):
        if failure.gpu not in gpus:
            raise InputError(
                f"{where}: failures.{k}.gpu: {failure.gpu!r} is not a GPU of cluster {scenario.cluster!r}",
                fix="use 'node/index' of a GPU in the cluster, e.g. " + next(iter(sorted(gpus)), "node-0/0"),
            )
    if scenario.instances != "max" and int(scenario.instances) > len(gpus):
        raise InputError(
            f"{where}: instances {scenario.instances} is more than the {len(gpus)} GPUs "
            f"of cluster {scenario.cluster!r}",
            fix="use instances: max, or at most one instance per GPU",
        )


def deployments_for(scenario: Scenario, scheduler: Scheduler, *, source: str | None = None) -> list[Deployment]:
    """The scenario's tenants on this cluster; a churn run's expected instance count is bounded."""
    where = source or f"scenario {scenario.name!r}"
    deps = [build_deployment(k, t, scheduler, where=where) for k, t in enumerate(scenario.tenant_list())]
    churn = scenario.churn
    if churn is not None:
        weights = [d.tenant.weight for d in deps]
        mean_gpus = sum(d.ref_gpus * w for d, w in zip(deps, weights, strict=True)) / sum(weights)
        gpus = len(scheduler.index.info)
        expected = expected_instance_arrivals(churn, gpus, mean_gpus, scenario.instance_startup_s)
        if expected > MAX_INSTANCES:
            raise InputError(
                f"{where}: churn would bring about {expected:,.0f} instance arrivals (at most {MAX_INSTANCES:,})",
                fix="shorten churn.duration_s, lengthen churn.mean_lifetime_s or lower churn.occupancy",
            )
    return deps


@dataclass
class PolicyResult:
    policy: str
    metrics: dict[str, Any]
    per_token_ms: list[float]
    timeline: list[tuple[float, int, int]]  # (time s, waiting requests, running requests)
    wall_s: float
    events: int
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    gpu_series: list[tuple[float, int, float, int, int]] = field(default_factory=list)
    finish_s: dict[int, float] = field(default_factory=dict)  # request id -> time of its last token
    occupancy: DomainOccupancy | None = None  # GPUs held per NVLink domain, sampled (None: no sample taken)


def _fresh(requests: list[SimRequest]) -> list[SimRequest]:
    """Unstarted copies (a run mutates its requests)."""
    return [SimRequest(r.id, r.arrival_s, r.input_len, r.output_len, r.slo_class, tenant=r.tenant) for r in requests]


def run_policy(
    scenario: Scenario,
    policy: str,
    *,
    seed: int = 0,
    arrivals: list[SimRequest] | None = None,
    progress: Callable[[Simulation], None] | None = None,
    jump: bool = True,
    layout: PdLayout | None = None,
) -> PolicyResult:
    """One policy over the scenario; raises ``InvariantError`` when conservation breaks.

    ``jump=False`` steps every instance one engine step per event (the macro-step check).
    ``layout``: a disaggregated scenario's layout (default: its first).
    """
    cluster = load_cluster(scenario.cluster)
    check_scenario_fits(scenario, cluster)
    pd = scenario.pd
    if pd is not None:
        cluster = label_nodes(cluster)
    # the tenants' SLO factors were set on the design batch's figures (sim/deployment.py)
    scheduler = Scheduler(cluster, budget_gbps=scenario.budget_gbps, seed=seed, prediction="design-batch")
    deployments = deployments_for(scenario, scheduler)
    work = _fresh(arrivals if arrivals is not None else make_arrivals(scenario, seed))
    sim: Simulation
    if pd is not None:
        where = f"scenario {scenario.name!r}"
        plan = place_pd_layout(
            scheduler, deployments[0].template, pd, layout or pd.layouts[0], placement_policy(policy), where=where
        )
        gpu = scheduler.gpu_of_node[plan.prefills[0][0].ranks[0].node]
        links = cluster_kv_links(cluster, gpu, oversubscription=pd.oversubscription)
        sim = PdSimulation(scenario, scheduler, deployments, policy, seed, plan, links, jump=jump)
    else:
        sim = Simulation(scenario, scheduler, deployments, policy, seed, jump=jump)
    start, cpu = time.perf_counter(), time.process_time()
    sim.run(work, progress)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    problems = check_conservation(sim)
    if problems:
        raise InvariantError(f"conservation broken in policy {policy}: {'; '.join(problems)}")
    metrics = compute(sim)
    metrics["wall_s"] = round(wall, 3)
    metrics["cpu_s"] = round(cpu, 3)
    metrics["events_per_s"] = round(sim.events_done / wall) if wall > 0 else None
    done = [r for r in sim.requests if r.state == "done"]
    return PolicyResult(
        policy,
        metrics,
        [per_token_ms(r) for r in done],
        sim.timeline,
        wall,
        sim.events_done,
        ttft_ms=[1000.0 * r.ttft_s for r in done],
        tpot_ms=[1000.0 * (r.finish_s - r.first_token_s) / (r.output_len - 1) for r in done if r.output_len > 1],
        gpu_series=sim.gpu_series,
        finish_s={r.id: r.finish_s for r in done},
        occupancy=sim.occupancy.result(sim.end_s) if sim.occupancy is not None else None,
    )


def simulate(
    scenario: Scenario,
    policies: list[str],
    *,
    seed: int = 0,
    progress: Callable[[str, Simulation], None] | None = None,
) -> dict[str, PolicyResult]:
    """The same seeded workload under each policy."""
    arrivals = make_arrivals(scenario, seed)
    results: dict[str, PolicyResult] = {}
    for name, policy, layout in planned_runs(scenario, policies):
        hook = (lambda s, p=policy: progress(p, s)) if progress is not None else None
        results[name] = run_policy(scenario, policy, seed=seed, arrivals=arrivals, progress=hook, layout=layout)
    return results


def planned_runs(scenario: Scenario, policies: list[str]) -> list[tuple[str, str, PdLayout | None]]:
    """(result name, policy, layout) of each run ``simulate`` makes: one per policy, one per policy and
    layout in a disaggregated scenario (``policy/layout``)."""
    layouts: tuple[PdLayout | None, ...] = scenario.pd.layouts if scenario.pd is not None else (None,)
    return [(p if lay is None else f"{p}/{lay}", p, lay) for p in policies for lay in layouts]


__all__ = [
    "GIB",
    "PolicyResult",
    "check_conservation",
    "check_scenario_fits",
    "deployments_for",
    "make_arrivals",
    "planned_runs",
    "read_trace",
    "run_policy",
    "simulate",
]
