"""Shell scripts of launches (``launch vllm|sglang|trtllm``): one per node, and the ``srun`` form of a
multi-node TensorRT-LLM launch.

Scripts are safe to run whatever the plan said: ids and node names are checked by the rules of
``toposched.names`` (the plan reader and the topology model check them first; ``NodeLaunch`` checks
again), every value in a script is quoted (environment values always, in single quotes), and the one
comment line carries only checked names and numbers, never a raw newline.
"""

from __future__ import annotations

import shlex
from collections.abc import Container, Sequence

from toposched.binding.engines import ENV_VARS, KV_ENV_SOURCES
from toposched.binding.node_launch import NodeLaunch, plain_file_name
from toposched.errors import InputError
from toposched.names import node_name_problem, placement_id_problem

FILE_ENV = frozenset({"MOONCAKE_CONFIG_PATH"})
"""Variables whose value may be a file of the launch (its name; the script exports its path beside itself)."""


def _quoted(value: str) -> str:
    """``value`` in single quotes, always (``shlex.quote`` leaves ``=mlx5_0`` bare, which shellcheck
    reads as a mistyped ``==``, SC1097)."""
    return "'" + value.replace("'", "'\"'\"'") + "'"


FILE_FLAGS = frozenset({"--config", "--hostfile"})
"""Options whose value may be a file of the launch (its name; the file lies beside the script)."""


def is_file_arg(value: str, previous: str, files: Container[str]) -> bool:
    """Whether an argv word names one of the launch's files (only as the value of a ``FILE_FLAGS`` option:
    a model path that happens to equal a file name stays what it is)."""
    return previous in FILE_FLAGS and value in files


def _arg(value: str, previous: str, files: dict[str, str]) -> str:
    """One argv word for a script: a file of the launch as a path beside the script, an mpirun ``-x
    VAR=VALUE`` in single quotes (as the exports), anything else shell-quoted."""
    if is_file_arg(value, previous, files):
        return '"$here"/' + shlex.quote(value)
    if previous == "-x":
        return _quoted(value)
    return shlex.quote(value)


def shell_script(launch: NodeLaunch, argv: Sequence[str] | None = None) -> str:
    """A script for one node; every value is shell-quoted, so nothing in a plan or a model path can execute.

    ``argv`` replaces the launch's command (the ``srun`` form). The comment line names the placement
    and node, which ``NodeLaunch`` has checked (no newline, no shell syntax); they are checked again
    here so a hand-built launch cannot slip a line in. Files of the launch are found beside the script.
    """
    problem = placement_id_problem(launch.placement) or node_name_problem(launch.node)
    if problem:
        raise InputError(f"launch script: {problem}")
    bad = sorted(k for k in launch.env if k not in ENV_VARS and k not in KV_ENV_SOURCES)
    if bad:
        raise InputError(f"launch script: environment variable {bad[0]!r} is not one toposched writes")
    for name in launch.files:
        plain_file_name(name, "")
    command = list(launch.argv if argv is None else argv)
    lines = [
        "#!/usr/bin/env bash",
        f"# toposched launch: placement {shlex.quote(launch.placement)}, node {shlex.quote(launch.node)} "
        f"(rank {int(launch.node_rank)} of {int(launch.nnodes)}), engine {shlex.quote(launch.engine)}",
        "set -euo pipefail",
    ]
    if launch.files:
        lines.append('here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)')
    for k, v in launch.env.items():  # a file of the launch as its path beside the script
        lines.append(
            f'export {k}="$here"/{shlex.quote(v)}'
            if k in FILE_ENV and v in launch.files
            else f"export {k}={_quoted(v)}"
        )
    words = [_arg(a, command[i - 1] if i else "", launch.files) for i, a in enumerate(command)]
    lines.append("exec " + " ".join(words))
    return "\n".join(lines) + "\n"


def srun_script(launch: NodeLaunch) -> str | None:
    """The ``srun`` form of a multi-node TensorRT-LLM launch as a script, or None when it has none."""
    return None if launch.srun_argv is None else shell_script(launch, launch.srun_argv)
