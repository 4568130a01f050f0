"""Simulator benchmark: (a) speed on seed-256 and large-16k; (b) churn-128 against issue 15's targets;
(c) pd-256's layouts against seed 003's claims; (d) (``--only seeds``, not in the default run) each churn
scenario on seeds 0..N-1, ``slo`` against index-order and the oracle (issue 35).

    .venv/bin/python benchmarks/sim_bench.py                       # all three parts
    .venv/bin/python benchmarks/sim_bench.py --only speed --repeat 3
    .venv/bin/python benchmarks/sim_bench.py --only churn --seeds 3 --policies slo,index-order,random
    .venv/bin/python benchmarks/sim_bench.py --only churn --policies slo --occupancy 0.85,0.95 --no-defrag

(a) Wall and CPU time of one policy's whole run (cluster, deployments, placements and the event
loop; medians of ``--repeat`` runs), events and events per wall second. Targets: seed-256 <= 10 s,
large-16k (16,384 GPUs, 100k requests) <= 120 s on one core.

(b) churn-128 at offered occupancy 0.50 / 0.85 / 0.95 for each policy, medians over seeds 0..N-1 of:
SLO met, SLO met on TP8 instances, GPU utilisation, share of instances that waited for NVLink room,
share held back to keep a whole NVLink domain free (headroom), migrations (as a share of instance
arrivals), cross-domain fallback placements. Issue 15's targets at 0.85: SLO met >= 0.99, TP8 >= 0.95,
utilisation within 2 points of index-order, migrations <= 1 %.

(c) pd-256 (``--only pd``): each layout (same-server, rack-local, spread) in four settings: KV
straight from prefill to decode or through a store, on a non-blocking spine or one oversubscribed
``--oversubscription`` times; medians over seeds 0..N-1 (``--seeds``, default 3) of TTFT, KV transfer
(waiting for links included) and TPOT p50/p99, and the p99 TTFT gained by rack-local over spread and
by same-server over rack-local, next to seed 003's claims (42 % and a further 28 %).

    .venv/bin/python benchmarks/sim_bench.py --only pd --seeds 3 --oversubscription 4

(d) ``--only seeds --seeds 10``: churn-tiny, churn-128 and churn-mixed (their default occupancy, 0.85) on
seeds 0..N-1, ``slo``, index-order and ``oracle`` (``sim/oracle.py``: slo with free, instant repacking),
``--workers`` runs at a time (one process each): per seed SLO met, TTFT p99, utilisation and TP=8 SLO
met, then how many seeds ``slo`` is at least as good as index-order on SLO met and on TTFT p99, and the
median and worst of ``slo``'s SLO met, TP=8 SLO met, TP=8 points behind the oracle and utilisation gap
(issue 35's targets: every seed, not chosen ones).

    .venv/bin/python benchmarks/sim_bench.py --only seeds --seeds 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from toposched.sim.loading import load_scenario
from toposched.sim.run import make_arrivals, run_policy


def speed(repeat: int) -> None:
    print(f"{'scenario':<10} {'policy':<12} {'requests':>9} {'events':>9} {'wall s':>7} {'cpu s':>7} {'events/s':>9}")
    for name, policies in (("seed-256", ("slo", "random", "index-order", "latency")), ("large-16k", ("slo", "random"))):
        scenario = load_scenario(name)
        arrivals = make_arrivals(scenario, 0)
        for policy in policies:
            walls, cpus, events = [], [], 0
            for _ in range(repeat):
                start, cpu = time.perf_counter(), time.process_time()
                result = run_policy(scenario, policy, arrivals=arrivals)
                walls.append(time.perf_counter() - start)
                cpus.append(time.process_time() - cpu)
                events = result.events
            wall, cpu_s = statistics.median(walls), statistics.median(cpus)
            print(
                f"{name:<10} {policy:<12} {len(arrivals):>9,} {events:>9,} {wall:>7.2f} {cpu_s:>7.2f} "
                f"{events / wall:>9,.0f}",
                flush=True,
            )


def churn(seeds: int, policies: list[str], occupancies: list[float], *, defrag: bool = True) -> None:
    base = load_scenario("churn-128")
    assert base.churn is not None
    settings = base.churn
    if not defrag:
        base = base.model_copy(update={"admission": base.admission.model_copy(update={"defrag": False})})
    head = (
        f"{'occupancy':>9} {'policy':<12} {'SLO met':>8} {'TP8 SLO':>8} {'GPU util':>8} {'NVLink wait':>11} "
        f"{'headroom wait':>13} {'migrations':>10} {'fallbacks':>9} {'abandoned':>9} {'requests':>9} {'run s':>6}"
    )
    print(head)
    for occupancy in occupancies:
        scenario = base.model_copy(update={"churn": settings.model_copy(update={"occupancy": occupancy})})
        for policy in policies:
            runs: list[dict[str, Any]] = []
            walls: list[float] = []
            for seed in range(seeds):
                start = time.perf_counter()
                runs.append(run_policy(scenario, policy, seed=seed).metrics)
                walls.append(time.perf_counter() - start)

            def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
                return statistics.median(float(m[key]) for m in runs)

            tp8 = statistics.median(
                float(m["slo_attainment_by_tp"]["8"]) for m in runs if m["slo_attainment_by_tp"]["8"] is not None
            )
            moves = statistics.median(m["migrations"] / m["instance_arrivals"] for m in runs)
            print(
                f"{occupancy:>9.2f} {policy:<12} {med('slo_attainment'):>8.3f} {tp8:>8.3f} "
                f"{med('gpu_utilization'):>8.3f} {med('queued_for_nvlink_rate'):>11.1%} "
                f"{med('held_for_headroom_rate'):>13.1%} "
                f"{med('migrations'):>4.0f} ({moves:>4.1%}) {med('fallback_placements'):>9.0f} "
                f"{med('instances_abandoned'):>9.0f} {med('requests'):>9,.0f} {statistics.median(walls):>6.1f}",
                flush=True,
            )


def _seed_run(job: tuple[str, str, int]) -> tuple[str, str, int, dict[str, Any]]:
    name, policy, seed = job
    return name, policy, seed, run_policy(load_scenario(name), policy, seed=seed).metrics


def _tail(m: dict[str, Any]) -> float:
    """TTFT p99 with timed-out requests counted as never served (infinite when they are over 1 %)."""
    v = m["ttft_p99_all_ms"]
    return float("inf") if v is None else float(v)


def _ms(m: dict[str, Any]) -> str:
    v = m["ttft_p99_all_ms"]
    return f"{'unserved':>9}" if v is None else f"{v:>9,.0f}"


def seeds_part(seeds: int, scenarios: list[str], workers: int) -> None:
    """Each churn scenario on seeds 0..N-1, ``slo`` against index-order and the oracle: per seed, then
    median and worst."""
    policies = ("slo", "index-order", "oracle")
    jobs = [(name, policy, seed) for name in scenarios for seed in range(seeds) for policy in policies]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = {(n, p, k): m for n, p, k, m in pool.map(_seed_run, jobs)}
    for name in scenarios:
        print(f"{name}: seed, SLO met / TTFT p99 ms (timed-out requests counted) / timed out / utilisation as "
              "slo / index-order / oracle; "
              "TP8 SLO met slo / oracle, moves of slo")  # fmt: skip
        slo_ok = ttft_ok = tried = taken = 0
        rows = []
        for seed in range(seeds):
            a, b, o = (results[(name, p, seed)] for p in policies)
            tp8, tp8_o = a["slo_attainment_by_tp"].get("8"), o["slo_attainment_by_tp"].get("8")
            better = a["slo_attainment"] >= b["slo_attainment"]
            # timed-out requests count (metrics.ttft_p99_all_ms); both over 1 % timed out is no win
            faster = _tail(a) <= _tail(b) and _tail(a) != float("inf")
            slo_ok += better
            ttft_ok += faster
            gap = b["gpu_utilization"] - a["gpu_utilization"]
            moved = a["migrations"] / a["instance_arrivals"] if a["instance_arrivals"] else 0.0
            behind = tp8_o - tp8 if tp8 is not None and tp8_o is not None else None
            rows.append((a["slo_attainment"], tp8, gap, moved, behind, o["slo_attainment"]))
            tried += o["repacks_tried"]
            taken += o["repacks"]

            def f(x: float | None) -> str:
                return "-" if x is None else f"{x:.3f}"

            print(f"  {seed:>3} {a['slo_attainment']:.3f} / {b['slo_attainment']:.3f} / {o['slo_attainment']:.3f}  "
                  f"{_ms(a)} / {_ms(b)} / {_ms(o)}  t/o {a['timed_out']} / {b['timed_out']} / {o['timed_out']}  "
                  f"{a['gpu_utilization']:.3f} / {b['gpu_utilization']:.3f} / {o['gpu_utilization']:.3f}  "
                  f"TP8 {f(tp8)} / {f(tp8_o)}  moves {moved:.1%}"
                  f"{'' if better and faster else '   slo behind index-order'}")  # fmt: skip
        slo_met = [r[0] for r in rows]
        tp8s = [r[1] for r in rows if r[1] is not None]
        gaps = [r[2] for r in rows]
        moves = [r[3] for r in rows]
        behind = [r[4] for r in rows if r[4] is not None]
        print(f"  slo >= index-order on SLO met: {slo_ok} of {seeds}; TTFT p99 <= index-order's: {ttft_ok} of {seeds}")
        # every repack taken = the oracle placed each instance as soon as enough healthy GPUs were free in all
        print(f"  oracle repacks: {taken} taken of {tried} tried (all seeds)")
        print(f"  slo SLO met median {statistics.median(slo_met):.3f}, worst {min(slo_met):.3f} "
              f"(oracle median {statistics.median(r[5] for r in rows):.3f})"
              + (f"; TP8 median {statistics.median(tp8s):.3f}, worst {min(tp8s):.3f}" if tp8s else "")
              + (f"; TP8 behind oracle median {100 * statistics.median(behind):.1f} points, "
                 f"worst {100 * max(behind):.1f}" if behind else "")
              + f"; utilisation under index-order median {100 * statistics.median(gaps):.1f} points, "
              f"worst {100 * max(gaps):.1f}; migrations median {statistics.median(moves):.1%} of instances, "
              f"worst {max(moves):.1%}", flush=True)  # fmt: skip


PD_COLUMNS = ("ttft_p50_ms", "ttft_p99_ms", "kv_transfer_p50_ms", "kv_transfer_p99_ms", "kv_wait_p99_ms",
              "tpot_p50_ms", "tpot_p99_ms")  # fmt: skip


def pd(seeds: int, oversubscription: float) -> None:
    base = load_scenario("pd-256")
    assert base.pd is not None
    head = f"{'KV path':<7} {'spine':>6} {'layout':<12}" + "".join(f"{c.removesuffix('_ms'):>19}" for c in PD_COLUMNS)
    print(f"{head} {'run s':>6}")
    for via in ("direct", "store"):
        for over in (1.0, oversubscription):
            scenario = base.model_copy(
                update={"pd": base.pd.model_copy(update={"kv_via": via, "oversubscription": over})}
            )
            p99: dict[str, float] = {}
            for layout in base.pd.layouts:
                runs: list[dict[str, Any]] = []
                walls: list[float] = []
                for seed in range(seeds):
                    start = time.perf_counter()
                    runs.append(run_policy(scenario, "slo", seed=seed, layout=layout).metrics)
                    walls.append(time.perf_counter() - start)
                    assert runs[-1]["completed"] == runs[-1]["requests"], (via, over, layout, seed)
                cells = {c: statistics.median(float(m[c]) for m in runs) for c in PD_COLUMNS}
                p99[layout] = cells["ttft_p99_ms"]
                print(
                    f"{via:<7} {over:>4g}:1 {layout:<12}" + "".join(f"{cells[c]:>19.3f}" for c in PD_COLUMNS)
                    + f" {statistics.median(walls):>6.1f}",
                    flush=True,
                )  # fmt: skip
            rack = p99["rack-local"] / p99["spread"] - 1
            server = p99["same-server"] / p99["rack-local"] - 1
            print(
                f"{'':<7} {'':>6} p99 TTFT change: rack-local vs spread {rack:+.1%} (seed 003: -42 %), "
                f"same-server vs rack-local {server:+.1%} (seed 003: a further -28 %)",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("speed", "churn", "pd", "seeds"), help="run one part only")
    parser.add_argument(
        "--scenarios",
        default="churn-tiny,churn-128,churn-mixed",
        help="seeds: comma-separated churn scenarios (not in 'all')",
    )
    parser.add_argument("--workers", type=int, default=2, help="seeds: runs in parallel (one process each)")
    parser.add_argument("--repeat", type=int, default=3, help="speed: runs per policy (median)")
    parser.add_argument("--seeds", type=int, default=3, help="churn, pd: seeds 0..N-1 (median)")
    parser.add_argument("--oversubscription", type=float, default=4.0, help="pd: the oversubscribed spine's ratio")
    parser.add_argument("--policies", default="slo,index-order", help="churn: comma-separated policies")
    parser.add_argument("--occupancy", default="0.50,0.85,0.95", help="churn: comma-separated occupancies")
    parser.add_argument("--no-defrag", action="store_true", help="churn: admission without defragmentation")
    args = parser.parse_args()
    if args.only in (None, "speed"):
        speed(args.repeat)
    if args.only in (None, "churn"):
        if args.only is None:
            print()
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        churn(args.seeds, policies, [float(x) for x in args.occupancy.split(",")], defrag=not args.no_defrag)
    if args.only in (None, "pd"):
        if args.only is None:
            print()
        pd(args.seeds, args.oversubscription)
    if args.only == "seeds":
        names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
        seeds_part(args.seeds, names, args.workers)


if __name__ == "__main__":
    main()
