"""Run a scenario under several policies on the same workload and collect the metrics.

Latency definitions (seed 000 reports one "P99 latency" per run against a 100 ms SLO for a
per-token target): **per-token latency** of a request = its end-to-end time (arrival to last
token, queueing included) divided by its output tokens. ``p50_ms``/``p99_ms`` are percentiles of
that over completed requests; ``slo_attainment`` is the share of all requests (completed or not)
whose per-token latency met their SLO. TTFT (arrival to first token) and TPOT (decode time per
token after the first) percentiles are reported too.
"""

from __future__ import annotations

import csv
import io
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from toposched.errors import InputError
from toposched.inputs import read_text
from toposched.ledger.base import GIB
from toposched.sim.engine import SimRequest, Simulation
from toposched.sim.scenario import MAX_REQUESTS, MAX_SECONDS, Lengths, Scenario, load_cluster
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.model import Cluster

SLO_CLASSES = ("realtime", "interactive", "standard", "batch")
MAX_TOKENS = 1_000_000
"""Longest input or output of one trace request (the bound of a scenario's lengths)."""


def _length(rng: random.Random, spec: Lengths) -> int:
    if spec.dist == "fixed":
        return spec.mean
    lo, hi = spec.mean * (1 - spec.spread), spec.mean * (1 + spec.spread)
    return max(1, round(rng.uniform(lo, hi)))


def make_arrivals(scenario: Scenario, seed: int) -> list[SimRequest]:
    """The workload: seeded Poisson or bursty arrivals, or a CSV trace."""
    if scenario.trace:
        return read_trace(scenario.trace)
    rng = random.Random(seed)
    classes = list(scenario.slo_mix)
    weights = [scenario.slo_mix[c] for c in classes]
    a = scenario.arrivals
    out: list[SimRequest] = []
    t = 0.0
    for i in range(scenario.requests):
        rate = a.rate_per_s
        if a.kind == "bursty" and (t % a.burst_every_s) < a.burst_length_s:
            rate *= a.burst_factor
        t += rng.expovariate(rate)
        out.append(
            SimRequest(
                id=i,
                arrival_s=t,
                input_len=_length(rng, scenario.input_len),
                output_len=_length(rng, scenario.output_len),
                slo_class=rng.choices(classes, weights)[0],
            )
        )
    return out


TRACE_COLUMNS = ("timestamp", "input_len", "output_len", "slo_class")


def _trace_row(row: list[str], column: dict[str, int], where: str, id_: int) -> SimRequest:
    """One CSV row as a request; InputError naming the file, line and column otherwise."""
    values: dict[str, str] = {}
    for name in TRACE_COLUMNS:
        at = column[name]
        if at >= len(row) or not row[at].strip():
            raise InputError(f"{where}: no value in column {name!r}", fix="give every column a value")
        values[name] = row[at].strip()
    try:
        arrival = float(values["timestamp"])
    except ValueError:
        raise InputError(f"{where}: timestamp {values['timestamp'][:40]!r} is not a number of seconds") from None
    if not (math.isfinite(arrival) and 0 <= arrival <= MAX_SECONDS):
        raise InputError(f"{where}: timestamp {values['timestamp'][:40]!r} must be from 0 to {MAX_SECONDS:g} s")
    lengths = []
    for name in ("input_len", "output_len"):
        text = values[name]
        if not (text.isascii() and text.isdigit() and len(text) <= 7 and 1 <= int(text) <= MAX_TOKENS):
            raise InputError(f"{where}: {name} {text[:40]!r} must be a whole number from 1 to {MAX_TOKENS:,}")
        lengths.append(int(text))
    slo = values["slo_class"]
    if slo not in SLO_CLASSES:
        raise InputError(f"{where}: slo_class {slo[:40]!r} is not one of {', '.join(SLO_CLASSES)}")
    return SimRequest(id=id_, arrival_s=arrival, input_len=lengths[0], output_len=lengths[1], slo_class=slo)


