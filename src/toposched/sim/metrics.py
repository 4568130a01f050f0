"""What a run measured: latency distributions, SLO attainment, utilisation, admission and the seed's signals.

Definitions (docs/simulator.md has the full list):

* **per-token latency** of a request = (its last token's time - its arrival) / output tokens,
  queueing included (seed 000 reports one P99 per run against a per-token SLO); ``p50_ms`` ...
  ``p99_ms`` are percentiles over completed requests. **TTFT** = first token - arrival; **TPOT** =
  (last token - first token) / (output tokens - 1). ``ttft_p99_all_ms`` counts the timed-out requests too,
  each as a first token that never came (None when more than 1 % timed out): a policy that lets requests
  time out does not get a better tail by leaving them out (issue 35: ``ttft_p99_ms`` alone did).
* ``slo_attainment`` = requests whose per-token latency met their tenant's SLO / all requests
  (timed out and rejected ones count as misses); ``slo_attainment_by_tp`` the same per TP size of
  the instance that served the request (a request never served counts under its tenant's TP).
* ``gpu_utilization`` = GPU-seconds held by instances (booked: starting, serving, draining, and
  both copies during a move) / GPU-seconds of healthy GPUs, over the run's window (a churn run's
  duration; else until the last request finished). ``hbm_utilization`` the same for HBM bytes (held by
  instances / HBM of the healthy GPUs).
* ``queued_for_nvlink_rate`` = instances that waited for NVLink room (a topology-aware policy could
  not place them although enough GPUs were free in all) / instance arrivals; ``migrations`` = moves
  started by defragmentation; ``repacks`` / ``repack_moves`` = the ``oracle``'s free repacks taken and
  the instances whose GPUs they changed, ``repacks_tried`` = repacks it tried (a try that is not taken
  found no layout with room for everyone; None under other policies); ``held_for_headroom_rate`` =
  instances that waited only because they would have broken one of the last ``keep_whole_domains``
  wholly free domains / instance arrivals;
  ``requeued_requests`` = requests restarted after a failure; ``drain_aborted_requests`` = requests a
  departing or moved copy had not finished when its ``drain_grace_s`` ran out (aborted, counted as
  timed out).
* signals (seed 000's): ``nvlink_affinity_ratio`` = completed requests served by an instance whose
  TP groups each sit in one NVLink domain / completed requests; ``cross_domain_budget_ratio_peak`` /
  ``_mean`` = cross-domain GB/s of the booked instances / the budget, at its peak and time-weighted;
  ``compression_ratio`` = cross-domain GB/s after compression / before, over the instances placed
  across domains whose SLO class allows compression, None below ``COMPRESSION_FLOOR_GBPS`` of their
  traffic before compression (summed over the placements; the service's signal); ``p99_gap_ms`` = p99
  per-token latency of requests served across domains minus
  that of requests served in one domain; ``migration_ratio`` = migrations / instances placed.
* **domain occupancy** (``DomainOccupancy``, for the heat map of ``simulate --out``): GPUs held by
  instances in each NVLink domain (GPUs in none: one row per node), sampled with the request timeline
  (about 400 samples a run, never more than ``MAX_OCCUPANCY_SAMPLES``).
* disaggregated runs (``pd``: the layout): ``kv_transfer_p50_ms`` / ``_p99_ms`` = prefill done to KV
  at the decode instance (in TTFT), waiting for busy links included; ``kv_wait_p99_ms`` the waiting
  alone; ``kv_scopes`` = completed requests by the farthest hop their KV took (same-node,
  same-rack, cross-rack). All None / empty in other runs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from toposched.solver.request import COMPRESSION_FLOOR_GBPS

if TYPE_CHECKING:
    from toposched.sim.engine import Simulation
    from toposched.sim.units import SimInstance, Unit
    from toposched.sim.workload import SimRequest
    from toposched.solver.index import ClusterIndex

TP_KEYS = ("1", "2", "4", "8")
"""TP sizes always present in ``slo_attainment_by_tp`` (null when no request was served at that size)."""


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank), rounded to 3 places; None for no values."""
    return pct_unserved(values, 0, q)


