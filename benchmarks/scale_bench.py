"""Scale: building the scheduler and deciding one placement, from 64 to 65,536 GPUs (issue 17).

    .venv/bin/python benchmarks/scale_bench.py [--sizes 64,256,...] [--decisions N] [--fill 0.6] [--rounds R]

For each size: N x HGX H100 nodes (``NxPRESET``, racks of 8, 8 x 400G InfiniBand), then

* build: CPU time of ``load_cluster`` + ``Scheduler(cluster)`` (DomainMap, indexes, ledger), and the
  Python memory a build allocates (tracemalloc peak of another build, as tracing slows it), per GPU;
* fill: a seeded mix of instances (TP 1/2/4/8 of Llama-3.1-8B/70B and Mixtral-8x22B) placed until
  ``--fill`` of the GPUs are held;
* decide: N single placements with the ``slo`` policy, each timed alone in CPU time
  (``time.process_time`` around ``Scheduler.place``) and released again, so the fill stays; p50 and
  p99. The same for ``random`` (the blind baseline), as a ratio to ``slo``'s p50. With ``--rounds R``
  the two alternate R times (the order swapped each round) and each figure is the median over the
  rounds, the ratio the median of each round's ratio: steadier on a noisy machine than one long run.

CPU time, not wall time: the development machine has 2 cores shared with other work.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc

from toposched.sim.loading import load_cluster
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler

MIX = [("llama-3.1-8b", (1,)), ("llama-3.1-8b", (2,)), ("llama-3.1-70b", (4,)), ("mixtral-8x22b", (8,))]


def _request(rng: random.Random, n: int) -> PlacementRequest:
    model, tps = rng.choice(MIX)
    return PlacementRequest(id=f"r{n}", model=model, allowed_tp=tps, max_model_len=8192, concurrent_seqs=8)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _decide(scheduler: Scheduler, policy: str, rng: random.Random, decisions: int) -> list[float]:
    times = []
    for n in range(decisions):
        request = _request(rng, 10_000_000 + n)
        start = time.process_time()
        out = scheduler.place(request, policy)
        times.append(time.process_time() - start)
        for p in out.placements:
            scheduler.release(p.id)
    return times


def run(gpus: int, decisions: int, fill: float, rounds: int = 1) -> None:
    nodes = max(1, gpus // 8)
    tracemalloc.start()  # memory from a first build (tracing slows it down), time from a second
    Scheduler(load_cluster(f"{nodes}xhgx-h100"), seed=0)
    _current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    start = time.process_time()
    cluster = load_cluster(f"{nodes}xhgx-h100")
    scheduler = Scheduler(cluster, seed=0)
    build = time.process_time() - start
    rng = random.Random(0)
    n = 0
    misses = 0
    while len(scheduler.index.free) > gpus * (1 - fill) and misses < 50:
        out = scheduler.place(_request(rng, n), "slo")
        n += 1
        misses = 0 if out.placements else misses + 1
    p50s, p99s, ratios = [], [], []
    for r in range(rounds):  # slo and random alternate, the order swapped each round (paired under drift)
        order = ("slo", "random") if r % 2 == 0 else ("random", "slo")
        times = {policy: _decide(scheduler, policy, rng, decisions) for policy in order}
        p50s.append(_pct(times["slo"], 0.5) * 1e3)
        p99s.append(_pct(times["slo"], 0.99) * 1e3)
        ratios.append(statistics.median(times["random"]) / statistics.median(times["slo"]))
    p50, p99, ratio = statistics.median(p50s), statistics.median(p99s), statistics.median(ratios)
    print(
        f"{gpus:>7,} {build:>8.2f} {peak / gpus / 1024:>9.2f} {1 - len(scheduler.index.free) / gpus:>6.2f} "
        f"{p50:>9.3f} {p99:>9.3f} {ratio:>12.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64,256,1024,4096,16384,65536")
    parser.add_argument("--decisions", type=int, default=300)
    parser.add_argument("--fill", type=float, default=0.6)
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds of --decisions per policy; figures are medians over rounds"
    )
    args = parser.parse_args()
    print(f"{'GPUs':>7} {'build s':>8} {'KiB/GPU':>9} {'held':>6} {'slo p50':>9} {'slo p99':>9} {'random/slo':>12}")
    print(f"{'':>7} {'(CPU)':>8} {'(peak)':>9} {'':>6} {'ms CPU':>9} {'ms CPU':>9} {'p50 ratio':>12}")
    for size in (int(s) for s in args.sizes.split(",")):
        run(size, args.decisions, args.fill, args.rounds)


if __name__ == "__main__":
    main()
