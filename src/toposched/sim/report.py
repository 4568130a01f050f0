"""Simulation output: the JSON document, a Rich table, PNG plots and a Markdown/HTML report.

Plots are step functions (``drawstyle="steps-post"``: a CDF or a count holds its value until the
next sample, nothing is interpolated), one panel per policy wherever lines of several policies
would lie on top of each other.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from toposched.errors import InputError
from toposched.sim.run import PolicyResult
from toposched.sim.scenario import Scenario

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LATENCY = "per-token: (last token time - arrival time) / output tokens, queueing included"

COLUMNS = (
    ("slo_attainment", "SLO met"),
    ("slo_tp8", "TP8 SLO"),
    ("p50_ms", "p50"),
    ("p99_ms", "p99"),
    ("ttft_p50_ms", "TTFT p50"),
    ("ttft_p99_ms", "TTFT p99"),
    ("tpot_p50_ms", "TPOT p50"),
    ("tpot_p99_ms", "TPOT p99"),
    ("kv_transfer_p50_ms", "KV p50"),
    ("kv_transfer_p99_ms", "KV p99"),
    ("gpu_utilization", "GPU util"),
    ("queued_for_nvlink_rate", "NVLink wait"),
    ("held_for_headroom_rate", "headroom wait"),
    ("migrations", "moves"),
    ("repack_moves", "free moves"),
    ("fallback_placements", "x-domain"),
    ("intra_domain_rate", "in domain"),
    ("completed", "done"),
    ("timed_out", "t/o"),
)

TABLE_COLUMNS = ("slo_attainment", "slo_tp8", "p99_ms", "ttft_p99_ms", "tpot_p99_ms", "gpu_utilization",
                 "queued_for_nvlink_rate", "migrations", "completed", "timed_out")  # fmt: skip
"""The terminal table's columns (the reports have all of ``COLUMNS``)."""

PD_TABLE_COLUMNS = ("ttft_p50_ms", "ttft_p99_ms", "kv_transfer_p50_ms", "kv_transfer_p99_ms", "tpot_p50_ms",
                    "tpot_p99_ms", "p99_ms", "slo_attainment", "completed", "timed_out")  # fmt: skip
"""The terminal table's columns for a disaggregated scenario (one row per policy and layout)."""


def _cell(metrics: dict[str, Any], key: str) -> Any:
    if key == "slo_tp8":
        return metrics.get("slo_attainment_by_tp", {}).get("8")
    return metrics.get(key)


def result_json(scenario: Scenario, seed: int, results: dict[str, PolicyResult]) -> dict[str, Any]:
    tenants = scenario.tenant_list()
    first = next(iter(results.values()), None)
    return {
        "scenario": scenario.name,
        "seed": seed,
        "latency": LATENCY,
        "slo_ms": round(first.metrics["tenants"][tenants[0].name]["slo_ms"], 3)
        if first is not None and len(tenants) == 1
        else None,
        "occupancy": scenario.churn.occupancy if scenario.churn is not None else None,
        "tenants": first.metrics["tenants"] if first is not None else {},
        "policies": {name: r.metrics for name, r in results.items()},
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:,.1f}"
    return str(value)


def _title(scenario: Scenario, results: dict[str, PolicyResult]) -> str:
    first = next(iter(results.values()), None)
    count = first.metrics["requests"] if first is not None else 0
    tenants = scenario.tenant_list()
    slo = ""
    if first is not None and len(tenants) == 1:
        slo = f", SLO {first.metrics['tenants'][tenants[0].name]['slo_ms']:g} ms/token"
    churn = f", churn at occupancy {scenario.churn.occupancy:g}" if scenario.churn is not None else ""
    return f"{scenario.name}: {count:,} requests, {len(tenants)} tenant(s){slo}{churn} (latencies in ms)"


WIDE_TABLE_CHARS = 10
"""Characters a column of the one-row-per-policy table needs; narrower terminals get it transposed."""


