"""Shared pieces of the CLI: consoles, JSON output, option types."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from toposched.config import default_state_path
from toposched.errors import InputError
from toposched.inputs import read_text
from toposched.topology.sources import SourceRef

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def print_json(obj: Any) -> None:
    """Write one JSON document to stdout (plain text: no colour, no wrapping)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


# Topology source options shared by every command that reads a topology.
SMI = typer.Option(None, "--smi", help="Read an `nvidia-smi topo -m` capture.", metavar="FILE")
PRESET = typer.Option(None, "--preset", help="Use a built-in machine or cluster (see `topo presets`).")
CLUSTER = typer.Option(None, "--cluster", help="Read a cluster spec (YAML).", metavar="FILE")
LIVE = typer.Option(False, "--live", help="Probe this machine through NVML.")
P2P = typer.Option(
    None,
    "--p2p",
    help="Read an `nvidia-smi topo -p2p r` capture (peer-to-peer status per GPU pair) for the source's one node.",
    metavar="FILE",
)

# The state every command that keeps or reads state names the same way (ledger, defrag, serve, topo).
STATE = typer.Option(
    None,
    "--state",
    help="sqlite:PATH (or a bare path) or etcd:http://HOST:PORT [default: $TOPOSCHED_STATE, else the state file].",
    metavar="URL",
)


def ledger_url(state: str | None) -> str:
    """The ``scheme:argument`` URL a ``--state`` value names (``open_ledger``'s form)."""
    if not state:
        return f"sqlite:{default_state_path()}"
    scheme, colon, rest = state.partition(":")
    if scheme in ("etcd", "http", "https"):
        return state if scheme == "etcd" else f"etcd:{state}"
    if colon and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]{1,15}", scheme) and scheme != "sqlite":
        # "etc:http://..." or "redis://..." is a mistyped store, not a file to create: a replica would
        # quietly keep a ledger of its own
        raise InputError(
            f"--state {state[:80]!r}: unknown store {scheme!r}",
            fix="give sqlite:PATH (or a bare path without a scheme) or etcd:http://HOST:PORT",
        )
    path = Path(rest if scheme == "sqlite" and colon else state).expanduser()
    if not path.parent.is_dir():
        raise InputError(
            f"--state {state[:80]!r}: the folder {str(path.parent)[:80]!r} does not exist",
            fix="create it first, or give a path in an existing folder",
        )
    return f"sqlite:{path}"


def source_ref(
    smi: str | None, preset: str | None, cluster: str | None, live: bool, p2p: str | None = None
) -> SourceRef | None:
    """The one topology source the flags name, or None; two sources is an error. ``p2p``: the ``--p2p``
    capture that goes with it (``--p2p`` without a source is an error: it belongs to one)."""
    given = [
        SourceRef.model_validate({"kind": k, "ref": v})
        for k, v in (("smi", smi), ("preset", preset), ("cluster", cluster))
        if v is not None
    ]
    if live:
        given.append(SourceRef(kind="live"))
    if len(given) > 1:
        raise InputError(
            "give one topology source, not " + " and ".join("--" + g.kind for g in given),
            fix="choose one of --smi FILE, --preset NAME, --cluster FILE, --live",
        )
    if p2p is None:
        return given[0] if given else None
    if not given:
        raise InputError(
            "--p2p adds peer-to-peer status to a topology source, and none was given",
            fix="pass it with --smi FILE, --preset NAME or --live (e.g. --smi topo.txt --p2p p2p.txt)",
        )
    return given[0].model_copy(update={"p2p": p2p})


TOKEN_ENV = "TOPOSCHED_API_TOKEN"
REPORT_TOKEN_ENV = "TOPOSCHED_REPORT_TOKEN"
"""The token that may only post sidecar reports (``serve --report-token-file``; the sidecar reads it first)."""
READ_TOKEN_ENV = "TOPOSCHED_READ_TOKEN"
"""The token that may only read (``serve --read-token-file``)."""


def read_token(token_file: Path | None, *, env: str = TOKEN_ENV, flag: str = "--token-file") -> str | None:
    """A token: the file ``flag`` names first, then ``$env`` (the API token's by default); surrounding blanks
    dropped."""
    if token_file is not None:
        text = read_text(token_file, what=flag, max_bytes=64 * 1024).strip()
        if not text:
            raise InputError(f"{flag} {token_file} is empty", fix="write the token into it")
        return text
    return os.environ.get(env, "").strip() or None
