"""The PNG plots of ``simulate --out``: matplotlib figures built from the runs' results.

* ``latency_cdf.png``: one panel per latency (per-token, TTFT, TPOT), every policy's CDF on a log
  x-axis, its p50 (circle) and p99 (triangle) marked on the curve; tenant SLOs dashed.
* ``tenant_slo.png``: SLO met per tenant, a bar per policy, the value on each bar.
* ``domain_occupancy.png``: a heat map per policy of the share of each NVLink domain's GPUs held over
  time (domains down, time across).
* ``gpus_over_time.png`` and ``queue_over_time.png``: GPUs held and healthy; requests waiting and
  running; one panel per policy.

CDFs and counts are step functions (``drawstyle="steps-post"``: a value holds until the next
sample, nothing is interpolated); the heat map's cells hold a sample until the next. Each builder
returns a ``Figure`` (``matplotlib.use("Agg")`` first) so tests can look at its axes before it is saved.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from toposched.sim.metrics import DomainOccupancy, pct
from toposched.sim.run import PolicyResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LATENCIES = (
    ("per_token_ms", "per-token latency (ms)", "per-token: (last token - arrival) / output tokens"),
    ("ttft_ms", "TTFT (ms)", "time to first token, queueing included"),
    ("tpot_ms", "TPOT (ms)", "time per output token after the first"),
)
"""The CDF panels: ``PolicyResult`` field, x label, panel title."""

LOG_FLOOR_MS = 1e-3
"""Where a latency of 0 ms sits on the CDFs' log axis."""

MARKS = ((0.50, "o", "p50"), (0.99, "^", "p99"))
"""Quantiles marked on each CDF: quantile, marker, name."""

MAX_HEAT_ROWS = 48
"""Most rows in a heat-map panel: more NVLink domains are pooled, consecutive ones per row."""

CAPTIONS = {
    "latency_cdf.png": "Latency CDFs, log x-axis; circle = p50, triangle = p99 of each policy; dashed = tenant SLOs.",
    "tenant_slo.png": "SLO met per tenant (requests within their tenant's per-token SLO / all its requests).",
    "domain_occupancy.png": "Share of each NVLink domain's GPUs held by instances over time, per policy.",
    "gpus_over_time.png": "GPUs held by instances and healthy GPUs over time, per policy.",
    "queue_over_time.png": "Requests waiting and running over time, per policy.",
}
"""One line per plot for report.md / report.html, in the order the report shows them."""


def _agg() -> None:
    """Draw off screen (a run on a server has no display); the callers import pyplot after this."""
    import matplotlib

    matplotlib.use("Agg")


def tenant_slos(results: dict[str, PolicyResult]) -> list[float]:
    """The tenants' per-token SLOs (ms), distinct and sorted."""
    return sorted({t["slo_ms"] for r in results.values() for t in r.metrics["tenants"].values()})


def quantile_point(values: list[float], q: float) -> tuple[float, float] | None:
    """Where quantile ``q`` sits on the step CDF of ``values``: (nearest-rank value, its share done)."""
    value = pct(values, q)
    if value is None:
        return None
    n = len(values)
    return value, max(1, math.ceil(q * n)) / n


