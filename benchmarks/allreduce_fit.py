"""Fit the alpha-beta all-reduce model to aiconfigurator_allreduce.csv and print its errors.

    .venv/bin/python benchmarks/allreduce_fit.py [--data ../shared/reference/data]

Prints, per (series, n): the fitted alpha and busbw, the median and max relative error over the
measured sizes, the researcher's fit in alpha_beta_fits.csv for comparison, and whether the
constants in ``toposched/perf/links.py`` still match. Then the error of the engine model the link
table uses (faster of custom all-reduce and NCCL) against the faster measured path at each size.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from toposched.perf.allreduce import fit_measured, load_allreduce_csv
from toposched.perf.links import FITTED_SERIES, get_link

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "data"

# link kind -> (NCCL series, custom all-reduce series or None) whose measured minimum it models
ENGINE_CHECKS = {
    "nvlink3": ("a100_sxm_comm_nccl_2.27.3", "car_a100_sxm_comm_vllm_0.14.0:vllm_graph"),
    "nvlink4": ("h100_sxm_comm_nccl_2.27.3", "car_h100_sxm_comm_vllm_0.19.0:vllm_graph"),
    "nvlink5": ("b200_sxm_comm_nccl_2.27.3", None),
    "pcie4-nop2p": ("l40s_comm_nccl_2.27.3", "car_l40s_comm_vllm_0.22.0:vllm_graph"),  # the AIC L40S box: P2P off
    "pcie5": ("rtx_pro_6000_server_comm_nccl_2.29.2", None),
}


def reference_fits(path: Path) -> dict[tuple[str, int], tuple[float, float, float, float]]:
    out = {}
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            system = row["system"]
            out[(system, int(row["n"]))] = (
                float(row["alpha_us"]), float(row["busbw_GBps"]),
                float(row["median_rel_err"]), float(row["max_rel_err"]),
            )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with the CSV files")
    args = parser.parse_args(argv)
    samples = load_allreduce_csv(args.data / "aiconfigurator_allreduce.csv")
    ref = reference_fits(args.data / "alpha_beta_fits.csv")
    print(f"{'series':42s} {'n':>2s} {'pts':>3s} {'alpha us':>8s} {'busbw':>7s} {'med err':>7s} {'max err':>7s}"
          f"   | ref alpha  busbw  med   max | table")  # fmt: skip
    meds, maxes = [], []
    for r in fit_measured(samples):
        system = r.series.split(":")[0]
        rf = ref.get((system, r.n)) if ":" not in r.series or r.series.endswith(("vllm_graph", "trtllm")) else None
        ref_txt = f"{rf[0]:6.2f} {rf[1]:6.1f} {rf[2]:4.0%} {rf[3]:4.0%}" if rf else " " * 26
        table = FITTED_SERIES.get(r.series, {}).get(r.n)
        if table is None:
            mark = "-"
        else:
            close = (
                abs(table.alpha_us / r.fit.alpha_us - 1) < 0.01 and abs(table.busbw_gbps / r.fit.busbw_gbps - 1) < 0.01
            )
            mark = "ok" if close else "STALE"
        meds.append(r.median_rel_err)
        maxes.append(r.max_rel_err)
        print(f"{r.series:42s} {r.n:2d} {r.points:3d} {r.fit.alpha_us:8.2f} {r.fit.busbw_gbps:7.1f} "
              f"{r.median_rel_err:7.1%} {r.max_rel_err:7.1%}   | {ref_txt} | {mark}")  # fmt: skip
    print(f"all series: median of medians {statistics.median(meds):.1%}, worst max {max(maxes):.1%}")
    print()
    print("engine model (faster of custom AR and NCCL) vs faster measured path, per size:")
    by: dict[tuple[str, int, int], float] = defaultdict(lambda: float("inf"))
    for s in samples:
        by[(s.series, s.n, s.nbytes)] = min(by[(s.series, s.n, s.nbytes)], s.time_us)
    for kind, (nccl, custom) in ENGINE_CHECKS.items():
        link = get_link(kind)
        for n in (2, 4, 8):
            errs = []
            sizes = {b for (series, m, b) in by if series == nccl and m == n}
            for b in sorted(sizes):
                measured = min(by[(nccl, n, b)], by.get((custom, n, b), float("inf")) if custom else float("inf"))
                errs.append(abs(link.allreduce_us(b, n) - measured) / measured)
            print(f"  {kind:8s} n={n}: {len(errs)} sizes, median error {statistics.median(errs):.1%}, "
                  f"max {max(errs):.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
