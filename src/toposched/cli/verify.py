"""``toposched verify``: check a running placement against NCCL's own log and the topology matrix.

``verify nccl LOGFILE`` reads an ``NCCL_DEBUG=INFO`` log and reports ranks, nodes, the transport
family of every connection and what looks wrong. ``verify topo`` says whether a GPU set is inside
one NVLink clique, or else one NUMA node with no SYS pair.

One exit-code rule for both (docs/sidecar.md): 0 when nothing is wrong (info findings such as
``mnnvl`` are not problems), 1 when a problem is found (a ``warning`` finding of ``verify nccl``, a
set that is not OK for ``verify topo``), 2 for bad input.
"""

from __future__ import annotations

from collections import Counter

import typer
from rich.table import Table

from toposched.cli._common import CLUSTER, LIVE, PRESET, SMI, console, print_json, source_ref
from toposched.cli.allocate import pick_node
from toposched.errors import InputError
from toposched.sidecar.gpuset import parse_gpu_list, verify_gpu_set
from toposched.sidecar.nccl import read_nccl_file
from toposched.sidecar.nccl_report import NcclReport
from toposched.topology.sources import load_source

verify_app = typer.Typer(help="Verify placements: NCCL logs and GPU-set topology.", no_args_is_help=True)

EXIT_PROBLEM = 1
"""Exit status of a verify command that found a problem (0: none found; 2: bad input)."""


def register(app: typer.Typer) -> None:
    app.add_typer(verify_app, name="verify")


def _show_nccl(report: NcclReport) -> None:
    console.print(f"NCCL log {report.source}  (NCCL {report.nccl_version or 'version not shown'})")
    nranks = "not shown" if report.nranks is None else f"{report.nranks} ({report.nranks_source})"
    nnodes = "not shown" if report.nnodes is None else str(report.nnodes)
    console.print(f"  nranks {nranks}   nnodes {nnodes}   hosts {', '.join(report.hosts)}")
    console.print(
        f"  transports {', '.join(report.transports) or 'none'}   GPUDirect RDMA {'yes' if report.gdrdma else 'no'}"
    )
    if report.connections:
        table = Table("transport family", "connections", "example")
        counts = Counter(c.family for c in report.connections)
        example = {c.family: c for c in reversed(report.connections)}
        for family, n in sorted(counts.items()):
            c = example[family]
            table.add_row(family, str(n), f"{c.src} -> {c.dst if c.dst is not None else '-'} via {c.transport}")
        console.print(table)
    for f in report.findings:
        console.print(f"  [{f.severity}] {f.code}: {f.message}", markup=False)


@verify_app.command("nccl")
def nccl_cmd(
    logfile: str = typer.Argument(..., metavar="LOGFILE", help="NCCL_DEBUG=INFO output (engine or nccl-tests log)."),
    nvswitch: bool | None = typer.Option(
        None, "--nvswitch/--no-nvswitch", help="The GPUs are on an NVSwitch board (default: judge from the log)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Ranks, nodes, the transport of each connection, and findings; exit 1 on a warning finding."""
    report = read_nccl_file(logfile, nvswitch=nvswitch)
    if json_out:
        print_json(report.to_json())
    else:
        _show_nccl(report)
    if any(f.severity == "warning" for f in report.findings):
        raise typer.Exit(EXIT_PROBLEM)


@verify_app.command("topo")
def topo_cmd(
    gpus: str = typer.Option(..., "--gpus", help="GPU indices of the set, e.g. 0,1,2,3."),
    smi: str | None = SMI,
    preset: str | None = PRESET,
    cluster: str | None = CLUSTER,
    live: bool = LIVE,
    node_name: str | None = typer.Option(None, "--node", help="Node of a multi-node topology.", metavar="NAME"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Exit 0 when the GPUs share one NVLink clique, or one NUMA node with no SYS pair; else exit 1."""
    ref = source_ref(smi, preset, cluster, live)
    if ref is None:
        raise InputError("no topology given", fix="pass --smi FILE, --preset NAME, --cluster FILE or --live")
    loaded = load_source(ref)
    verdict = verify_gpu_set(pick_node(loaded.cluster.nodes, node_name), parse_gpu_list(gpus))
    if json_out:
        print_json(verdict.to_json())
    else:
        where = verdict.nvlink_domain or "no NVLink domain"
        numa = "unknown" if verdict.numa_node is None else str(verdict.numa_node)
        state = "OK" if verdict.ok else "NOT OK"
        console.print(
            f"{state}: GPUs {list(verdict.gpus)} on {verdict.node}: level {verdict.level}, {where}, NUMA {numa}"
        )
        for reason in verdict.reasons:
            console.print(f"  {reason}", markup=False)
    if not verdict.ok:
        raise typer.Exit(EXIT_PROBLEM)
