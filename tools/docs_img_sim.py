"""Regenerate the example plots of docs/simulator.md (``docs/img/sim-*.png``).

    .venv/bin/python tools/docs_img_sim.py [--out docs/img]

The run: built-in scenario ``churn-128`` (16 x HGX H100, tenants of TP 1/2/4/8, occupancy 0.85) with
its churn cut to 400 s (1.3 mean instance lifetimes; of its three GPU failures, the one at 375 s is
kept) so the three policies run in about 25 s on a 2-core VM; seed 0; policies slo, index-order,
random. The plots are those ``toposched simulate --out`` writes (``toposched.sim.report.write_report``),
renamed ``sim-NAME.png`` with dashes.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from toposched.sim.builtin_scenarios import SCENARIOS
from toposched.sim.report import write_report
from toposched.sim.run import simulate

SCENARIO = "churn-128"
DURATION_S = 400.0
POLICIES = ["slo", "index-order", "random"]
SEED = 0
PLOTS = ("latency_cdf.png", "tenant_slo.png", "domain_occupancy.png", "gpus_over_time.png")
"""The plots the docs show (``queue_over_time.png`` is left out)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "img")
    args = parser.parse_args()
    base = SCENARIOS.get(SCENARIO)
    if base.churn is None:
        raise SystemExit(f"{SCENARIO} has no churn to shorten")
    churn = base.churn.model_copy(update={"duration_s": DURATION_S})
    failures = tuple(f for f in base.failures if f.at_s < DURATION_S)
    scenario = base.model_copy(update={"churn": churn, "failures": failures})
    start = time.perf_counter()
    results = simulate(scenario, POLICIES, seed=SEED)
    took = time.perf_counter() - start
    print(f"{SCENARIO} ({DURATION_S:g} s of churn), seed {SEED}, {', '.join(POLICIES)}: {took:.1f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        write_report(Path(tmp), scenario, SEED, results)
        for name in PLOTS:
            target = args.out / f"sim-{name.replace('_', '-')}"
            shutil.copyfile(Path(tmp) / name, target)
            print(target)


if __name__ == "__main__":
    main()
