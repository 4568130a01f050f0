"""``toposched simulate``: compare placement policies on a whole cluster with a simulated workload."""

from __future__ import annotations

from pathlib import Path

import typer

from toposched.cli._common import console, err_console, print_json
from toposched.cli.calibrate import PROFILE, profile_option
from toposched.cli.progress import QUIET, Reporter
from toposched.errors import InputError
from toposched.perf.profile import use_profile
from toposched.sim.builtin_scenarios import SCENARIOS
from toposched.sim.engine import Simulation
from toposched.sim.loading import load_cluster, load_scenario
from toposched.sim.oracle import ORACLE, check_sim_policy
from toposched.sim.report import LATENCY, TTFT_ALL, result_json, result_table, tenant_lines, write_report
from toposched.sim.run import PolicyResult, check_scenario_fits, planned_runs, run_policy
from toposched.sim.scenario import MAX_REQUESTS, Scenario
from toposched.sim.workload import make_arrivals
from toposched.solver.policies import POLICIES


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)


def simulate(
    scenario: str = typer.Option(..., "--scenario", help=f"Built-in ({', '.join(SCENARIOS.names())}) or a YAML file."),
    policies: str = typer.Option(
        "index-order,random,latency,slo",
        "--policies",
        help=f"Comma-separated policies: {'|'.join([*POLICIES.names(), ORACLE])} (oracle: slo with free, "
        "instant repacking, a reference bound).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed for the workload and the random policy."),
    requests: int | None = typer.Option(
        None, "--requests", help="Override the scenario's request count (churn: the most requests drawn)."
    ),
    occupancy: float | None = typer.Option(
        None, "--occupancy", help="Churn scenarios: offered occupancy (share of the cluster's GPU time), 0-2."
    ),
    profile: Path | None = PROFILE,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    out: Path | None = typer.Option(None, "--out", help="Write PNG plots and report.md/report.html here."),
    quiet: bool = QUIET,
) -> None:
    """Run the same seeded workload under each policy and compare latency, SLO attainment and locality."""
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if not names:
        raise InputError("--policies is empty", fix="e.g. --policies random,slo")
    names = [check_sim_policy(name) for name in names]  # unknown names fail here with the valid ones
    if out is not None:  # before the run, which may take minutes
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--out {str(out)[:80]!r}: cannot use it as a folder ({exc.strerror})") from None
    sc = load_scenario(scenario)
    cluster = load_cluster(sc.cluster)
    check_scenario_fits(sc, cluster, source=scenario)  # before any work: failures and instances the cluster has
    if "exact" in names:
        from toposched.solver.exact import size_problem

        problem = size_problem(f"scenario {sc.name!r}", sum(len(n.gpus) for n in cluster.nodes))
        if problem:
            raise InputError(
                f"--policies exact: {problem}", fix="drop exact from --policies, or use a scenario on a smaller cluster"
            )
    if requests is not None:
        if not 1 <= requests <= MAX_REQUESTS:
            raise InputError(f"--requests must be from 1 to {MAX_REQUESTS:,} (got {requests})")
        sc = sc.model_copy(update={"requests": requests})
    if occupancy is not None:
        if sc.churn is None:
            raise InputError(
                f"--occupancy: scenario {sc.name!r} has no churn", fix="use a churn scenario, e.g. --scenario churn-128"
            )
        if not (0 < occupancy <= 2):
            raise InputError(f"--occupancy must be above 0 and at most 2 (got {occupancy:g})")
        sc = sc.model_copy(update={"churn": sc.churn.model_copy(update={"occupancy": occupancy})})
    with use_profile(profile_option(profile)):  # reports may predict too: keep it until the end
        results = _run(sc, names, seed, quiet)
        if json_out:
            print_json(result_json(sc, seed, results))
        else:
            console.print(result_table(sc, results, console.width))
            console.print(f"latency = {LATENCY}")
            if sc.pd is None:  # the disaggregated table has no such row
                console.print(TTFT_ALL, markup=False)
            for line in tenant_lines(results):
                console.print(line, markup=False, soft_wrap=True)
        if out is not None:
            for path in write_report(out, sc, seed, results):
                err_console.print(f"wrote {path}", markup=False)


def _run(sc: Scenario, names: list[str], seed: int, quiet: bool) -> dict[str, PolicyResult]:
    """Each run, one progress stage per policy (per policy and layout in a disaggregated scenario:
    ``cli/progress.py``; none with ``quiet``). The arrivals are drawn once and every run serves them, as
    ``sim.run.simulate`` does, so the results are those of one call with every policy."""
    churn = sc.churn
    total = churn.duration_s if churn is not None else float(sc.request_count)
    arrivals = make_arrivals(sc, seed)
    runs = planned_runs(sc, names)
    results: dict[str, PolicyResult] = {}
    with Reporter("simulate", quiet=quiet) as progress:
        for i, (key, name, layout) in enumerate(runs, 1):
            progress.stage(f"policy {key}", step=(i, len(runs)), total=total)

            def hook(sim: Simulation) -> None:
                progress.update(sim.now if churn is not None else len(sim.requests))  # simulated s, or arrivals

            results[key] = run_policy(sc, name, seed=seed, arrivals=arrivals, progress=hook, layout=layout)
    return results
