"""Entry point of the ``toposched`` CLI.

Each command group lives in its own module with a ``register(app)`` function; this module lists them
(``COMMANDS``), imports a module only when one of its commands runs, and turns ``ToposchedError``
into a short message and a non-zero exit. Set
``TOPOSCHED_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys
from functools import cache
from typing import NoReturn

import typer
from typer import _click as click  # typer 0.29 vendors its own click: its classes, not the package's
from typer.core import TyperGroup

from toposched import __version__
from toposched.errors import ToposchedError

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module under toposched.cli, one-line help shown by `toposched --help`)
    "fit": ("workload", "Which (tp, pp) fit a model on a GPU type: per-GPU memory..."),
    "estimate": ("workload", "Predicted TTFT, TPOT and throughput of one (tp, pp) instance..."),
    "calibrate": ("calibrate", "Fit the cost model to your benchmark results; print..."),
    "allocate": ("allocate", "Pick the GPUs a Kubernetes device plugin should prefer..."),
    "plan": ("plan", "Choose parallel degrees and exact GPUs for model instances,..."),
    "defrag": ("defrag", "Print the fewest moves that free room for a large instance;..."),
    "simulate": ("simulate", "Run the same seeded workload under each policy and compare..."),
    "sidecar": ("sidecar", "Check the placement's GPUs every interval: NVLink domain,..."),
    "serve": ("serve", "Serve the placement API, the Kubernetes extender, /metrics..."),
    "topo": ("topo", "Discover and show GPU topology: NVLink domains, NUMA groups,..."),
    "launch": ("launch", "Launch plans for vLLM, SGLang, TensorRT-LLM, Kubernetes and Ray."),
    "ledger": ("ledger", "HBM reservations: show, release, load-test the store."),
    "verify": ("verify", "Verify placements: NCCL logs and GPU-set topology."),
}
"""Every command, and the module that defines it: a module is imported only when its command runs
(or its help is asked for), so ``toposched plan`` never loads NVML, the service or the etcd client.
``tests/cli/test_startup.py`` checks the help lines against the commands' own docstrings."""


def _typer(**kw: object) -> typer.Typer:
    return typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None, **kw)  # type: ignore[arg-type]


@cache
def _module_group(module_name: str) -> TyperGroup:
    """The commands of one module as a group, built once: ``register`` adds commands to module-level
    sub-apps, so registering again would add them twice."""
    module = importlib.import_module(f"toposched.cli.{module_name}")
    sub = _typer()

    @sub.callback()
    def _group() -> None:  # a callback keeps a one-command module a group
        pass

    module.register(sub)
    group = typer.main.get_command(sub)
    assert isinstance(group, TyperGroup)
    return group


def load_command(name: str) -> click.Command | None:
    """The click command ``name``, imported from its module (None for an unknown name)."""
    if name not in COMMANDS:
        return None
    group = _module_group(COMMANDS[name][0])
    return group.get_command(click.Context(group), name)


class LazyGroup(TyperGroup):
    """The root group: lists commands from ``COMMANDS``, imports one only when it is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return load_command(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_module, short) in COMMANDS.items()])


app = typer.Typer(
    cls=LazyGroup,
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


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; user errors become one or two lines on stderr and exit code 1 or 2 (70 for an internal error).

    Usage mistakes (an unknown option, a value out of range, a missing option) keep the same shape
    as toposched's own errors, ``error: ...`` and ``  fix: ...``, instead of click's four-line
    usage block; a group run without a command still prints its help.
    """
    try:
        code = app(args=argv, prog_name="toposched", standalone_mode=False)
    except ToposchedError as exc:
        if os.environ.get("TOPOSCHED_DEBUG") == "1":
            raise
        _fail(exc.message, exc.fix, exc.exit_code)
    except click.exceptions.NoArgsIsHelpError as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.UsageError as exc:
        command = exc.ctx.command_path if exc.ctx is not None else "toposched"
        _fail(exc.format_message(), f"see `{command} --help`", exc.exit_code)
    except click.exceptions.ClickException as exc:
        _fail(exc.format_message(), None, exc.exit_code)
    except typer.Abort:
        _fail("aborted", None, 1)
    except Exception as exc:  # a bug: one line and exit 70, as promised (the traceback with TOPOSCHED_DEBUG=1)
        if os.environ.get("TOPOSCHED_DEBUG") == "1":
            raise
        _fail(
            f"internal error: {type(exc).__name__}: {str(exc)[:300]}",
            "rerun with TOPOSCHED_DEBUG=1 for the traceback, and report it",
            70,
        )
    if isinstance(code, int) and code:  # typer.Exit(n) inside a command
        sys.exit(code)


def _fail(message: str, fix: str | None, exit_code: int) -> NoReturn:
    from toposched.cli._common import err_console

    err_console.print(f"error: {message}", markup=False, soft_wrap=True)
    if fix:
        err_console.print(f"  fix: {fix}", markup=False, soft_wrap=True)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