def read_trace(path: str) -> list[SimRequest]:
    """CSV with a header: timestamp,model,input_len,output_len,slo_class (timestamps in seconds).

    Read through ``toposched.inputs`` (a bounded regular UTF-8 file); at most ``MAX_REQUESTS``
    rows; every value is checked (finite timestamps, whole token counts, known SLO classes) and a
    bad row is one InputError naming the file and the line.
    """
    if not path or "\x00" in path:
        raise InputError(f"trace {path[:60]!r} is not a path", fix="name a CSV file")
    text = read_text(path, what="trace")
    reader = csv.reader(io.StringIO(text, newline=""))
    out: list[SimRequest] = []
    try:
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in TRACE_COLUMNS if c not in header]
        if missing:
            raise InputError(f"trace {path}: missing column(s) {', '.join(sorted(missing))}")
        column = {name: header.index(name) for name in TRACE_COLUMNS}
        for row in reader:
            if not row or not any(cell.strip() for cell in row):
                continue  # blank lines
            if len(out) >= MAX_REQUESTS:
                raise InputError(f"trace {path}: more than {MAX_REQUESTS:,} requests", fix="split the trace")
            out.append(_trace_row(row, column, f"trace {path}, line {reader.line_num}", len(out)))
    except csv.Error as exc:
        raise InputError(f"trace {path}, line {reader.line_num}: not valid CSV: {exc}") from None
    if not out:
        raise InputError(f"trace {path}: no requests", fix="add rows after the header")
    out.sort(key=lambda r: (r.arrival_s, r.id))
    return out


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


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return round(ordered[k], 3)


@dataclass
class PolicyResult:
    policy: str
    metrics: dict[str, Any]
    per_token_ms: list[float]
    timeline: list[tuple[float, int, int]]  # (time s, queued, running)
    wall_s: float
    events: int


def _metrics(sim: Simulation, scenario: Scenario, arrivals: list[SimRequest], hbm_util: float) -> dict[str, Any]:
    reqs = list(sim.requests.values())
    done = [r for r in reqs if r.state == "done"]
    per_token = [1000 * (r.finish_s - r.arrival_s) / r.output_len for r in done]
    ttft = [1000 * r.ttft_s for r in done]
    tpot = [1000 * (r.finish_s - r.arrival_s - r.ttft_s) / (r.output_len - 1) for r in done if r.output_len > 1]
    waits = [1000 * (r.start_s - r.arrival_s) for r in done]
    met = sum(1 for v in per_token if v <= scenario.slo_ms)
    span = max((r.finish_s for r in done), default=0.0) or 1.0
    states = Counter(r.state for r in reqs)
    placed = sim.placed_history
    tp_dist = Counter(str(p.tp) for p in placed)
    in_domain = sum(1 for r in done if r.in_domain)
    cross = [p.cross_domain_gbps for p in placed]
    return {
        "requests": len(arrivals),
        "completed": states.get("done", 0),
        "timed_out": states.get("timed_out", 0),
        "rejected": states.get("rejected", 0),
        "p50_ms": _pct(per_token, 0.50),
        "p90_ms": _pct(per_token, 0.90),
        "p99_ms": _pct(per_token, 0.99),
        "ttft_p50_ms": _pct(ttft, 0.50),
        "ttft_p99_ms": _pct(ttft, 0.99),
        "tpot_p50_ms": _pct(tpot, 0.50),
        "tpot_p99_ms": _pct(tpot, 0.99),
        "queue_wait_p50_ms": _pct(waits, 0.50),
        "queue_wait_p99_ms": _pct(waits, 0.99),
        "slo_attainment": round(met / len(arrivals), 4) if arrivals else 0.0,
        "goodput_rps": round(met / span, 3),
        "intra_domain_rate": round(in_domain / len(done), 4) if done else 0.0,
        "instances": len(placed),
        "tp_distribution": dict(sorted(tp_dist.items(), key=lambda kv: int(kv[0]))),
        "hbm_utilization": round(hbm_util, 4),
        "cross_domain_gbps_peak": round(sum(cross), 3),
        "cross_domain_budget_gbps": scenario.budget_gbps,
        "migrations": sim.migrations,
        "replacements": sim.replacements,
        "events": sim.events_done,
    }


