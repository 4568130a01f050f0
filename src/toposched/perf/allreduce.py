"""All-reduce cost: the alpha-beta model, and its fit to measured tables.

    t(S, n) = alpha_n + S * 2(n - 1)/n / busbw_n          (nccl-tests doc/PERFORMANCE.md)

``fit_alpha_beta`` is a least-squares fit that weights every point by 1/t (so it minimises the
relative error), the same criterion as ``reference/data/alpha_beta_fits.csv``. ``load_allreduce_csv``
reads ``reference/data/aiconfigurator_allreduce.csv`` (NVIDIA aiconfigurator's nccl-tests and
custom all-reduce tables); ``fit_measured`` fits every (system, backend, n) series in it. The link
table in ``links.py`` holds the fitted constants; ``benchmarks/allreduce_fit.py`` refits them and
prints the errors, and a test checks that the table still matches the data.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AlphaBeta:
    """One group size's latency (µs) and effective bus bandwidth (GB/s, 1e9 B/s)."""

    alpha_us: float
    busbw_gbps: float

    def time_us(self, nbytes: float, n: int) -> float:
        """Time of one all-reduce of ``nbytes`` over ``n`` GPUs (0 for a single GPU)."""
        if n <= 1:
            return 0.0
        return self.alpha_us + nbytes * 2 * (n - 1) / n / (self.busbw_gbps * 1e3)


@dataclass(frozen=True)
class Sample:
    """One measured all-reduce: series key, group size, message bytes, time in µs."""

    series: str
    n: int
    nbytes: int
    time_us: float


@dataclass(frozen=True)
class FitResult:
    """A fitted series and its relative errors over the measured points."""

    series: str
    n: int
    fit: AlphaBeta
    points: int
    median_rel_err: float
    max_rel_err: float


def fit_alpha_beta(points: Sequence[tuple[int, float]], n: int) -> AlphaBeta:
    """Least-squares alpha-beta fit of (bytes, µs) points, each residual divided by its time."""
    if len(points) < 2:
        raise ValueError("an alpha-beta fit needs at least two points")
    factor = 2 * (n - 1) / n
    # minimise sum(((alpha + x*beta - t) / t)^2): weighted normal equations with w = 1/t^2
    s_w = s_x = s_xx = s_t = s_xt = 0.0
    for nbytes, t in points:
        w = 1.0 / (t * t)
        x = nbytes * factor
        s_w += w
        s_x += w * x
        s_xx += w * x * x
        s_t += w * t
        s_xt += w * x * t
    det = s_w * s_xx - s_x * s_x
    alpha = (s_t * s_xx - s_x * s_xt) / det
    beta = (s_w * s_xt - s_x * s_t) / det  # µs per byte
    return AlphaBeta(alpha_us=alpha, busbw_gbps=1.0 / (beta * 1e3))


def relative_errors(fit: AlphaBeta, points: Iterable[tuple[int, float]], n: int) -> list[float]:
    """|predicted - measured| / measured for each point."""
    return [abs(fit.time_us(b, n) - t) / t for b, t in points]


SIXTEEN_BIT = ("half", "bfloat16")


def load_allreduce_csv(path: str | Path, dtypes: Sequence[str] = SIXTEEN_BIT) -> list[Sample]:
    """Read aiconfigurator_allreduce.csv rows of the given dtypes (16-bit: what TP activations use).

    The series key is the source's system tag plus the custom all-reduce mode (``:vllm_graph``...).
    """
    out: list[Sample] = []
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            if row["dtype"] not in dtypes:
                continue
            system = row["source"].split()[-1]
            backend = row["backend"]
            mode = backend[backend.rfind("(") + 1 : -1] if backend.endswith(")") else ""
            series = system if mode.startswith("-t") or not mode else f"{system}:{mode}"
            out.append(Sample(series, int(row["num_gpus"]), int(row["bytes"]), float(row["time_us"])))
    return out


def fit_measured(samples: Iterable[Sample]) -> list[FitResult]:
    """Fit every (series, n) in the samples; results sorted by series and n."""
    groups: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
    for s in samples:
        groups[(s.series, s.n)].append((s.nbytes, s.time_us))
    results = []
    for (series, n), pts in sorted(groups.items()):
        fit = fit_alpha_beta(pts, n)
        errs = relative_errors(fit, pts, n)
        results.append(FitResult(series, n, fit, len(pts), statistics.median(errs), max(errs)))
    return results