def result_table(scenario: Scenario, results: dict[str, PolicyResult], width: int = 200) -> Table:
    """One row per policy when ``width`` (the terminal's) holds every column; else one row per
    metric and one column per policy, so an 80-column terminal shows whole numbers, not ``1.0…``."""
    table = Table(title=_title(scenario, results))
    labels = dict(COLUMNS)
    columns = PD_TABLE_COLUMNS if scenario.pd is not None else TABLE_COLUMNS
    first = "policy/layout" if scenario.pd is not None else "policy"
    if (len(columns) + 1) * WIDE_TABLE_CHARS <= width:
        table.add_column(first, no_wrap=True)
        for key in columns:
            table.add_column(labels[key], justify="right", no_wrap=True)
        for name, r in results.items():
            table.add_row(name, *(_fmt(_cell(r.metrics, key)) for key in columns))
        return table
    table.add_column("metric", no_wrap=True)
    for name in results:
        table.add_column(name, justify="right", no_wrap=True)
    for key in columns:
        table.add_row(labels[key], *(_fmt(_cell(r.metrics, key)) for r in results.values()))
    return table


def tenant_lines(results: dict[str, PolicyResult]) -> list[str]:
    """Per tenant and policy: its SLO met, and why its instances waited or were never placed (held for
    headroom, waiting for NVLink room) with their longest wait. Empty for a one-tenant scenario."""
    first = next(iter(results.values()), None)
    if first is None or len(first.metrics["tenants"]) < 2:
        return []
    out = []
    for tenant in first.metrics["tenants"]:
        out.append(f"tenant {tenant} (TP={first.metrics['tenants'][tenant]['tp']}):")
        for name, r in results.items():
            t = r.metrics["tenants"][tenant]
            wait = t.get("wait_p99_s")
            out.append(
                f"  {name}: SLO met {_fmt(t['slo_attainment'])}; {t.get('instance_arrivals', 0)} instances, "
                f"{t.get('held_for_headroom', 0)} held for headroom, {t.get('waited_for_nvlink', 0)} waited for "
                f"NVLink room, {t.get('never_placed', 0)} never placed, wait p99 {_fmt(wait)} s"
            )
    return out


def _cdf(ax: Any, values: list[float], label: str) -> None:
    ordered = sorted(values)
    if ordered:
        n = len(ordered)
        ax.plot(ordered, [(i + 1) / n for i in range(n)], drawstyle="steps-post", label=label)


