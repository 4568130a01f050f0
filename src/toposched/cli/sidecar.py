"""``toposched sidecar``: check a placement's GPUs every interval and alert on drift.

The placement comes from a plan document (``toposched plan --json``): ``--placement FILE`` takes its
only placement, ``--placement ID --plan FILE`` picks one by id. NVML is the real ``pynvml`` unless
``--fake SCENARIO`` runs a scripted drift scenario on the plan's topology (see
``sidecar/fake_scenarios.py``). Alerts, resolutions and per-cycle CPU cost are JSON lines on stdout.
"""

from __future__ import annotations

import json
import math
import socket
import sys
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from toposched.binding.plan_doc import PlanDoc, load_plan
from toposched.cli._common import read_token
from toposched.errors import InputError, NoDriverError, UnknownNameError, first_problem
from toposched.sidecar.checks import expectations_from_plan
from toposched.sidecar.drift import LatencyDrift
from toposched.sidecar.fake_scenarios import build_scenario
from toposched.sidecar.loop import LoopConfig, Report, Sidecar, SidecarMetrics
from toposched.sidecar.react import react
from toposched.solver.request import Placement
from toposched.solver.scheduler import Scheduler
from toposched.topology.nvml import NvmlSession


def register(app: typer.Typer) -> None:
    app.command("sidecar")(sidecar_cmd)


def _resolve(placement: str, plan: str | None) -> tuple[PlanDoc, Placement]:
    if plan is None:
        try:
            is_file = Path(placement).is_file()
        except (OSError, ValueError):  # a name too long for the file system, a NUL byte: not a file
            is_file = False
        if not is_file:
            shown = placement if len(placement) <= 60 else placement[:57] + "..."
            raise InputError(
                f"--placement {shown!r} is not a plan file", fix="pass a plan JSON, or an id with --plan FILE"
            )
        doc = load_plan(placement)
        if len(doc.placements) > 1:
            ids = ", ".join(p.id for p in doc.placements)
            raise InputError(
                f"{placement} holds {len(doc.placements)} placements ({ids})", fix="give one id and --plan"
            )
        return doc, doc.placements[0]
    doc = load_plan(plan)
    by_id = {p.id: p for p in doc.placements}
    if placement not in by_id:
        raise UnknownNameError("placement", placement, by_id)
    return doc, by_id[placement]


def _real_nvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise NoDriverError("the nvidia-ml-py package is not installed", fix="pip install nvidia-ml-py") from exc
    NvmlSession(pynvml).call("init", pynvml.nvmlInit)
    return pynvml


def sidecar_cmd(
    placement: str = typer.Option(
        ..., "--placement", help="Placement id (with --plan) or a plan file.", metavar="ID|FILE"
    ),
    plan: str | None = typer.Option(None, "--plan", help="Plan JSON from `toposched plan --json`.", metavar="FILE"),
    node: str | None = typer.Option(
        None, "--node", help="Node this sidecar runs on (default: this host or the first)."
    ),
    interval: float = typer.Option(10.0, "--interval", help="Seconds between check cycles."),
    iterations: int | None = typer.Option(None, "--iterations", help="Stop after N cycles (default: run forever)."),
    webhook: str | None = typer.Option(None, "--webhook", help="POST each report with new alerts to this URL."),
    token_file: Path | None = typer.Option(
        None,
        "--token-file",
        help="Bearer token for --webhook (default: $TOPOSCHED_REPORT_TOKEN, then $TOPOSCHED_API_TOKEN).",
        metavar="FILE",
    ),
    fake: str | None = typer.Option(
        None, "--fake", help="Scripted NVML scenario: steady|link-down|traffic-ramp|hbm-leak."
    ),
    pcie_budget_gbps: float | None = typer.Option(
        None, "--pcie-budget-gbps", min=0.001, max=1e6, help="PCIe budget per GPU (GB/s)."
    ),
    metrics_file: str | None = typer.Option(None, "--metrics-file", help="Write Prometheus text here at the end."),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", min=1, max=65535, help="Serve Prometheus metrics on this port."
    ),
    do_react: bool = typer.Option(False, "--react", help="Print the service's reaction to each report."),
    engine_metrics: str | None = typer.Option(
        None, "--engine-metrics", help="The engine's /metrics URL: export predicted-vs-observed latency.", metavar="URL"
    ),
) -> None:
    """Check the placement's GPUs every interval: NVLink domain, PCIe/NVLink budget, HBM vs ledger."""
    doc, chosen = _resolve(placement, plan)
    nodes = [r.node for r in chosen.ranks]
    here = node or (socket.gethostname() if socket.gethostname() in nodes else nodes[0])
    if here not in nodes:
        raise InputError(f"placement {chosen.id} has no GPU on node {here!r} (it uses {sorted(set(nodes))})")
    if pcie_budget_gbps is not None and not math.isfinite(pcie_budget_gbps):
        raise InputError(f"--pcie-budget-gbps {pcie_budget_gbps}: not a number of GB/s", fix="e.g. 16")
    if metrics_file is not None and not Path(metrics_file).parent.is_dir():
        raise InputError(f"--metrics-file {metrics_file!r}: its folder does not exist", fix="create it first")
    exp = expectations_from_plan(chosen, doc.cluster, node=here, pcie_budget_gbps=pcie_budget_gbps)
    try:
        # without --token-file the loop reads the environment (sidecar.loop.webhook_token)
        token = read_token(token_file) if token_file is not None else None
        config = LoopConfig(interval_s=interval, iterations=iterations, webhook=webhook, token=token)
    except ValidationError as exc:
        problem = first_problem(exc)
        flag = {"interval_s": "--interval", "iterations": "--iterations", "webhook": "--webhook"}.get(
            problem.field, "--interval"
        )
        raise InputError(f"{flag}: {problem.msg} (got {problem.input!r})") from exc
    metrics = SidecarMetrics()
    if fake is not None:
        lib: Any = build_scenario(fake, doc.cluster.node(here), exp, interval_s=interval)
        lib.nvmlInit()
        before = lib.advance
    else:
        lib, before = _real_nvml(), None
    if metrics_port is not None:
        from prometheus_client import start_http_server

        try:
            start_http_server(metrics_port, registry=metrics.registry)
        except OSError as exc:
            raise InputError(f"--metrics-port {metrics_port}: cannot listen ({exc})", fix="a free port") from None

    def on_report(report: Report) -> None:
        if not do_react:
            return
        busy = {ref for p in doc.placements for ref in p.gpu_refs}
        scheduler = Scheduler(doc.cluster, busy=busy)
        reaction = react(report, scheduler, chosen, doc.request)
        sys.stdout.write(json.dumps({"event": "reaction", "cycle": report.cycle, **reaction.to_json()}) + "\n")

    drift = None
    if engine_metrics is not None:
        if not engine_metrics.startswith(("http://", "https://")):
            raise InputError(f"--engine-metrics {engine_metrics[:60]!r} is not an http(s) URL")
        predicted = {"ttft": chosen.ttft_ms, "tpot": chosen.tpot_ms}
        drift = LatencyDrift(engine_metrics, chosen.id, predicted)
    sidecar = Sidecar(lib, exp, config=config, metrics=metrics, before_cycle=before, on_report=on_report, drift=drift)
    try:
        sidecar.run()
    except KeyboardInterrupt:
        pass
    finally:
        if metrics_file is not None:
            Path(metrics_file).write_text(metrics.text())
