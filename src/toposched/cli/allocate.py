"""``toposched allocate``: a device plugin's GetPreferredAllocation, answered from the topology.

    toposched allocate --smi FILE [--available 0,1,...] [--must-include 2,...] --size N --json

prints ``{"gpus": [...]}``; an impossible request prints ``{"gpus": [], "reason": "..."}`` and exits 2.
With ``--json`` every refusal, bad flag included, is that JSON object on stdout plus one line on
stderr, so a caller can always parse stdout. ``--explain`` adds the score and the method to the JSON.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, NoReturn

import typer

from toposched.cli._common import CLUSTER, LIVE, PRESET, SMI, console, err_console, print_json, source_ref
from toposched.errors import InputError, ToposchedError, UnknownNameError
from toposched.solver.allocate import AllocationResult, check_indices, preferred_allocation
from toposched.topology.model import Node
from toposched.topology.sources import load_source

EXIT_REFUSED = 2


def register(app: typer.Typer) -> None:
    app.command("allocate")(allocate)


def parse_index_list(text: str, flag: str) -> list[int]:
    """``"0,1, 3"`` -> ``[0, 1, 3]``; anything else is an ``InputError`` naming ``flag``."""
    values: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            if text.strip():
                raise InputError(f"{flag} {text!r} has an empty item", fix=f"write {flag} 0,1,2")
            continue
        if not item.isdigit():
            raise InputError(f"{flag} {text!r}: {item!r} is not a GPU index", fix=f"write {flag} 0,1,2")
        values.append(int(item))
    return values


def pick_node(nodes: tuple[Node, ...], name: str | None) -> Node:
    """The node ``--node`` names, or the only node; several nodes and no ``--node`` is an error."""
    if name is None:
        if len(nodes) > 1:
            raise InputError(
                f"the topology has {len(nodes)} nodes; this command looks at one",
                fix="pass --node NAME (" + ", ".join(n.name for n in nodes[:4]) + (", ...)" if len(nodes) > 4 else ")"),
            )
        return nodes[0]
    for node in nodes:
        if node.name == name:
            return node
    raise UnknownNameError("node", name, [n.name for n in nodes])


def _refuse(reason: str, json_out: bool, fix: str | None = None) -> NoReturn:
    if json_out:
        print_json({"gpus": [], "reason": reason})
    err_console.print(f"error: {reason}", markup=False, soft_wrap=True)
    if fix:
        err_console.print(f"  fix: {fix}", markup=False, soft_wrap=True)
    raise typer.Exit(EXIT_REFUSED)


def _details(node: Node, result: AllocationResult) -> dict[str, Any]:
    return {
        "node": node.name,
        "method": result.method,
        "candidates": result.candidates,
        "score": asdict(result.score) if result.score else None,
        "why": result.why(),
    }


def allocate(
    size: int = typer.Option(..., "--size", help="How many GPUs to allocate.", metavar="N"),
    available: str | None = typer.Option(
        None, "--available", help="GPU indices free to use (default: every GPU of the node).", metavar="LIST"
    ),
    must_include: str | None = typer.Option(
        None, "--must-include", help="GPU indices the answer must contain.", metavar="LIST"
    ),
    smi: str | None = SMI,
    preset: str | None = PRESET,
    cluster: str | None = CLUSTER,
    live: bool = LIVE,
    node_name: str | None = typer.Option(None, "--node", help="Node of a multi-node topology.", metavar="NAME"),
    json_out: bool = typer.Option(False, "--json", help='Print {"gpus": [...]} (or {"gpus": [], "reason": ...}).'),
    explain: bool = typer.Option(False, "--explain", help="With --json, add the score, method and reasons."),
) -> None:
    """Pick the GPUs a Kubernetes device plugin should prefer (GetPreferredAllocation)."""
    try:
        ref = source_ref(smi, preset, cluster, live)
        if ref is None:
            raise InputError("no topology given", fix="pass --smi FILE, --preset NAME, --cluster FILE or --live")
        loaded = load_source(ref)
        for warning in loaded.warnings:
            err_console.print(f"warning: {warning}", markup=False, soft_wrap=True)
        node = pick_node(loaded.cluster.nodes, node_name)
        avail = parse_index_list(available, "--available") if available is not None else [g.index for g in node.gpus]
        must = parse_index_list(must_include, "--must-include") if must_include is not None else []
        check_indices(node, avail, "--available")
        check_indices(node, must, "--must-include")
        result = preferred_allocation(node, avail, must, size)
    except ToposchedError as exc:
        _refuse(exc.message, json_out, exc.fix)
    if not result.ok:
        _refuse(result.reason or "no allocation", json_out)
    if json_out:
        print_json({"gpus": list(result.gpus), **(_details(node, result) if explain else {})})
        return
    console.print(
        f"{node.name}: GPUs {','.join(map(str, result.gpus))}",
        markup=False,
        soft_wrap=True,
    )
    for line in result.why():
        console.print(f"  - {line}", markup=False, soft_wrap=True)
