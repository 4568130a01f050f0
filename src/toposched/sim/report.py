"""Simulation output: the JSON document, a Rich table, PNG plots and a Markdown/HTML report."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from rich.table import Table

from toposched.errors import InputError
from toposched.sim.run import PolicyResult
from toposched.sim.scenario import Scenario

COLUMNS = (
    ("p50_ms", "p50"),
    ("p99_ms", "p99"),
    ("ttft_p99_ms", "TTFT p99"),
    ("slo_attainment", "SLO met"),
    ("intra_domain_rate", "in domain"),
    ("completed", "done"),
    ("timed_out", "t/o"),
    ("instances", "inst"),
)


def result_json(scenario: Scenario, seed: int, results: dict[str, PolicyResult]) -> dict[str, Any]:
    return {
        "scenario": scenario.name,
        "seed": seed,
        "latency": "per-token: (last token time - arrival time) / output tokens, queueing included",
        "slo_ms": scenario.slo_ms,
        "policies": {name: r.metrics for name, r in results.items()},
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:,.1f}"
    return str(value)


def result_table(scenario: Scenario, results: dict[str, PolicyResult]) -> Table:
    table = Table(
        title=f"{scenario.name}: {scenario.requests} requests, SLO {scenario.slo_ms:g} ms/token (latencies in ms)"
    )
    table.add_column("policy")
    for _, label in COLUMNS:
        table.add_column(label, justify="right")
    for name, r in results.items():
        table.add_row(name, *(_fmt(r.metrics.get(key)) for key, _ in COLUMNS))
    return table


def write_report(out: Path, scenario: Scenario, seed: int, results: dict[str, PolicyResult]) -> list[Path]:
    """PNG plots (latency CDF; queue and running requests over time) and report.md / report.html."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InputError("--out needs matplotlib", fix="pip install 'toposched[plots]'") from exc
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        values = sorted(r.per_token_ms)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    ax.axvline(scenario.slo_ms, color="grey", linestyle="--", label=f"SLO {scenario.slo_ms:g} ms")
    ax.set_xlabel("per-token latency (ms)")
    ax.set_ylabel("share of completed requests")
    ax.set_title(f"{scenario.name}: latency CDF")
    ax.legend()
    cdf = out / "latency_cdf.png"
    fig.tight_layout()
    fig.savefig(cdf, dpi=110)
    plt.close(fig)
    written.append(cdf)
    fig, (q_ax, r_ax) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for name, r in results.items():
        if r.timeline:
            times = [t for t, _, _ in r.timeline]
            q_ax.plot(times, [q for _, q, _ in r.timeline], label=name)
            r_ax.plot(times, [n for _, _, n in r.timeline], label=name)
    q_ax.set_ylabel("queued requests")
    r_ax.set_ylabel("running requests")
    r_ax.set_xlabel("simulated time (s)")
    q_ax.legend()
    fig.tight_layout()
    over_time = out / "queue_over_time.png"
    fig.savefig(over_time, dpi=110)
    plt.close(fig)
    written.append(over_time)

    keys = [k for k, _ in COLUMNS]
    head = "| policy | " + " | ".join(label for _, label in COLUMNS) + " |"
    rows = [f"| {n} | " + " | ".join(_fmt(r.metrics.get(k)) for k in keys) + " |" for n, r in results.items()]
    md = [
        f"# Simulation: {scenario.name} (seed {seed})",
        "",
        f"{scenario.requests} requests on `{scenario.cluster}`, model `{Path(scenario.model).name}`, "
        f"per-token SLO {scenario.slo_ms:g} ms. Per-token latency = (last token - arrival) / output tokens.",
        "",
        head,
        "|" + "---|" * (len(keys) + 1),
        *rows,
        "",
        "![latency CDF](latency_cdf.png)",
        "",
        "![queue over time](queue_over_time.png)",
        "",
    ]
    report_md = out / "report.md"
    report_md.write_text("\n".join(md))
    written.append(report_md)
    cells = "".join(
        "<tr><td>"
        + html.escape(n)
        + "</td>"
        + "".join(f"<td>{html.escape(_fmt(r.metrics.get(k)))}</td>" for k in keys)
        + "</tr>"
        for n, r in results.items()
    )
    page = (
        f"<!doctype html><meta charset='utf-8'><title>{html.escape(scenario.name)}</title>"
        f"<h1>Simulation: {html.escape(scenario.name)} (seed {seed})</h1>"
        "<table border='1' cellpadding='4'><tr><th>policy</th>"
        + "".join(f"<th>{html.escape(label)}</th>" for _, label in COLUMNS)
        + f"</tr>{cells}</table>"
        "<p><img src='latency_cdf.png'></p><p><img src='queue_over_time.png'></p>"
    )
    report_html = out / "report.html"
    report_html.write_text(page)
    written.append(report_html)
    return written
