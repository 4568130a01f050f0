"""``toposched launch``: turn a plan into what vLLM, SGLang, TensorRT-LLM, Kubernetes and Ray take.

``--plan PLAN.json`` reads the output of ``toposched plan --json``; without it, ``--model`` and a
topology source plan first with every option ``plan`` takes (``cli/plan_source.py``) and launch the
result, through the same plan document and checks (``binding/plan_doc.py``).

``launch vllm`` / ``launch sglang`` print one script when the plan has one instance on one node (so
``toposched launch vllm ... | bash`` starts it); a plan with several scripts (several instances, or an
instance over several nodes) needs ``--out DIR``, one script per node and instance, or ``--format
json``: each script ends in ``exec``, so scripts printed one after the other would start only the first.
``launch trtllm`` always needs ``--out`` (or json): its script reads an options YAML beside it, and a
multi-node instance's script on the head runs ``mpirun`` over a hostfile there (plus an ``.srun.sh``
form for Slurm when its nodes are alike).

A prefill/decode disaggregated plan (``plan --pd-prefill N --pd-decode M``) launches with ``launch
sglang``: one script per instance and node with its disaggregation flags, and one for the router
(``PLAN-router-NODE.sh``); a plan with Mooncake stores (``--kv-store mooncake``) adds, per store, its
master (``PLAN-store-N-master-NODE.sh``) and its store service (``PLAN-store-N-NODE.sh``), and its
instances run HiCache on the store of their rack (``binding/mooncake.py``). Or with ``launch vllm``:
one script per instance and node with its ``--kv-transfer-config`` (MooncakeConnector) and no router,
since vLLM 0.33.0 ships no PD proxy; with stores, the same store scripts, and each instance's script
exports ``MOONCAKE_CONFIG_PATH`` naming its ``PLACEMENT-NODE.mooncake.json`` beside it (the store's settings
for ``MooncakeStoreConnector``, which its ``--kv-transfer-config`` adds through ``MultiConnector``).
``launch trtllm`` refuses it in one line.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import typer

from toposched.binding.engines import build_launches
from toposched.binding.launch_script import shell_script, srun_script
from toposched.binding.node_launch import Engine, NodeLaunch, plain_file_name
from toposched.cli import launch_k8s
from toposched.cli._common import console, err_console, print_json
from toposched.cli.plan_options import plan_options
from toposched.cli.plan_source import PlanSource, note_base_checkpoint
from toposched.cli.progress import QUIET
from toposched.errors import InputError
from toposched.names import node_name_problem, placement_id_problem

VLLM_NO_ROUTER = (
    "note: no router was written: vLLM 0.33.0 ships no prefill/decode proxy; put one in front that sends each "
    "request to a prefill instance, then to a decode instance with kv_transfer_params naming the prefill's "
    "remote_bootstrap_addr (http://NODE:PORT, PORT its VLLM_MOONCAKE_BOOTSTRAP_PORT)"
)
"""Said on stderr after a vLLM launch of a disaggregated plan."""

launch_app = typer.Typer(help="Launch plans for vLLM, SGLang, TensorRT-LLM, Kubernetes and Ray.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    launch_k8s.register_launch(launch_app)
    app.add_typer(launch_app, name="launch")


def script_name(launch: NodeLaunch, suffix: str = ".sh") -> str:
    """``PLACEMENT-NODE.sh`` from the checked placement id and node name (hashed short past 255 bytes).

    Both parts are checked names (no ``/``, no leading ``.``), so the result is one plain file name;
    this is checked again, and ``_inside`` checks the resolved path.
    """
    problem = placement_id_problem(launch.placement) or node_name_problem(launch.node)
    if problem:
        raise InputError(f"cannot name a script after this launch: {problem}")
    return plain_file_name(f"{launch.placement}-{launch.node}", suffix)


def _inside(out: Path, name: str) -> Path:
    """``out / name``, refusing a path that resolves outside ``out`` (a planted link, a ``..``)."""
    root = out.resolve()
    path = root / name
    if path.resolve().parent != root:
        raise InputError(f"script {name[:80]!r} would be written outside --out {out}", fix="remove the link there")
    return path


def _write_file(path: Path, text: str, mode: int) -> None:
    """Write a file (a script: mode 0o755); a link planted at ``path`` is refused, not followed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror}", fix="check --out") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        os.fchmod(f.fileno(), mode)