def ms(value: float) -> str:
    """A latency for a label: three significant digits, whole with thousands commas from 100 on."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _plain_log() -> type:
    from matplotlib.ticker import LogFormatter

    class PlainLog(LogFormatter):
        """Labels the ticks ``LogFormatter`` labels, written by ``ms`` (10, 100, 10,000; not 1e4)."""

        def __call__(self, x: float, pos: int | None = None) -> str:
            return ms(x) if super().__call__(x, pos) else ""

    return PlainLog


def latency_cdf_figure(results: dict[str, PolicyResult]) -> Figure:
    """One panel per latency, all policies on a log x-axis, p50 and p99 marked per policy."""
    _agg()
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    plain_log = _plain_log()
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(5.2 * len(LATENCIES), 4.4), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (field, xlabel, title) in zip(axes[0], LATENCIES, strict=True):
        for k, (name, result) in enumerate(results.items()):
            # a log axis has no 0: a latency of 0 is drawn at 1 us (none is dropped, so the curve and its
            # p50/p99 are those of --json)
            values = sorted(max(v, LOG_FLOOR_MS) for v in getattr(result, field))
            if not values:
                continue
            colour = colours[k % len(colours)]
            n = len(values)
            marks = [quantile_point(values, q) for q, _, _ in MARKS]
            label = name + ": " + ", ".join(f"{m} {ms(p[0])}" for (_, _, m), p in zip(MARKS, marks, strict=True) if p)
            ax.plot(values, [(i + 1) / n for i in range(n)], drawstyle="steps-post", color=colour, label=label)
            for (_, marker, _), point in zip(MARKS, marks, strict=True):
                if point is not None:
                    ax.plot(*point, marker=marker, color=colour, markeredgecolor="white", markersize=8, zorder=3)
        if field == "per_token_ms":
            for slo in tenant_slos(results):
                ax.axvline(slo, color="grey", linestyle="--", linewidth=0.8)
        for q, _, _ in MARKS:
            ax.axhline(q, color="lightgrey", linestyle=":", linewidth=0.8, zorder=0)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(plain_log(labelOnlyBase=False))  # 10, 100, 10,000: not 1e4
        ax.xaxis.set_minor_formatter(plain_log(labelOnlyBase=False, minor_thresholds=(1, 0.4)))
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="major", axis="x", color="0.92")
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=9)
        handles, _ = ax.get_legend_handles_labels()
        keys = [Line2D([], [], marker=mk, color="0.3", linestyle="", label=m) for _, mk, m in MARKS]
        ax.legend(handles=[*handles, *keys], fontsize=7, loc="lower right")
    axes[0, 0].set_ylabel("share of completed requests")
    fig.suptitle("Latency CDFs (log scale; values in ms)", fontsize=10)
    fig.tight_layout()
    return fig


def tenant_attainment(results: dict[str, PolicyResult]) -> dict[str, dict[str, float | None]]:
    """SLO met by tenant, then by policy (``metrics.tenants.{name}.slo_attainment``; None: no requests)."""
    first = next(iter(results.values()), None)
    tenants = list(first.metrics["tenants"]) if first is not None else []
    return {t: {name: r.metrics["tenants"][t]["slo_attainment"] for name, r in results.items()} for t in tenants}


def share_label(value: float | None) -> str:
    """A share as a bar label: one decimal of a percent, never rounded up to 100 % or down to 0 %."""
    if value is None:
        return "n/a"
    if 0.999 <= value < 1:
        return ">99.9%"
    if 0 < value < 0.001:
        return "<0.1%"
    return f"{value:.1%}"


def tenant_slo_figure(results: dict[str, PolicyResult]) -> Figure:
    """Grouped bars: tenants along x, a bar per policy, its SLO attainment written on it."""
    _agg()
    import matplotlib.pyplot as plt

    table = tenant_attainment(results)
    names = list(results)
    tenants = list(table)
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 + len(tenants) * (0.9 + 0.45 * len(names))), 4.2))
    upright = len(names) <= 2
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(tenants))]
        values = [table[t][name] for t in tenants]
        bars = ax.bar(xs, [v or 0.0 for v in values], width, label=name)
        labels = [share_label(v) for v in values]
        ax.bar_label(bars, labels, fontsize=7, padding=2, rotation=0 if upright else 90)
    first = next(iter(results.values()), None)
    info = first.metrics["tenants"] if first is not None else {}
    ax.set_xticks(range(len(tenants)))
    ax.set_xticklabels([f"{t}\nTP{info[t]['tp']}, SLO {info[t]['slo_ms']:g} ms/token" for t in tenants], fontsize=8)
    ax.set_ylim(0, 1.12 if upright else 1.22)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.set_ylabel("SLO met (share of the tenant's requests)")
    ax.set_title("SLO attainment per tenant", fontsize=10)
    ax.legend(title="policy", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def pooled(occupancy: DomainOccupancy, max_rows: int = MAX_HEAT_ROWS) -> tuple[list[str], list[list[float]]]:
    """Row labels and shares (row, sample) of the heat map: consecutive rows pooled (GPUs held / GPUs of
    the pool) so at most ``max_rows`` remain."""
    per = max(1, math.ceil(len(occupancy.rows) / max_rows))
    labels: list[str] = []
    shares: list[list[float]] = []
    for lo in range(0, len(occupancy.rows), per):
        hi = min(lo + per, len(occupancy.rows))
        size = sum(occupancy.sizes[lo:hi])
        labels.append(occupancy.rows[lo] if per == 1 else f"{lo + 1}-{hi}")
        shares.append([sum(h[lo:hi]) / size if size else 0.0 for h in occupancy.held])
    return labels, shares


def _edges(occupancy: DomainOccupancy) -> list[float]:
    """Time edges of the cells: each sample until the next, the last until the run's end."""
    times = list(occupancy.times)
    step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 1.0
    end = occupancy.end_s if math.isfinite(occupancy.end_s) and occupancy.end_s > times[-1] else times[-1] + step
    return [*times, end]


