"""``toposched defrag``: the fewest moves of small instances that free room for a large one.

Reads the service's state (``--state``: the ledger the service books in), rebuilds the placements from
the bookings' records and prints the ordered moves (``solver/defrag.py``). A dry run by default;
``--apply`` books each replacement next to its old copy. toposched cannot restart engines: start the new
engine on the replacement's GPUs, drain the old one, then release the old copy (``toposched ledger
release ID`` or POST /v1/defrag/finish).

Exit codes: 0 a plan (or nothing to move: a group has the room already), 1 no plan (one line says why),
2 bad input (a missing state file, an unknown model, a topology that is not the state's).
"""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from toposched.cli._common import CLUSTER, PRESET, STATE, console, err_console, print_json, source_ref
from toposched.cli.ledger import JSON, open_existing
from toposched.cli.progress import QUIET, Reporter
from toposched.errors import InputError
from toposched.service.defrag import lease_of
from toposched.service.records import Instance, ServiceScheduler, scheduler_from_ledger
from toposched.service.state import open_topology_store
from toposched.solver.defrag import DefragPlan, defrag_need, search_defrag, start_move
from toposched.solver.request import PlacementRequest
from toposched.topology.model import Cluster
from toposched.topology.sources import load_source
from toposched.workload.catalog import resolve_model
from toposched.workload.parallel import tp_problem, valid_tps


def register(app: typer.Typer) -> None:
    app.command("defrag")(defrag)


def _cluster(url: str, preset: str | None, cluster: str | None) -> Cluster:
    """The topology: the flag's, else the newest DomainMap the service stored in the state."""
    source = source_ref(None, preset, cluster, False)
    if source is not None:
        return load_source(source).cluster
    store = open_topology_store(url)
    stored = store.latest() if store is not None else None
    if stored is None:
        raise InputError(f"{url} holds no topology", fix="pass --preset NAME or --cluster FILE (the service's)")
    return stored.cluster


def _need(
    scheduler: ServiceScheduler, need_gpus: int | None, model: str | None, tp: list[int] | None, level: str | None
) -> tuple[int, str]:
    if (need_gpus is None) == (model is None):
        raise InputError("give --need-gpus N or --model NAME (one of them)")
    if model is None:
        assert need_gpus is not None
        return need_gpus, level or "nvlink"
    spec = resolve_model(model)
    for t in tp or []:  # the check `plan --tp` makes
        problem = tp_problem(spec, t)
        if problem:
            raise InputError(f"--tp {t}: {problem}", fix="valid tp: " + ", ".join(map(str, valid_tps(spec))))
    request = PlacementRequest(id="defrag", model=model, allowed_tp=tuple(tp) if tp else None)
    need, resolved = defrag_need(scheduler, request)
    return need, level or resolved


def _doc(url: str, need: int, level: str, status: str, plan: DefragPlan | None, reason: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"state": url, "need_gpus": need, "level": level, "status": status}
    doc.update(plan.to_json() if plan is not None else {"group": None, "frees": [], "moves": [], "gpus_moved": 0})
    doc["reason"] = reason or None
    return doc


def defrag(
    state: str | None = STATE,
    preset: str | None = PRESET,
    cluster: str | None = CLUSTER,
    gpu: str | None = typer.Option(None, "--gpu", help="GPU type when the topology does not say (e.g. H100-SXM)."),
    need_gpus: int | None = typer.Option(None, "--need-gpus", min=1, help="Free GPUs wanted in one group."),
    model: str | None = typer.Option(None, "--model", "-m", help="Make room for this model's TP group instead."),
    tp: list[int] | None = typer.Option(None, "--tp", help="Allowed TP degree(s) of --model (repeat the flag)."),
    level: str | None = typer.Option(
        None, "--level", help="Free an NVLink domain (nvlink) or a node (node) [default: the model's, else nvlink]."
    ),
    max_moves: int = typer.Option(4, "--max-moves", min=1, max=16, help="Most instances moved."),
    apply: bool = typer.Option(False, "--apply", help="Book the replacements (default: a dry run)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Book nothing (the default; says so explicitly)."),
    as_json: bool = JSON,
    quiet: bool = QUIET,
) -> None:
    """Print the fewest moves that free room for a large instance; --apply books the replacements."""
    if apply and dry_run:
        raise InputError("--apply and --dry-run contradict each other", fix="give one of them")
    if level is not None and level not in ("nvlink", "node"):
        raise InputError(f"--level {level!r}: use nvlink or node")
    with Reporter("defrag", quiet=quiet) as progress:
        progress.stage("opening the state")
        url, ledger = open_existing(state)
        try:
            progress.stage("reading the topology")
            topology = _cluster(url, preset, cluster)
            progress.stage(f"rebuilding the placements on {sum(len(n.gpus) for n in topology.nodes):,} GPUs")
            scheduler, instances = scheduler_from_ledger(topology, ledger, gpu=gpu)
            need, group_level = _need(scheduler, need_gpus, model, tp, level)
            progress.stage(f"looking for {need} free GPUs in one {group_level} group")
            plan, why = search_defrag(scheduler, need, level=group_level, max_moves=max_moves, progress=progress.say)
            status = "no-plan" if plan is None else ("nothing-to-move" if not plan.moves else "planned")
            if plan is not None and plan.moves and apply:
                progress.stage(f"booking {len(plan.moves)} replacement(s)")
                _book(scheduler, plan, instances)
                status = "booked"
        finally:
            ledger.close()
    if as_json:
        print_json(_doc(url, need, group_level, status, plan, why))
    else:
        _print(url, need, group_level, status, plan, why)
    if plan is None:
        raise typer.Exit(1)


def _book(scheduler: ServiceScheduler, plan: DefragPlan, instances: dict[str, Instance]) -> None:
    """Book every replacement, or none: on a refusal the ones booked are released and the error goes on."""
    booked: list[str] = []
    try:
        for move in plan.moves:
            start_move(scheduler, move, ttl_s=lease_of(instances.get(move.placement_id)))
            booked.append(move.replacement_id)
    except BaseException:
        for rid in booked:
            scheduler.release(rid)
        raise


def _print(url: str, need: int, level: str, status: str, plan: DefragPlan | None, why: str) -> None:
    if plan is None:
        err_console.print(f"no plan: {why}", markup=False, soft_wrap=True)
        return
    if not plan.moves:
        console.print(f"nothing to move: {level} group {plan.group} has {len(plan.frees)} free GPUs", markup=False)
        return
    verb = "booked" if status == "booked" else "dry run"
    table = Table(
        title=f"{verb}: {len(plan.moves)} move(s) of {plan.gpus_moved} GPU(s) leave {need} free in {plan.group}"
    )
    for col in ("#", "instance", "replacement", "from", "to"):
        table.add_column(col)
    for n, m in enumerate(plan.moves, 1):
        table.add_row(str(n), m.placement_id, m.replacement_id, ", ".join(m.from_gpus), ", ".join(m.to_gpus))
    console.print(table)
    if status == "booked":
        console.print(
            "Replacements booked (the ledger holds both copies). For each move, in order: start the engine on "
            "the new GPUs, drain the old one, then release the old copy: "
            f"toposched ledger release INSTANCE --state {url} (or POST /v1/defrag/finish).",
            markup=False,
            soft_wrap=True,
        )
    else:
        console.print("Dry run: nothing booked (--apply books the replacements).", markup=False)
