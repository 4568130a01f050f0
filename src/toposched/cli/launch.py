"""``toposched launch``: turn a plan into what vLLM, SGLang, Kubernetes and Ray take.

``--plan PLAN.json`` reads the output of ``toposched plan --json``; without it, ``--model`` and a
topology source plan first (slo policy) and launch the result, through the same plan document and
checks (``binding/plan_doc.py``).

``launch vllm`` / ``launch sglang`` print one script when the plan has one instance on one node (so
``toposched launch vllm ... | sh`` starts it); a plan with several scripts (several instances, or an
instance over several nodes) needs ``--out DIR``, one script per node and instance, or ``--format
json``: each script ends in ``exec``, so scripts printed one after the other would start only the first.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from pathlib import Path

import typer

from toposched.binding.engines import Engine, NodeLaunch, build_launches, shell_script
from toposched.binding.plan_doc import PlanDoc, load_plan, parse_plan, plan_json
from toposched.cli import launch_k8s
from toposched.cli._common import CLUSTER, LIVE, PRESET, SMI, console, err_console, print_json, source_ref
from toposched.errors import InputError
from toposched.names import node_name_problem, placement_id_problem
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.sources import load_source

MAX_FILE_NAME = 255
"""Longest file name (bytes) most file systems take (NAME_MAX)."""

launch_app = typer.Typer(help="Launch plans for vLLM, SGLang, Kubernetes and Ray.", no_args_is_help=True)

PLAN = typer.Option(None, "--plan", help="Output of `toposched plan --json`.", metavar="PLAN.json")
MODEL = typer.Option(None, "--model", help="Plan this model first (when no --plan is given).")
GPU = typer.Option(None, "--gpu", help="GPU type when the topology does not say.")
REPLICAS = typer.Option(1, "--replicas", help="Instances to plan (without --plan).")
TP = typer.Option(None, "--tp", help="Force this tensor-parallel degree (without --plan).")
SLO = typer.Option(None, "--slo-tpot-ms", help="Per-token latency SLO (without --plan).")
MAXLEN = typer.Option(8192, "--max-model-len", help="Context length (without --plan).")


def register(app: typer.Typer) -> None:
    launch_k8s.register_launch(launch_app)
    app.add_typer(launch_app, name="launch")


def resolve_plan(
    plan: Path | None,
    model: str | None,
    smi: str | None,
    preset: str | None,
    cluster: str | None,
    live: bool,
    gpu: str | None,
    replicas: int,
    tp: int | None,
    slo_tpot_ms: float | None,
    max_model_len: int,
) -> PlanDoc:
    """The plan to launch: read from --plan, or made now from --model and a topology source."""
    ref = source_ref(smi, preset, cluster, live)
    if plan is not None:
        if model is not None or ref is not None:
            raise InputError("give --plan, or --model with a topology source, not both")
        return load_plan(plan)
    if model is None or ref is None:
        raise InputError(
            "launch needs a plan", fix="pass --plan PLAN.json, or --model NAME with --preset/--smi/--cluster/--live"
        )
    loaded = load_source(ref)
    for w in loaded.warnings:
        err_console.print(f"warning: {w}", markup=False, soft_wrap=True)
    request = PlacementRequest(
        id="plan", model=model, replicas=replicas, allowed_tp=(tp,) if tp else None,
        slo_tpot_ms=slo_tpot_ms, max_model_len=max_model_len,
    )  # fmt: skip
    outcome = Scheduler(loaded.cluster, gpu=gpu).place(request)
    for u in outcome.unplaced:
        err_console.print(f"warning: replica {u.replica} not placed: {u.reasons[0] if u.reasons else ''}", markup=False)
    if not outcome.placements:
        raise InputError(
            f"nothing of {model} could be placed on {ref.describe()}", fix="run `toposched plan` for the reasons"
        )
    document = plan_json(outcome.placements, [], request, loaded.cluster, policy="slo", source=ref.describe())
    return parse_plan(document, "the plan")


def script_name(launch: NodeLaunch) -> str:
    """``PLACEMENT-NODE.sh`` from the checked placement id and node name (hashed short past 255 bytes).

    Both parts are checked names (no ``/``, no leading ``.``), so the result is one plain file name;
    this is checked again, and ``_inside`` checks the resolved path.
    """
    problem = placement_id_problem(launch.placement) or node_name_problem(launch.node)
    if problem:
        raise InputError(f"cannot name a script after this launch: {problem}")
    name = f"{launch.placement}-{launch.node}.sh"
    if len(name.encode()) > MAX_FILE_NAME:
        digest = hashlib.sha256(f"{launch.placement}/{launch.node}".encode()).hexdigest()[:12]
        name = f"{launch.placement[:100]}-{launch.node[:100]}-{digest}.sh"
    if name != Path(name).name or name.startswith("."):
        raise InputError(f"script name {name[:80]!r} is not a plain file name")
    return name


def _inside(out: Path, name: str) -> Path:
    """``out / name``, refusing a path that resolves outside ``out`` (a planted link, a ``..``)."""
    root = out.resolve()
    path = root / name
    if path.resolve().parent != root:
        raise InputError(f"script {name[:80]!r} would be written outside --out {out}", fix="remove the link there")
    return path


def _write_script(path: Path, text: str) -> None:
    """Write an executable script; a link planted at ``path`` is refused, not followed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o755)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror}", fix="check --out") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        os.fchmod(f.fileno(), 0o755)