def domain_occupancy_figure(results: dict[str, PolicyResult]) -> Figure | None:
    """A heat map per policy: NVLink domains down, time across, colour = share of the domain's GPUs
    held. None when no run took a sample."""
    runs = {name: r.occupancy for name, r in results.items() if r.occupancy is not None and r.occupancy.times}
    if not runs:
        return None
    _agg()
    import matplotlib.pyplot as plt

    rows = max(len(pooled(o)[0]) for o in runs.values())
    height = max(1.7, 0.15 * rows + 0.9)
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(9, height * len(runs) + 0.4), sharex=True, squeeze=False, layout="constrained"
    )
    meshes = []
    for ax, (name, occupancy) in zip(axes[:, 0], runs.items(), strict=True):
        labels, shares = pooled(occupancy)
        mesh = ax.pcolormesh(_edges(occupancy), range(len(labels) + 1), shares, cmap="Blues", vmin=0.0, vmax=1.0)
        meshes.append(mesh)
        ax.invert_yaxis()
        every = max(1, math.ceil(len(labels) / 16))
        ticks = list(range(0, len(labels), every))
        ax.set_yticks([t + 0.5 for t in ticks])
        ax.set_yticklabels([labels[t] for t in ticks], fontsize=7)
        pooled_by = math.ceil(len(occupancy.rows) / len(labels))
        ax.set_ylabel("NVLink domain" if pooled_by == 1 else f"domains ({pooled_by} a row)", fontsize=8)
        ax.set_title(f"{name}: share of each NVLink domain's GPUs held", fontsize=9)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.colorbar(meshes[0], ax=axes[:, 0].tolist(), label="share of the domain's GPUs held", shrink=0.5, aspect=30)
    return fig


def _over_time(results: dict[str, PolicyResult], which: str) -> Figure:
    _agg()
    import matplotlib.pyplot as plt

    names = list(results)
    rows = max(1, len(names))
    fig, axes = plt.subplots(rows, 1, figsize=(7, 2.4 * rows), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        if which == "queue":
            timeline = results[name].timeline
            times = [t for t, _, _ in timeline]
            ax.plot(times, [w for _, w, _ in timeline], drawstyle="steps-post", label="waiting")
            ax.plot(times, [n for _, _, n in timeline], drawstyle="steps-post", label="running")
            ax.set_ylabel("requests")
            ax.set_title(f"{name}: requests waiting and running", fontsize=9)
            ax.legend(fontsize=8, loc="upper right")
        else:
            series = results[name].gpu_series
            times = [s[0] for s in series]
            ax.plot(times, [s[1] for s in series], drawstyle="steps-post", label="held by instances")
            ax.plot(times, [s[3] for s in series], drawstyle="steps-post", label="healthy", linestyle="--")
            ax.set_ylim(0, max(max((s[3] for s in series), default=1), 1) * 1.3)  # room for the legend above the lines
            ax.set_ylabel("GPUs")
            ax.set_title(f"{name}: GPUs held", fontsize=9)
            ax.legend(fontsize=8, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    return fig


def figures(results: dict[str, PolicyResult]) -> dict[str, Figure]:
    """The report's figures by file name, in ``CAPTIONS`` order (ImportError when matplotlib is missing)."""
    built: dict[str, Figure | None] = {
        "latency_cdf.png": latency_cdf_figure(results),
        "tenant_slo.png": tenant_slo_figure(results),
        "domain_occupancy.png": domain_occupancy_figure(results),
        "gpus_over_time.png": _over_time(results, "gpus"),
        "queue_over_time.png": _over_time(results, "queue"),
    }
    return {name: fig for name, fig in built.items() if fig is not None}


__all__ = [
    "CAPTIONS",
    "LATENCIES",
    "MARKS",
    "MAX_HEAT_ROWS",
    "domain_occupancy_figure",
    "figures",
    "latency_cdf_figure",
    "ms",
    "pooled",
    "quantile_point",
    "share_label",
    "tenant_attainment",
    "tenant_slo_figure",
    "tenant_slos",
]
