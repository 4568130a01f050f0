"""Entry point of the ``toposched`` CLI.

Each command group lives in its own module with a ``register(app)`` function; this module only wires
them together and turns ``ToposchedError`` into a short message and a non-zero exit. Set
``TOPOSCHED_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import os
import sys

import typer

from toposched import __version__
from toposched.cli import (
    allocate,
    calibrate,
    defrag,
    launch,
    ledger,
    plan,
    serve,
    sidecar,
    simulate,
    topo,
    verify,
    workload,
)
from toposched.cli._common import err_console
from toposched.errors import ToposchedError

app = typer.Typer(
    name="toposched",
    help="Topology-aware scheduler for LLM inference on GPU clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        print(f"toposched {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    """Topology-aware scheduler for LLM inference on GPU clusters."""


for _module in (topo, workload, calibrate, allocate, plan, launch, ledger, defrag, simulate, verify, sidecar, serve):
    _module.register(app)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; user errors become one or two lines on stderr and exit code 1 or 2."""
    try:
        app(args=argv, prog_name="toposched")
    except ToposchedError as exc:
        if os.environ.get("TOPOSCHED_DEBUG") == "1":
            raise
        err_console.print(f"error: {exc.message}", markup=False, soft_wrap=True)
        if exc.fix:
            err_console.print(f"  fix: {exc.fix}", markup=False, soft_wrap=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
