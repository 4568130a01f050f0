"""``toposched ledger``: show and release reservations, and load-test a backend.

``--state`` names the store: ``sqlite:PATH`` (or a bare path), ``etcd:http://HOST:PORT``, or
nothing for the embedded default file (``TOPOSCHED_STATE``, else ``~/.local/state/toposched``).
``show`` and ``release`` never create a store: a SQLite file that is not there is an error naming it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import typer
from rich.table import Table

from toposched.cli._common import STATE, console, err_console, ledger_url, print_json
from toposched.cli.progress import QUIET, Reporter
from toposched.errors import InputError
from toposched.ledger import open_ledger
from toposched.ledger.base import GIB, AuditEntry, Ledger
from toposched.ledger.stress import StressConfig, run_stress

ledger_app = typer.Typer(help="HBM reservations: show, release, load-test the store.", no_args_is_help=True)

JSON = typer.Option(False, "--json", help="Print JSON.")


def register(app: typer.Typer) -> None:
    app.add_typer(ledger_app, name="ledger")


def open_existing(state: str | None) -> tuple[str, Ledger]:
    """The ledger ``--state`` names and its URL; a SQLite file that does not exist is an ``InputError``.

    Commands that read state must not create it: opening a missing file would make its folders
    and an empty ledger, and then report that empty ledger as if it were the real one.
    """
    url = ledger_url(state)
    scheme, _, path = url.partition(":")
    if scheme != "sqlite":
        return url, open_ledger(url)
    try:
        is_file, is_dir = Path(path).is_file(), Path(path).is_dir()
    except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL byte
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        shown = path if len(path) <= 80 else path[:77] + "..."
        raise InputError(f"the state file {shown} cannot be used: {reason}", fix="give a shorter, plain path") from None
    if not is_file:
        what = "is a directory" if is_dir else "does not exist"
        raise InputError(
            f"the state file {path} {what}",
            fix="pass the --state the service uses (`toposched serve --state ...`, or $TOPOSCHED_STATE)",
        )
    return url, open_ledger(url)


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _audit_json(entry: AuditEntry) -> dict[str, Any]:
    return entry.model_dump(mode="json")


@ledger_app.command("show")
def show(
    state: str | None = STATE,
    as_json: bool = JSON,
    audit: bool = typer.Option(False, "--audit", help="Also show the audit log (every change)."),
    last: int = typer.Option(50, "--last", min=1, help="How many audit entries to show (the newest)."),
) -> None:
    """Per-GPU capacity and reserved HBM, and the live reservations."""
    url, ledger = open_existing(state)
    try:
        accounts = ledger.accounts()
        reservations = sorted(ledger.reservations(), key=lambda r: r.id)
        entries = ledger.audit()[-last:] if audit else []
    finally:
        ledger.close()
    if as_json:
        doc: dict[str, Any] = {
            "state": url,
            "gpus": [
                {"ref": a.ref, "capacity_bytes": a.capacity_bytes, "reserved_bytes": a.reserved_bytes}
                | {"free_bytes": a.free_bytes}
                for a in sorted(accounts.values(), key=lambda a: a.ref)
            ],
            "reservations": [r.model_dump(mode="json") for r in reservations],
        }
        if audit:
            doc["audit"] = [_audit_json(e) for e in entries]
        print_json(doc)
        return
    gpus = Table(title=f"GPUs in {url}")
    for col in ("GPU", "capacity GiB", "reserved GiB", "free GiB"):
        gpus.add_column(col, justify="left" if col == "GPU" else "right")
    for a in sorted(accounts.values(), key=lambda a: a.ref):
        gpus.add_row(
            a.ref, f"{a.capacity_bytes / GIB:.2f}", f"{a.reserved_bytes / GIB:.2f}", f"{a.free_bytes / GIB:.2f}"
        )
    console.print(gpus)
    held = Table(title=f"{len(reservations)} reservations")
    for col in ("id", "owner", "GPUs", "GiB each", "expires"):
        held.add_column(col)
    for r in reservations:
        sizes = ", ".join(f"{b / GIB:.2f}" for b in r.gpus.values())
        held.add_row(r.id, r.owner, ", ".join(r.gpus), sizes, _when(r.expires_at))
    console.print(held)
    if audit:
        log = Table(title=f"audit log (last {len(entries)})")
        for col in ("seq", "time", "action", "id", "owner", "GPUs"):
            log.add_column(col)
        for e in entries:
            log.add_row(str(e.seq), _when(e.at), e.action, e.id, e.owner, ", ".join(e.gpus))
        console.print(log)


@ledger_app.command("release")
def release(
    rid: str = typer.Argument(..., metavar="ID", help="The reservation id."),
    state: str | None = STATE,
    as_json: bool = JSON,
) -> None:
    """Release one reservation now (its GPUs' bytes are free again)."""
    url, ledger = open_existing(state)
    try:
        released = ledger.release(rid)
    finally:
        ledger.close()
    if as_json:
        print_json({"id": rid, "released": released})
    elif released:
        console.print(f"released {rid}", markup=False)
    else:
        raise InputError(f"no live reservation {rid!r} in {url}", fix="see `toposched ledger show`")


def _stress_url(state: str | None, backend: str | None, path: Path | None, endpoint: str | None) -> str:
    """The store ``ledger stress`` loads: ``--state``, or the deprecated ``--backend/--path/--endpoint``."""
    old = [flag for flag, value in (("--backend", backend), ("--path", path), ("--endpoint", endpoint)) if value]
    if old and state is not None:
        raise InputError(f"give --state alone, not with {' '.join(old)}", fix="drop " + " and ".join(old))
    if not old:
        if state is None:  # never the default state file: the load test books into the store it is given
            raise InputError(
                "ledger stress needs the store to load-test",
                fix="pass --state sqlite:FILE (a scratch file) or --state etcd:http://HOST:PORT",
            )
        return ledger_url(state)
    err_console.print(
        "warning: --backend/--path/--endpoint are deprecated; use --state sqlite:FILE or --state etcd:URL",
        markup=False,
        soft_wrap=True,
    )
    if backend == "sqlite":
        if path is None or endpoint is not None:
            raise InputError("--backend sqlite needs --path FILE (and no --endpoint)", fix="use --state sqlite:FILE")
        return f"sqlite:{path}"
    if backend == "etcd":
        if endpoint is None or path is not None:
            raise InputError(
                "--backend etcd needs --endpoint http://HOST:PORT (and no --path)", fix="use --state etcd:URL"
            )
        return f"etcd:{endpoint}"
    raise InputError(f"unknown --backend {backend!r}; valid: sqlite, etcd (memory is one process only)")


def _check_scratch(url: str) -> None:
    """``InputError`` when the store holds GPUs or reservations of something else than an earlier stress run:
    the load test adds GPUs ``stress/N`` and audit entries to whatever it is given."""
    ledger = open_ledger(url)
    try:
        others = sorted(ref for ref in ledger.accounts() if not ref.startswith("stress/"))
        held = [r.id for r in ledger.reservations() if not all(g.startswith("stress/") for g in r.gpus)]
    finally:
        ledger.close()
    if others or held:
        raise InputError(
            f"{url} is not a scratch store: it holds {len(others)} other GPUs and {len(held)} other reservations",
            fix="load-test a scratch file (--state sqlite:/tmp/stress.db) or an empty etcd namespace, or add --force",
        )


@ledger_app.command("stress")
def stress(
    state: str | None = typer.Option(
        None, "--state", help="The store to load-test: sqlite:FILE or etcd:http://HOST:PORT.", metavar="URL"
    ),
    clients: int = typer.Option(4, "--clients", min=1, max=256, help="Client processes."),
    ops: int = typer.Option(1000, "--ops", min=1, help="Operations in total, shared out between the clients."),
    gpus: int = typer.Option(8, "--gpus", min=1, max=1024, help="GPUs the clients compete for."),
    ttl: float = typer.Option(60.0, "--ttl", min=2.0, help="Lease of each reservation, seconds."),
    seed: int = typer.Option(0, "--seed", help="Seed of the clients' random choices."),
    as_json: bool = JSON,
    backend: str | None = typer.Option(None, "--backend", hidden=True, help="Deprecated: use --state."),
    path: Path | None = typer.Option(None, "--path", hidden=True, help="Deprecated: use --state sqlite:FILE."),
    endpoint: str | None = typer.Option(None, "--endpoint", hidden=True, help="Deprecated: use --state etcd:URL."),
    force: bool = typer.Option(
        False, "--force", help="Load-test a store that holds other GPUs or reservations (it adds its own)."
    ),
    quiet: bool = QUIET,
) -> None:
    """Load-test a backend with client processes; count double bookings and lost reservations."""
    url = _stress_url(state, backend, path, endpoint)
    if not force:
        _check_scratch(url)
    kind: Literal["sqlite", "etcd"] = "etcd" if url.startswith("etcd:") else "sqlite"
    with Reporter("ledger stress", quiet=quiet) as progress:
        config = StressConfig(url=url, clients=clients, ops=ops, gpus=gpus, ttl_s=ttl, seed=seed)
        result = run_stress(config, progress=progress.say)
    result["backend"] = kind
    if as_json:
        print_json(result)
        return
    console.print(
        f"{kind}: {result['ops']} ops by {clients} clients in {result['seconds']:.2f} s "
        f"= {result['ops_per_s']:.0f} ops/s "
        f"({result['reservations_per_s']:.0f} reservations/s); double bookings {result['double_bookings']}, "
        f"lost {result['lost']}, leases run out unrenewed {result['expired_unrenewed']} "
        f"(checked {result['checked_changes']} changes, {result['checked_snapshots']} snapshots)",
        markup=False,
    )