def figures(scenario: Scenario, results: dict[str, PolicyResult]) -> dict[str, Figure]:
    """The report's figures by file name (matplotlib; ImportError when it is missing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    rows = max(1, len(names))
    slos = sorted({t["slo_ms"] for r in results.values() for t in r.metrics["tenants"].values()})
    out: dict[str, Figure] = {}

    fig, axes = plt.subplots(rows, 1, figsize=(7, 2.4 * rows), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        _cdf(ax, results[name].per_token_ms, "per-token latency")
        for slo in slos:
            ax.axvline(slo, color="grey", linestyle="--", linewidth=0.8)
        ax.set_ylabel("share done")
        ax.set_title(f"{name}: per-token latency CDF (dashed: tenant SLOs)", fontsize=9)
    axes[-1, 0].set_xlabel("per-token latency (ms)")
    fig.tight_layout()
    out["latency_cdf.png"] = fig

    fig, axes = plt.subplots(rows, 2, figsize=(9, 2.4 * rows), squeeze=False)
    for (ttft_ax, tpot_ax), name in zip(axes, names, strict=True):
        _cdf(ttft_ax, results[name].ttft_ms, "TTFT")
        _cdf(tpot_ax, results[name].tpot_ms, "TPOT")
        ttft_ax.set_xscale("symlog", linthresh=100)
        ttft_ax.set_title(f"{name}: TTFT CDF", fontsize=9)
        tpot_ax.set_title(f"{name}: TPOT CDF", fontsize=9)
        ttft_ax.set_ylabel("share done")
    axes[-1, 0].set_xlabel("TTFT (ms)")
    axes[-1, 1].set_xlabel("TPOT (ms)")
    fig.tight_layout()
    out["ttft_tpot_cdf.png"] = fig

    fig, axes = plt.subplots(rows, 1, figsize=(7, 2.4 * rows), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        timeline = results[name].timeline
        times = [t for t, _, _ in timeline]
        ax.plot(times, [w for _, w, _ in timeline], drawstyle="steps-post", label="waiting")
        ax.plot(times, [n for _, _, n in timeline], drawstyle="steps-post", label="running")
        ax.set_ylabel("requests")
        ax.set_title(f"{name}: requests waiting and running", fontsize=9)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    out["queue_over_time.png"] = fig

    fig, axes = plt.subplots(rows, 1, figsize=(7, 2.4 * rows), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        series = results[name].gpu_series
        times = [s[0] for s in series]
        ax.plot(times, [s[1] for s in series], drawstyle="steps-post", label="held by instances")
        ax.plot(times, [s[3] for s in series], drawstyle="steps-post", label="healthy", linestyle="--")
        ax.set_ylabel("GPUs")
        ax.set_title(f"{name}: GPUs held", fontsize=9)
        ax.legend(fontsize=8, loc="lower right")
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    out["gpus_over_time.png"] = fig
    return out


def _rows(results: dict[str, PolicyResult]) -> list[list[str]]:
    return [[name, *(_fmt(_cell(r.metrics, key)) for key, _ in COLUMNS)] for name, r in results.items()]


def _by_tp(results: dict[str, PolicyResult]) -> tuple[list[str], list[list[str]]]:
    sizes = sorted({k for r in results.values() for k in r.metrics["slo_attainment_by_tp"]}, key=int)
    rows = [[name, *(_fmt(r.metrics["slo_attainment_by_tp"].get(k)) for k in sizes)] for name, r in results.items()]
    return [f"TP{k}" for k in sizes], rows


def write_report(out: Path, scenario: Scenario, seed: int, results: dict[str, PolicyResult]) -> list[Path]:
    """PNG plots (latency, TTFT/TPOT CDFs; requests and GPUs over time) and report.md / report.html."""
    try:
        import matplotlib.pyplot as plt

        figs = figures(scenario, results)
    except ImportError as exc:
        raise InputError("--out needs matplotlib", fix="pip install 'toposched[plots]'") from exc
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, fig in figs.items():
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    labels = [label for _, label in COLUMNS]
    tp_labels, tp_rows = _by_tp(results)
    title = _title(scenario, results)
    md = [
        f"# Simulation: {scenario.name} (seed {seed})",
        "",
        f"{title}. Cluster `{scenario.cluster}`. Latency = {LATENCY}.",
        "",
        "| policy | " + " | ".join(labels) + " |",
        "|" + "---|" * (len(labels) + 1),
        *("| " + " | ".join(row) + " |" for row in _rows(results)),
        "",
        "SLO met by the TP size of the serving instance:",
        "",
        "| policy | " + " | ".join(tp_labels) + " |",
        "|" + "---|" * (len(tp_labels) + 1),
        *("| " + " | ".join(row) + " |" for row in tp_rows),
        "",
        *(f"![{name}]({name})\n" for name in figs),
    ]
    report_md = out / "report.md"
    report_md.write_text("\n".join(md))
    written.append(report_md)

    def table(head: list[str], rows: list[list[str]]) -> str:
        cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        return (
            "<table border='1' cellpadding='4'><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + f"</tr>{cells}</table>"
        )

    page = (
        f"<!doctype html><meta charset='utf-8'><title>{html.escape(scenario.name)}</title>"
        f"<h1>Simulation: {html.escape(scenario.name)} (seed {seed})</h1><p>{html.escape(title)}</p>"
        + table(["policy", *labels], _rows(results))
        + "<p>SLO met by the TP size of the serving instance:</p>"
        + table(["policy", *tp_labels], tp_rows)
        + "".join(f"<p><img src='{html.escape(name)}'></p>" for name in figs)
    )
    report_html = out / "report.html"
    report_html.write_text(page)
    written.append(report_html)
    return written
