"""All-reduce cost: the alpha-beta model, measured curves, and their fit to measured tables.

    t(S, n) = alpha_n + S * 2(n - 1)/n / busbw_n          (nccl-tests doc/PERFORMANCE.md)

One alpha-beta line misses the measured time by 20-66 % between about 1 and 32 MiB, where NCCL and
the custom all-reduces switch protocol and algorithm (perf-anchors §1.2) - exactly the size of a TP
prefill's all-reduce (tokens x hidden x 2 B). ``Curve`` is the measured table itself, interpolated
linearly in log(size) and log(time) between the measured sizes; beyond the largest size the extra
bytes cost what they cost in the last measured doubling, below the smallest the smallest size's time
(latency).

``fit_alpha_beta`` is a least-squares fit that weights every point by 1/t (so it minimises the
relative error), the same criterion as ``reference/data/alpha_beta_fits.csv``. ``load_allreduce_csv``
reads ``reference/data/aiconfigurator_allreduce.csv`` (NVIDIA aiconfigurator's nccl-tests and
custom all-reduce tables); ``fit_measured`` fits every (system, backend, n) series in it. The link
table in ``links.py`` holds the fitted constants; ``benchmarks/allreduce_fit.py`` refits them and
prints the errors, and a test checks that the table still matches the data.
"""

from __future__ import annotations

import csv
import math
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
class Curve:
    """Measured all-reduce times (µs) of one group size at sizes ``2**first_log2``, ``2**(first_log2 + 1)``, ..."""

    first_log2: int
    times_us: tuple[float, ...]

    def time_us(self, nbytes: float, n: int) -> float:
        """Time of ``nbytes`` over ``n`` GPUs: log-log interpolation inside the table; beyond it the
        bytes cost what they cost in the last measured doubling (bandwidth-bound by then)."""
        if n <= 1:
            return 0.0
        times = self.times_us
        x = math.log2(max(nbytes, 1.0)) - self.first_log2
        if x <= 0:
            return times[0]
        i = int(x)
        if i >= len(times) - 1:
            last = 2.0 ** (self.first_log2 + len(times) - 1)
            per_byte = (times[-1] - times[-2]) / (last / 2)
            return times[-1] + (nbytes - last) * per_byte
        return float(times[i] * (times[i + 1] / times[i]) ** (x - i))


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


def measured_curves(samples: Iterable[Sample]) -> dict[tuple[str, int], Curve]:
    """The measured curve of every (series, n): the mean time at each size (sizes are powers of two)."""
    groups: dict[tuple[str, int], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        groups[(s.series, s.n)][s.nbytes].append(s.time_us)
    out: dict[tuple[str, int], Curve] = {}
    for key, by_size in sorted(groups.items()):
        sizes = sorted(by_size)
        first = int(math.log2(sizes[0]))
        if sizes != [2 ** (first + i) for i in range(len(sizes))]:
            raise ValueError(f"{key[0]} n={key[1]}: sizes are not consecutive powers of two")
        out[key] = Curve(first, tuple(round(statistics.fmean(by_size[b]), 2) for b in sizes))
    return out
