"""Every exception toposched raises on purpose.

Exceptions are for bad input at the edges and for bugs; expected outcomes (a request that does not
fit, a stale DomainMap) are values. The CLI turns any ``ToposchedError`` into one or two lines on
stderr and a non-zero exit; everything else is a bug and keeps its traceback.

    ToposchedError                  base; ``str()`` is the one-line message, ``fix`` a hint
    ├── InputError                  bad input at an edge (a file, a flag, a config value)
    │   ├── TopologyParseError      nvidia-smi text that is not a readable topo matrix (line, column)
    │   ├── SpecError               a cluster spec / config file that fails validation (key path)
    │   ├── UnknownNameError        a name not in a registry or catalog ("did you mean ...?")
    │   └── InfeasibleError         a request that cannot be satisfied as asked (tp, pp, memory)
    ├── DiscoveryError              a probe of real hardware failed
    │   └── NoDriverError           no NVIDIA driver / NVML library on this machine
    ├── StateError                  the persistent state cannot be read or written
    │   ├── LedgerConflict          the ledger refused a booking (another holder was first)
    │   ├── EtcdError               etcd answered with an error status (``code``: etcd's gRPC code)
    │   └── EtcdUnreachable         no answer from etcd (refused, reset, timed out)
    └── InvariantError              an internal check failed: a bug in toposched (exit code 70)

Each class may carry a ``default_fix`` for raises that give no ``fix`` of their own. Errors of outside
libraries are translated where the library is called: NVML in ``topology/nvml.py``, etcd in
``ledger/etcd_client.py``, sqlite in ``sqlite_file.py`` and the SQLite ledger.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol


class ToposchedError(Exception):
    """Base class: a message that names the input, and an optional hint on how to fix it."""

    exit_code: int = 1
    default_fix: str | None = None
    """The hint used when a raise gives no ``fix`` of its own."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix if fix is not None else self.default_fix

    def __str__(self) -> str:
        return self.message


class InputError(ToposchedError):
    """Bad input at an edge: a file, a flag or a config value."""

    exit_code = 2


class TopologyParseError(InputError):
    """``nvidia-smi topo -m`` text that cannot be read; carries the source, line and column."""

    def __init__(
        self,
        problem: str,
        *,
        source: str = "<input>",
        line: int | None = None,
        column: str | None = None,
        fix: str | None = None,
    ) -> None:
        where = source
        if line is not None:
            where += f", line {line}"
        if column is not None:
            where += f", column {column}"
        super().__init__(f"{where}: {problem}", fix=fix)
        self.problem = problem
        self.source = source
        self.line = line
        self.column = column


class SpecError(InputError):
    """A cluster spec or config that fails validation; ``path`` is the dotted key path."""

    def __init__(self, source: str, path: str, problem: str, *, fix: str | None = None) -> None:
        super().__init__(f"{source}: {path}: {problem}" if path else f"{source}: {problem}", fix=fix)
        self.source = source
        self.path = path
        self.problem = problem


class UnknownNameError(InputError):
    """A name that is not in a registry or catalog; suggests the closest valid names."""

    def __init__(self, kind: str, name: str, valid: Iterable[str]) -> None:
        valid_list = sorted(valid)
        # a huge name is neither echoed in full nor fuzzy-matched (difflib is quadratic in its length)
        close = (
            difflib.get_close_matches(name.lower(), [v.lower() for v in valid_list], n=3, cutoff=0.5)
            if len(name) <= 200
            else []
        )
        by_lower = {v.lower(): v for v in valid_list}
        suggestions = [by_lower[c] for c in close]
        if suggestions:
            hint = "did you mean " + " or ".join(repr(s) for s in suggestions) + "?"
        elif len(valid_list) <= 12:
            hint = "valid: " + ", ".join(valid_list)
        else:  # a long catalog is not one line of error: the first few, and where the rest are
            short = [v for v in valid_list if "/" not in v] or valid_list  # catalog names before Hugging Face ids
            hint = f"{len(valid_list)} valid, e.g. " + ", ".join(short[:: max(1, len(short) // 6)][:6])
            hint += " (the catalog: docs/estimator.md)"
        shown = repr(name) if len(name) <= 60 else repr(name[:57]) + "..."
        super().__init__(f"unknown {kind} {shown}; {hint}")
        self.kind = kind
        self.name = name
        self.valid = valid_list
        self.suggestions = suggestions


class InfeasibleError(InputError):
    """A request that cannot be satisfied as asked (a tp that does not divide the heads, no fit)."""


class DiscoveryError(ToposchedError):
    """Probing real hardware failed."""


class NoDriverError(DiscoveryError):
    """No NVIDIA driver or NVML library on this machine."""


class StateError(ToposchedError):
    """The persistent state (SQLite file, etcd) cannot be read or written."""


class LedgerConflict(StateError):
    """The ledger refused a booking the caller's view said was free; ``result`` is the refusal.

    Expected with several scheduler replicas: the loser resyncs from the ledger and decides again.
    """

    def __init__(self, message: str, *, result: object) -> None:
        super().__init__(message, fix="resync from the ledger and decide again")
        self.result = result


class EtcdError(StateError):
    """etcd answered with an error; ``code`` is etcd's gRPC code (5 not found, 14 unavailable ...).

    Raised by ``ledger/etcd_client.py``, the one place etcd's answers are translated.
    """

    default_fix = "check etcd's health (`etcdctl endpoint health`) and its limits (--max-request-bytes, --max-txn-ops)"

    def __init__(self, message: str, *, code: int = 0, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.code = code


class EtcdUnreachable(StateError):
    """No answer from etcd (refused, reset, timed out); calls succeed again once it answers."""

    default_fix = "start etcd or check --endpoint / --state; calls succeed again once it answers"


class InvariantError(ToposchedError):
    """An internal check failed (the simulator's conservation of requests and memory): a bug, not bad input.

    Exit code 70 (``EX_SOFTWARE`` in sysexits.h) tells it apart from bad input (2) and state errors (1).
    """

    exit_code = 70
    default_fix = "this is a bug in toposched: report it with the command and its output under TOPOSCHED_DEBUG=1"


class _Validation(Protocol):
    """What pydantic's ``ValidationError`` offers (duck-typed: this module imports no library)."""

    def errors(self) -> Any: ...


@dataclass(frozen=True)
class Problem:
    """The first error of a pydantic ``ValidationError``, the pieces a one-line message is made of (every
    edge that validates input turns it into an ``InputError`` or ``SpecError`` through :func:`first_problem`)."""

    loc: tuple[str | int, ...]
    """Where: field names and list indices."""
    msg: str
    """pydantic's message as it gives it (``Value error, ...`` for a validator's own)."""
    input: Any
    """The value that was refused."""

    @property
    def path(self) -> str:
        """``loc`` as a dotted key path (``nodes.0.gpus``); empty for the object itself."""
        return ".".join(str(part) for part in self.loc)

    @property
    def field(self) -> str:
        """The top-level field, or empty."""
        return str(self.loc[0]) if self.loc else ""

    @property
    def reason(self) -> str:
        """``msg`` without pydantic's ``Value error,`` prefix, on one line."""
        return " ".join(self.msg.removeprefix("Value error, ").split())


def first_problem(exc: _Validation) -> Problem:
    """The first error of ``exc`` (a pydantic ``ValidationError``)."""
    err = exc.errors()[0]
    return Problem(tuple(err["loc"]), str(err["msg"]), err.get("input"))
