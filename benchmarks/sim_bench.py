"""Simulator speed: wall time and events/s for seed-256 (4,096 requests) and large-16k (100k requests).

    .venv/bin/python benchmarks/sim_bench.py [--repeat N]

Wall time covers one policy's whole run: loading the cluster, placing the instances and the event
loop (the targets: seed-256 <= 10 s, 16,384 GPUs with 100k requests <= 120 s on this 2-core machine).
Medians over N runs (default 3).
"""

from __future__ import annotations

import argparse
import statistics
import time

from toposched.sim.run import make_arrivals, run_policy
from toposched.sim.scenario import load_scenario


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{'scenario':<11} {'policy':<12} {'requests':>9} {'events':>8} {'wall s':>7} {'events/s':>9}")
    for name, policies in (("seed-256", ("slo", "random", "index-order", "latency")), ("large-16k", ("slo", "random"))):
        scenario = load_scenario(name)
        arrivals = make_arrivals(scenario, 0)
        for policy in policies:
            walls, events = [], 0
            for _ in range(args.repeat):
                start = time.perf_counter()
                result = run_policy(scenario, policy, arrivals=arrivals)
                walls.append(time.perf_counter() - start)
                events = result.events
            wall = statistics.median(walls)
            print(f"{name:<11} {policy:<12} {scenario.requests:>9} {events:>8} {wall:>7.2f} {events / wall:>9,.0f}")


if __name__ == "__main__":
    main()