def write_scripts(launches: list[NodeLaunch], out: Path) -> list[Path]:
    """One executable script per launch in ``out`` (made if missing), its ``srun`` form if it has one, and
    the files it reads (TensorRT-LLM's options YAML, mpirun's hostfile); nothing is written elsewhere."""
    scripts = [(script_name(launch), shell_script(launch), 0o755) for launch in launches]
    for launch in launches:
        srun = srun_script(launch)
        if srun is not None:
            scripts.append((script_name(launch, ".srun.sh"), srun, 0o755))
        scripts += [(name, text, 0o644) for name, text in launch.files.items()]
    twice = [name for name, count in Counter(name for name, _, _ in scripts).items() if count > 1]
    if twice:
        raise InputError(f"two launches would both be written to {twice[0]}", fix="give each placement its own id")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {out}: cannot make the folder: {exc.strerror}") from None
    paths = [_inside(out, name) for name, _, _ in scripts]
    for path, (_, text, mode) in zip(paths, scripts, strict=True):
        _write_file(path, text, mode)
    return [out / name for name, _, _ in scripts]


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
    if launches[0].files:
        raise InputError(
            f"the launch reads {', '.join(launches[0].files)}, written next to its script",
            fix="pass --out DIR (the script and its files) or --format json",
        )
    print(shell_script(launches[0]), end="")


def _engine_command(engine: Engine) -> None:
    @plan_options(plan_file=True)
    def command(
        model_path: str | None = typer.Option(None, "--model-path", help="Model path/id the engine loads."),
        master_addr: str | None = typer.Option(None, "--master-addr", help="Head node address (multi-node)."),
        port: int = typer.Option(8000, "--port", help="First server port; replicas on one node count up."),
        fmt: str = typer.Option("sh", "--format", help="sh (a script per node and instance) or json."),
        out: Path | None = typer.Option(
            None, "--out", help="Write one script per node and instance into this folder (needed for several)."
        ),
        json_out: bool = typer.Option(False, "--json", help="Same as --format json."),
        quiet: bool = QUIET,
        *,
        source: PlanSource,
    ) -> None:
        if master_addr is not None:
            check_master_addr(master_addr)
        if engine == "trtllm" and master_addr is not None:
            raise InputError(
                "--master-addr is the vLLM/SGLang rendezvous; TensorRT-LLM's ranks meet through MPI (mpirun/srun)",
                fix="leave out --master-addr",
            )
        doc = source.resolve(engine, quiet=quiet)
        launches = build_launches(
            doc.placements, doc.request, doc.cluster, engine,
            model_path=model_path, master_addr=master_addr, base_port=port, disaggregation=doc.disaggregation,
            stores=doc.stores,
        )  # fmt: skip
        _emit(launches, fmt, json_out, out)
        note_base_checkpoint(doc, model_path)
        if engine == "vllm" and doc.disaggregation is not None:
            err_console.print(VLLM_NO_ROUTER, markup=False, soft_wrap=True)

    command.__doc__ = (
        f"Commands and environment to run each placement with {engine}, one per node."
        if engine != "trtllm"
        else "trtllm-serve commands and their options YAML; mpirun and srun forms for multi-node placements."
    )
    launch_app.command(engine)(command)


_engine_command("vllm")
_engine_command("sglang")
_engine_command("trtllm")


def check_master_addr(value: str) -> None:
    """``--master-addr``: a host name (the node name rules) or an IP address, nothing else (a port, a flag)."""
    import ipaddress

    from toposched.names import node_name_problem

    try:
        ipaddress.ip_address(value)
        return
    except ValueError:
        pass
    if node_name_problem(value) is not None:
        raise InputError(
            f"--master-addr {value[:80]!r} is not a host name or an IP address",
            fix="give the head node's name or address, without a port (the rendezvous port is chosen per instance)",
        )
