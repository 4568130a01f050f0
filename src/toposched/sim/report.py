"""Simulation output: the JSON document, a Rich table, PNG plots and a Markdown/HTML report.

The plots themselves (latency CDFs, SLO met per tenant, NVLink-domain occupancy, GPUs and requests
over time) are built in ``sim/plots.py``; here they are saved and embedded, each under its caption.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from toposched.errors import InputError
from toposched.sim import plots
from toposched.sim.run import PolicyResult
from toposched.sim.scenario import Scenario

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LATENCY = "per-token: (last token time - arrival time) / output tokens, queueing included"
TTFT_ALL = "TTFT p99 all = over every request not rejected, a timed-out one as never served ('-': over 1 % timed out)"

COLUMNS = (
    ("slo_attainment", "SLO met"),
    ("slo_tp8", "TP8 SLO"),
    ("p50_ms", "p50"),
    ("p99_ms", "p99"),
    ("ttft_p50_ms", "TTFT p50"),
    ("ttft_p99_ms", "TTFT p99"),
    ("ttft_p99_all_ms", "TTFT p99 all"),
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

TABLE_COLUMNS = ("slo_attainment", "slo_tp8", "p99_ms", "ttft_p99_ms", "ttft_p99_all_ms", "tpot_p99_ms",
                 "gpu_utilization", "queued_for_nvlink_rate", "migrations", "completed", "timed_out")  # fmt: skip
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


def figures(scenario: Scenario, results: dict[str, PolicyResult]) -> dict[str, Figure]:
    """The report's figures by file name (``sim/plots.py``; ImportError when matplotlib is missing)."""
    return plots.figures(results)


def _rows(results: dict[str, PolicyResult]) -> list[list[str]]:
    return [[name, *(_fmt(_cell(r.metrics, key)) for key, _ in COLUMNS)] for name, r in results.items()]


def _by_tp(results: dict[str, PolicyResult]) -> tuple[list[str], list[list[str]]]:
    sizes = sorted({k for r in results.values() for k in r.metrics["slo_attainment_by_tp"]}, key=int)
    rows = [[name, *(_fmt(r.metrics["slo_attainment_by_tp"].get(k)) for k in sizes)] for name, r in results.items()]
    return [f"TP{k}" for k in sizes], rows


def write_report(out: Path, scenario: Scenario, seed: int, results: dict[str, PolicyResult]) -> list[Path]:
    """PNG plots (``sim/plots.py``: latency CDFs, SLO met per tenant, NVLink-domain occupancy, GPUs and
    requests over time) and report.md / report.html with the tables and each plot under its caption."""
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
        *(f"{plots.CAPTIONS[name]}\n\n![{name}]({name})\n" for name in figs),
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
        + "".join(f"<p>{html.escape(plots.CAPTIONS[name])}</p><p><img src='{html.escape(name)}'></p>" for name in figs)
    )
    report_html = out / "report.html"
    report_html.write_text(page)
    written.append(report_html)
    return written