def pct_unserved(served: list[float], unserved: int, q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``served`` values and ``unserved`` ones that never came (an
    infinite value each): None when the quantile falls among the unserved (or there is nothing)."""
    n = len(served) + unserved
    if not n:
        return None
    k = max(0, min(n - 1, math.ceil(q * n) - 1))
    return round(sorted(served)[k], 3) if k < len(served) else None


def per_token_ms(req: SimRequest) -> float:
    return 1000.0 * (req.finish_s - req.arrival_s) / req.output_len


def time_mean(series: Sequence[tuple[float, ...]], column: int, start: float, end: float) -> float:
    """Integral of a step function (value ``column`` from each change's time on) over [start, end]."""
    total = 0.0
    for (t, *values), nxt in zip(series, [*series[1:], (math.inf,)], strict=True):
        lo, hi = max(t, start), min(nxt[0], end)
        if hi > lo:
            total += values[column - 1] * (hi - lo)
    return total


def _int_key(kv: tuple[str, object]) -> int:
    return int(kv[0])


def _ratio(a: float, b: float, places: int = 4) -> float | None:
    return round(a / b, places) if b > 0 else None


def compute(sim: Simulation) -> dict[str, Any]:
    """The metrics of a finished run (``Simulation.run`` returned)."""
    reqs = sim.requests
    deps = sim.deployments
    states = Counter(r.state for r in reqs)
    done = [r for r in reqs if r.state == "done"]
    per_token = [per_token_ms(r) for r in done]
    ttft = [1000.0 * r.ttft_s for r in done]
    tpot = [1000.0 * (r.finish_s - r.first_token_s) / (r.output_len - 1) for r in done if r.output_len > 1]
    waits = [1000.0 * (r.start_s - r.arrival_s) for r in done]
    met_of = [r.state == "done" and per_token_ms(r) <= deps[r.tenant].slo_ms for r in reqs]
    met = sum(met_of)
    by_tp: dict[str, list[int]] = {k: [0, 0] for k in TP_KEYS}
    for r, ok in zip(reqs, met_of, strict=True):
        key = str(r.tp or deps[r.tenant].ref_tp)
        cell = by_tp.setdefault(key, [0, 0])
        cell[0] += ok
        cell[1] += 1
    start, end = 0.0, max(sim.end_s, 1e-9)
    series = sim.gpu_series
    held = time_mean(series, 1, start, end)
    available = time_mean(series, 3, start, end)
    hbm_held = time_mean(series, 4, start, end)
    hbm_available = time_mean(sim.hbm_series, 1, start, end)  # HBM of the healthy GPUs, as gpu_utilization
    cross = [v[2] for v in series if start <= v[0] <= end] or [0.0]
    budget = sim.scheduler.budget_gbps
    inside = [per_token_ms(r) for r in done if r.in_domain]
    across = [per_token_ms(r) for r in done if not r.in_domain]
    p99_in, p99_across = pct(inside, 0.99), pct(across, 0.99)
    spread = [p for p in sim.placed_history if p.cross_domain_gbps > 0 and p.id in sim.compressible]
    sent = sum(p.cross_domain_gbps for p in spread)
    raw = sum(p.cross_domain_gbps_uncompressed for p in spread)
    moved = [r for r in done if r.kv_ms >= 0]
    units = sim.units
    unit_states = Counter(u.state for u in units)
    placed_units = sum(1 for u in units if u.placed)
    adm = sim.admission
    span = max((r.finish_s for r in done), default=0.0) or 1.0
    return {
        "requests": len(reqs),
        "completed": states.get("done", 0),
        "timed_out": states.get("timed_out", 0),
        "rejected": states.get("rejected", 0),
        "running_at_end": sum(states.get(s, 0) for s in ("new", "queued", "waiting", "running")),
        "p50_ms": pct(per_token, 0.50),
        "p90_ms": pct(per_token, 0.90),
        "p99_ms": pct(per_token, 0.99),
        "ttft_p50_ms": pct(ttft, 0.50),
        "ttft_p99_ms": pct(ttft, 0.99),
        "ttft_p99_all_ms": pct_unserved(ttft, states.get("timed_out", 0), 0.99),
        "tpot_p50_ms": pct(tpot, 0.50),
        "tpot_p99_ms": pct(tpot, 0.99),
        "kv_transfer_p50_ms": pct([r.kv_ms for r in moved], 0.50),
        "kv_transfer_p99_ms": pct([r.kv_ms for r in moved], 0.99),
        "kv_wait_p99_ms": pct([r.kv_wait_ms for r in moved], 0.99),
        "kv_scopes": dict(sorted(Counter(r.kv_scope for r in moved).items())),
        "pd": sim.pd_info,
        "queue_wait_p50_ms": pct(waits, 0.50),
        "queue_wait_p99_ms": pct(waits, 0.99),
        "slo_attainment": round(met / len(reqs), 4) if reqs else 0.0,
        "slo_attainment_by_tp": {
            k: (round(v[0] / v[1], 4) if v[1] else None) for k, v in sorted(by_tp.items(), key=_int_key)
        },
        "goodput_rps": round(met / span, 3),
        "intra_domain_rate": round(len(inside) / len(done), 4) if done else 0.0,
        "gpu_utilization": round(held / available, 4) if available > 0 else 0.0,
        "hbm_utilization": round(hbm_held / hbm_available, 4) if hbm_available > 0 else 0.0,
        "instances": len(sim.placed_history),
        "tp_distribution": dict(sorted(Counter(str(p.tp) for p in sim.placed_history).items(), key=_int_key)),
        "instance_arrivals": len(units),
        "instances_placed": placed_units,
        "instances_done": unit_states.get("done", 0),
        "instances_abandoned": unit_states.get("abandoned", 0),
        "instances_unplaced_at_end": unit_states.get("unplaced", 0),
        "instances_waited_for_nvlink": adm.waited_nvlink,
        "queued_for_nvlink_rate": round(adm.waited_nvlink / len(units), 4) if units else 0.0,
        "instances_held_for_headroom": adm.held_headroom,
        "held_for_headroom_rate": round(adm.held_headroom / len(units), 4) if units else 0.0,
        "fallback_placements": adm.fallback_placements,
        "migrations": adm.migrations,
        "defrag_plans": adm.plans,
        "repacks": adm.repacker.repacks if adm.repacker is not None else None,
        "repack_moves": adm.repacker.moved if adm.repacker is not None else None,
        "repacks_tried": adm.repacker.tried if adm.repacker is not None else None,
        "replacements": sim.replacements,
        "requeued_requests": sim.requeued_requests,
        "drain_aborted_requests": sim.drain_aborted,
        "preemptions": sum(r.preempted for r in reqs),
        "gpu_failures": sim.gpu_failures,
        "cross_domain_gbps_peak": round(max(cross), 3),
        "cross_domain_budget_gbps": budget,
        "signals": {
            "nvlink_affinity_ratio": round(len(inside) / len(done), 4) if done else None,
            "cross_domain_budget_ratio_peak": round(max(cross) / budget, 4),
            "cross_domain_budget_ratio_mean": round(time_mean(series, 2, start, end) / (budget * (end - start)), 4),
            "compression_ratio": _ratio(sent, raw) if raw >= COMPRESSION_FLOOR_GBPS else None,
            "p99_gap_ms": round(p99_across - p99_in, 3) if p99_in is not None and p99_across is not None else None,
            "migration_ratio": _ratio(adm.migrations, placed_units),
        },
        "admission_by_tp": _admission_by_tp(sim),
        "tenants": {
            d.tenant.name: {
                **_tenant(d.index, reqs, met_of, d.slo_ms, d.capacity_rps, d.ref_tp),
                **{
                    ("instance_arrivals" if k == "arrivals" else k): v
                    for k, v in _admission([u for u in sim.units if u.deployment is d]).items()
                },
            }
            for d in deps
        },
        "simulated_s": round(end - start, 3),
        "events": sim.events_done,
    }


def _admission_by_tp(sim: Simulation) -> dict[str, dict[str, Any]]:
    """Per TP size of the tenants: ``_admission`` of their instances."""
    return {
        str(tp): _admission([u for u in sim.units if u.deployment.ref_tp == tp])
        for tp in sorted({u.deployment.ref_tp for u in sim.units})
    }


def _admission(units: list[Unit]) -> dict[str, Any]:
    """Instance arrivals, how many waited for NVLink room or were held for headroom, how long they
    waited for their first placement (arrival to booking), and how many were never placed."""
    waits = [u.placed_s - u.arrival_s for u in units if u.placed_s >= 0]
    return {
        "arrivals": len(units),
        "waited_for_nvlink": sum(1 for u in units if u.waited_nvlink),
        "held_for_headroom": sum(1 for u in units if u.held_headroom),
        "wait_p50_s": pct(waits, 0.5),
        "wait_p99_s": pct(waits, 0.99),
        "never_placed": sum(1 for u in units if u.placed_s < 0),
    }


def _tenant(
    index: int, reqs: list[SimRequest], met_of: list[bool], slo_ms: float, capacity: float, tp: int
) -> dict[str, Any]:
    mine = [(r, ok) for r, ok in zip(reqs, met_of, strict=True) if r.tenant == index]
    done = [per_token_ms(r) for r, _ in mine if r.state == "done"]
    return {
        "tp": tp,
        "slo_ms": round(slo_ms, 3),
        "capacity_rps": round(capacity, 3),
        "requests": len(mine),
        "completed": len(done),
        "slo_attainment": round(sum(ok for _, ok in mine) / len(mine), 4) if mine else None,
        "p50_ms": pct(done, 0.5),
        "p99_ms": pct(done, 0.99),
    }


MAX_OCCUPANCY_SAMPLES = 512
"""Most domain-occupancy samples a run keeps (``DomainSampler``): memory stays rows x 512 counts."""


@dataclass(frozen=True)
class DomainOccupancy:
    """GPUs held by instances per NVLink domain, sampled over one run (the value a run hands on).

    ``rows`` names the NVLink domains, then one row per node for GPUs in no domain (``NODE (no
    NVLink)``); ``sizes`` their GPUs at the start of the run. Sample ``k`` was taken at ``times[k]``
    and ``held[k][r]`` GPUs of row ``r`` were held (booked by a starting, serving or draining copy)
    from then until the next sample; the last holds until ``end_s``.
    """

    rows: tuple[str, ...]
    sizes: tuple[int, ...]
    times: tuple[float, ...]
    held: tuple[tuple[int, ...], ...]
    end_s: float

    def shares(self) -> list[list[float]]:
        """Per row, per sample: held / size (0 for a row of no GPUs)."""
        return [[h[r] / size if size else 0.0 for h in self.held] for r, size in enumerate(self.sizes)]


@dataclass
class DomainSampler:
    """Counts the GPUs held per NVLink domain at each sample of a run (``Simulation.sample``).

    A GPU keeps the row it had at the start (an ``nvlink-down`` failure later takes it out of its
    domain, not out of its row). Memory is bounded: when ``limit`` samples are kept, every other one
    is dropped and from then on only every ``stride``-th call samples (stride doubles), so a run of
    any length keeps between ``limit / 2`` and ``limit`` samples, evenly spread.
    """

    rows: tuple[str, ...]
    sizes: tuple[int, ...]
    row_of: dict[str, int]
    limit: int = MAX_OCCUPANCY_SAMPLES
    times: list[float] = field(default_factory=list, init=False)
    held: list[tuple[int, ...]] = field(default_factory=list, init=False)
    stride: int = field(default=1, init=False)
    _calls: int = field(default=0, init=False)
    _rows_of_copy: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict, init=False)

    @classmethod
    def of(cls, index: ClusterIndex, limit: int = MAX_OCCUPANCY_SAMPLES) -> DomainSampler:
        """Rows for the cluster of ``index``: its NVLink domains in map order, then nodes for the rest."""
        rows: list[str] = []
        sizes: list[int] = []
        row_of: dict[str, int] = {}
        for domain in index.dmap.domains:
            row_of.update((ref, len(rows)) for ref in domain.gpus)
            rows.append(domain.id)
            sizes.append(len(domain.gpus))
        for ref, info in index.info.items():
            if ref not in row_of:
                name = f"{info.node} (no NVLink)"
                if not rows or rows[-1] != name:
                    rows.append(name)
                    sizes.append(0)
                row_of[ref] = len(rows) - 1
                sizes[-1] += 1
        return cls(tuple(rows), tuple(sizes), row_of, limit)

    def sample(self, time: float, copies: Mapping[str, SimInstance]) -> None:
        """Count the GPUs ``copies`` hold per row (every ``stride``-th call)."""
        self._calls += 1
        if (self._calls - 1) % self.stride:
            return
        known = self._rows_of_copy
        counts = [0] * len(self.rows)
        live: dict[str, tuple[tuple[int, int], ...]] = {}
        for key, inst in copies.items():
            spread = known.get(key)
            if spread is None:
                spread = tuple(sorted(Counter(self.row_of[ref] for ref in inst.placement.gpu_refs).items()))
            live[key] = spread
            for row, n in spread:
                counts[row] += n
        self._rows_of_copy = live
        self.times.append(time)
        self.held.append(tuple(counts))
        if len(self.times) >= self.limit:
            del self.times[1::2], self.held[1::2]
            self.stride *= 2

    def result(self, end_s: float) -> DomainOccupancy:
        return DomainOccupancy(self.rows, self.sizes, tuple(self.times), tuple(self.held), end_s)


def check_conservation(sim: Simulation) -> list[str]:
    """What is wrong at the end of a run (empty when everything is accounted for)."""
    problems = []
    bad = [r.id for r in sim.requests if r.state not in ("done", "timed_out", "rejected")]
    if bad:
        problems.append(f"{len(bad)} requests neither completed, rejected nor timed out (e.g. {bad[:5]})")
    stuck = [u.id for u in sim.units if u.state not in ("done", "abandoned", "unplaced")]
    if stuck:
        problems.append(f"{len(stuck)} instances neither done, abandoned nor unplaced (e.g. {stuck[:5]})")
    if sim.copies or sim.gpus_held:
        problems.append(f"{len(sim.copies)} instance copies ({sim.gpus_held} GPUs) still held")
    if sim.scheduler.placements:
        problems.append(f"{len(sim.scheduler.placements)} placements still held")
    held = sim.scheduler.ledger.reservations()
    if held:
        problems.append(f"{len(held)} reservations left in the ledger")
    if any(a.reserved_bytes for a in sim.scheduler.ledger.accounts().values()):
        problems.append("the ledger is not back to empty")
    index = sim.scheduler.index
    lost = set(index.info) - index.free - sim.scheduler.failed
    if lost:
        problems.append(f"{len(lost)} healthy GPUs not free after teardown (e.g. {sorted(lost)[:3]})")
    return problems


__all__ = [
    "MAX_OCCUPANCY_SAMPLES",
    "TP_KEYS",
    "DomainOccupancy",
    "DomainSampler",
    "check_conservation",
    "compute",
    "pct",
    "per_token_ms",
    "time_mean",
]