def write_scripts(launches: list[NodeLaunch], out: Path) -> list[Path]:
    """One executable script per launch in ``out`` (made if missing); nothing is written elsewhere."""
    scripts = [(script_name(launch), shell_script(launch)) for launch in launches]
    twice = [name for name, count in Counter(name for name, _ in scripts).items() if count > 1]
    if twice:
        raise InputError(f"two launches would both be written to {twice[0]}", fix="give each placement its own id")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {out}: cannot make the folder: {exc.strerror}") from None
    paths = [_inside(out, name) for name, _ in scripts]
    for path, (_, text) in zip(paths, scripts, strict=True):
        _write_script(path, text)
    return [out / name for name, _ in scripts]


def _emit(launches: list[NodeLaunch], fmt: str, json_out: bool, out: Path | None) -> None:
    if json_out or fmt == "json":
        print_json({"launches": [launch.model_dump(mode="json") for launch in launches]})
        return
    if fmt != "sh":
        raise InputError(f"--format {fmt!r} is not one of sh, json for engine launches")
    if out is not None:
        for path in write_scripts(launches, out):
            console.print(f"wrote {path}", markup=False, soft_wrap=True)
        return
    if len(launches) > 1:
        instances = len({launch.placement for launch in launches})
        raise InputError(
            f"the plan needs {len(launches)} scripts ({instances} instance(s) on {len(launches)} node launches); "
            "printed one after the other only the first would run",
            fix="pass --out DIR (one script per node and instance) or --format json",
        )
    print(shell_script(launches[0]), end="")


def _engine_command(engine: Engine) -> None:
    def command(
        plan: Path | None = PLAN,
        model: str | None = MODEL,
        smi: str | None = SMI,
        preset: str | None = PRESET,
        cluster: str | None = CLUSTER,
        live: bool = LIVE,
        gpu: str | None = GPU,
        replicas: int = REPLICAS,
        tp: int | None = TP,
        slo_tpot_ms: float | None = SLO,
        max_model_len: int = MAXLEN,
        model_path: str | None = typer.Option(None, "--model-path", help="Model path/id the engine loads."),
        master_addr: str | None = typer.Option(None, "--master-addr", help="Head node address (multi-node)."),
        port: int = typer.Option(8000, "--port", help="First server port; replicas on one node count up."),
        fmt: str = typer.Option("sh", "--format", help="sh (a script per node and instance) or json."),
        out: Path | None = typer.Option(
            None, "--out", help="Write one script per node and instance into this folder (needed for several)."
        ),
        json_out: bool = typer.Option(False, "--json", help="Same as --format json."),
    ) -> None:
        doc = resolve_plan(plan, model, smi, preset, cluster, live, gpu, replicas, tp, slo_tpot_ms, max_model_len)
        launches = build_launches(
            doc.placements, doc.request, doc.cluster, engine,
            model_path=model_path, master_addr=master_addr, base_port=port,
        )  # fmt: skip
        _emit(launches, fmt, json_out, out)

    command.__doc__ = f"Commands and environment to run each placement with {engine}, one per node."
    launch_app.command(engine)(command)


_engine_command("vllm")
_engine_command("sglang")