def check_conservation(sim: Simulation) -> list[str]:
    """What is wrong at the end of a run (empty when everything is accounted for)."""
    problems = []
    bad = [r.id for r in sim.requests.values() if r.state not in ("done", "timed_out", "rejected")]
    if bad:
        problems.append(f"{len(bad)} requests neither completed, rejected nor timed out (e.g. {bad[:5]})")
    if sim.scheduler.placements:
        problems.append(f"{len(sim.scheduler.placements)} placements still held")
    held = [r for r in sim.scheduler.ledger.reservations()]
    if held:
        problems.append(f"{len(held)} reservations left in the ledger")
    if any(a.reserved_bytes for a in sim.scheduler.ledger.accounts().values()):
        problems.append("the ledger is not back to empty")
    return problems


def run_policy(
    scenario: Scenario,
    policy: str,
    *,
    seed: int = 0,
    arrivals: list[SimRequest] | None = None,
    progress: Callable[[Simulation], None] | None = None,
) -> PolicyResult:
    cluster = load_cluster(scenario.cluster)
    check_scenario_fits(scenario, cluster)
    scheduler = Scheduler(cluster, budget_gbps=scenario.budget_gbps, seed=seed)
    template = PlacementRequest(
        id="sim",
        model=scenario.model,
        weight_dtype=scenario.weight_dtype,
        kv_dtype=scenario.kv_dtype,
        max_model_len=scenario.input_len.mean + scenario.output_len.mean,
        concurrent_seqs=scenario.batch,
        input_len=scenario.input_len.mean,
        output_len=scenario.output_len.mean,
        slo_tpot_ms=scenario.slo_ms,
    )
    work = [SimRequest(r.id, r.arrival_s, r.input_len, r.output_len, r.slo_class) for r in
            (arrivals if arrivals is not None else make_arrivals(scenario, seed))]  # fmt: skip
    sim = Simulation(scenario, scheduler, template, policy, seed)
    start = time.perf_counter()
    capacity = sum(a.capacity_bytes for a in scheduler.ledger.accounts().values()) or 1
    sim.run(work, progress)
    # HBM utilisation at the peak: what all instances placed during the run reserved (upper bound)
    reserved = sum(p.hbm_per_gpu.total * len(p.ranks) for p in sim.placed_history)
    wall = time.perf_counter() - start
    problems = check_conservation(sim)
    if problems:
        raise AssertionError(f"conservation broken in policy {policy}: {'; '.join(problems)}")
    hbm = min(1.0, reserved / capacity)
    done = [r for r in sim.requests.values() if r.state == "done"]
    per_token = [1000 * (r.finish_s - r.arrival_s) / r.output_len for r in done]
    metrics = _metrics(sim, scenario, work, hbm)
    metrics["wall_s"] = round(wall, 3)
    metrics["events_per_s"] = round(sim.events_done / wall) if wall > 0 else None
    return PolicyResult(policy, metrics, per_token, sim.timeline, wall, sim.events_done)


def simulate(scenario: Scenario, policies: list[str], *, seed: int = 0,
             progress: Callable[[str, Simulation], None] | None = None) -> dict[str, PolicyResult]:  # fmt: skip
    """The same seeded workload under each policy."""
    arrivals = make_arrivals(scenario, seed)
    results: dict[str, PolicyResult] = {}
    for policy in policies:
        hook = (lambda s, p=policy: progress(p, s)) if progress is not None else None
        results[policy] = run_policy(scenario, policy, seed=seed, arrivals=arrivals, progress=hook)
    return results


__all__ = [
    "GIB",
    "PolicyResult",
    "check_conservation",
    "check_scenario_fits",
    "make_arrivals",
    "read_trace",
    "run_policy",
    "simulate",
]
