"""The fuzz harness: run a target's cases under a time and memory bound and judge each outcome.

A **target** is one parser reached through its public entry point (the function the CLI or the
service calls with the user's file or body). A **case** is one input: the bytes of the main file or
body, its file name, and sibling files it may refer to. ``check_case`` writes the case into a fresh
folder, calls the target and sorts the outcome:

* ``ok``: it returned, or raised one of the target's allowed exceptions (``ToposchedError``;
  pydantic's ``ValidationError`` where the entry point is a model the service validates);
* ``exception``: anything else escaped (a traceback the user would see);
* ``hang``: more than ``LIMIT_S`` seconds of CPU (or ``WALL_LIMIT_S`` of wall time: a blocked read);
  the case is interrupted there;
* ``memory``: ``MemoryError`` under the per-case address-space bound, or resident memory grown by
  more than ``MEMORY_BOUND`` during the case;
* ``injection``: output toposched wrote did something the input told it to (a command ran, a file
  landed outside ``--out``, YAML grew a key), reported by the target as ``Injection``;
* ``5xx``: the service answered with a server error (``ServerError``).

``run_target`` feeds a target the unmutated seeds first, then hypothesis-drawn mutations in seeded
batches until the example count or time budget is spent, and keeps, per distinct finding (kind,
exception type, innermost toposched frame), the count and the smallest input.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from toposched.errors import ToposchedError

LIMIT_S = 5.0
"""Most CPU seconds one input may take (the issue's target: 0 inputs over 5 s)."""

WALL_LIMIT_S = 60.0
"""Wall-clock bound for one input (catches blocked reads, which use no CPU)."""

MEMORY_BOUND = 1 << 30
"""Most memory one input may need: the address-space headroom per case, and the RSS growth bound."""

KINDS = ("exception", "hang", "memory", "injection", "5xx")


@dataclass(frozen=True)
class Case:
    """One input: the main file (or request body), its name, and sibling files it refers to."""

    data: bytes
    name: str = "input.txt"
    extras: tuple[tuple[str, bytes], ...] = ()
    arg: str = ""
    """Target-specific extra: the HTTP method and path, the CLI flag, the engine."""
    seed: str = ""
    """Which seed this case came from (for the report)."""

    @property
    def size(self) -> int:
        return len(self.data) + sum(len(b) for _, b in self.extras) + len(self.arg)


class Injection(Exception):
    """Raised by a target when output it executed or parsed did what the input asked.

    ``what`` is the kind of breach (``command ran``, ``outside --out``, ...): findings group by it.
    """

    def __init__(self, what: str, detail: str = "") -> None:
        super().__init__(f"{what}: {detail}" if detail else what)
        self.what = what


class ServerError(Exception):
    """Raised by a service target for a 5xx answer."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


class CaseTimeout(BaseException):
    """Raised from the timer signal; a BaseException so the code under test cannot swallow it."""


@dataclass(frozen=True)
class Target:
    """A parser reached through its public entry point."""

    name: str
    entry: str
    """What is called, for the report (``load_source(smi)``)."""
    cases: Callable[[], st.SearchStrategy[Case]]
    seeds: Callable[[], list[Case]]
    run: Callable[[Case, Path], None]
    allowed: tuple[type[BaseException], ...] = (ToposchedError,)
    brief_examples: int = 25
    setup: Callable[[], None] | None = None
    teardown: Callable[[], None] | None = None
    exhaustive: Callable[[], list[Case]] | None = None
    """Cases the long run tries one by one before drawing (every command with every hostile value)."""


@dataclass
class Outcome:
    kind: str | None
    """None when the case passed; else one of KINDS."""
    cpu_s: float
    wall_s: float
    error: BaseException | None = None
    where: str = ""
    trace: str = ""


@dataclass
class Finding:
    target: str
    kind: str
    exc_type: str
    where: str
    message: str
    count: int
    case: Case
    trace: str

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.target, self.kind, self.exc_type, self.where)

    def line(self) -> str:
        return f"{self.target}: {self.kind} {self.exc_type} at {self.where} (x{self.count}): {self.message}"


@dataclass
class TargetResult:
    target: str
    cases: int = 0
    seconds: float = 0.0
    slowest_cpu_s: float = 0.0
    slowest_wall_s: float = 0.0
    slowest_case: Case | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    findings: dict[tuple[str, str, str, str], Finding] = field(default_factory=dict)

    def record(self, case: Case, outcome: Outcome) -> None:
        self.cases += 1
        if outcome.cpu_s > self.slowest_cpu_s:
            self.slowest_cpu_s, self.slowest_case = outcome.cpu_s, case
        self.slowest_wall_s = max(self.slowest_wall_s, outcome.wall_s)
        if outcome.kind is None:
            return
        self.counts[outcome.kind] += 1
        exc_type = type(outcome.error).__name__ if outcome.error is not None else "-"
        if isinstance(outcome.error, ServerError):
            exc_type = f"HTTP{outcome.error.status}"
        message = _first_line(outcome.error)
        key = (self.target, outcome.kind, exc_type, outcome.where)
        found = self.findings.get(key)
        if found is None:
            self.findings[key] = Finding(
                self.target, outcome.kind, exc_type, outcome.where, message, 1, case, outcome.trace
            )
            return
        found.count += 1
        if case.size < found.case.size:
            found.case, found.message, found.trace = case, message, outcome.trace

    def describe(self) -> str:
        lines = [f"{self.target}: {self.cases} cases, " + ", ".join(f"{k} {v}" for k, v in self.counts.items() if v)]
        lines += ["  " + f.line() for f in self.findings.values()]
        return "\n".join(lines)


def _first_line(error: BaseException | None) -> str:
    if error is None:
        return ""
    text = str(error).strip().splitlines()
    return (text[0] if text else "")[:240]


def _where(tb: TracebackType | None, *, hang: bool = False) -> str:
    """The innermost frame in toposched's code (else the innermost frame) as ``module.py:line fn``.

    For a hang the timer lands anywhere inside the slow loop, so the line number and comprehension
    frames are left out: one slow function is one finding.
    """
    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if f"{os.sep}toposched{os.sep}" in f.filename and "tests" not in f.filename]
    if hang:
        ours = [f for f in ours if not f.name.startswith("<")] or ours
    if not frames:
        return "?"
    frame = (ours or frames)[-1]
    name = frame.filename.split(f"{os.sep}toposched{os.sep}", 1)[-1] if ours else Path(frame.filename).name
    return f"{name} {frame.name}" if hang else f"{name}:{frame.lineno} {frame.name}"


# ------------------------------------------------------------------------------------------- bounds


def _on_timer(_signum: int, _frame: FrameType | None) -> None:
    raise CaseTimeout(f"over {LIMIT_S:g} s of CPU or {WALL_LIMIT_S:g} s of wall time")


def _address_space() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """CPU and wall timers that raise CaseTimeout, and an address-space bound for the block."""
    old_prof = signal.signal(signal.SIGPROF, _on_timer)
    old_alrm = signal.signal(signal.SIGALRM, _on_timer)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space() + MEMORY_BOUND
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    # Fire again every second: a CaseTimeout raised inside a gc callback or __del__ is swallowed.
    signal.setitimer(signal.ITIMER_PROF, LIMIT_S, 1.0)
    signal.setitimer(signal.ITIMER_REAL, WALL_LIMIT_S, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGPROF, old_prof)
        signal.signal(signal.SIGALRM, old_alrm)


def write_case(case: Case, folder: Path) -> Path:
    """Write the case's files into ``folder`` (emptied first); the path of the main file."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for name, data in case.extras:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    main = folder / case.name
    main.parent.mkdir(parents=True, exist_ok=True)
    main.write_bytes(case.data)
    return main


def check_case(target: Target, case: Case, workdir: Path) -> Outcome:
    """Run one case through the target under the bounds; classify what happened."""
    write_case(case, workdir / "case")
    rss_before = _rss_peak()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    error: BaseException | None = None
    tb: TracebackType | None = None
    try:
        with contextlib.redirect_stdout(io.StringIO()), bounded():
            target.run(case, workdir / "case")
    except CaseTimeout as exc:
        error, tb = exc, exc.__traceback__
    except target.allowed:
        pass
    except Exception as exc:
        error, tb = exc, exc.__traceback__
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    grown = _rss_peak() - rss_before
    kind: str | None = None
    if isinstance(error, MemoryError) or grown > MEMORY_BOUND:
        kind = "memory"
        error = error or MemoryError(f"resident memory grew by {grown / 2**20:.0f} MiB")
    elif isinstance(error, CaseTimeout) or cpu > LIMIT_S:
        kind = "hang"
        error = error or CaseTimeout(f"{cpu:.1f} s of CPU")
    elif isinstance(error, Injection):
        kind = "injection"
    elif isinstance(error, ServerError):
        kind = "5xx"
    elif error is not None:
        kind = "exception"
    where = _where(tb, hang=kind in ("hang", "memory")) if error is not None and tb is not None else ""
    trace = "".join(traceback.format_exception(type(error), error, tb)) if error is not None and tb else ""
    if isinstance(error, Injection):
        where = error.what
    return Outcome(kind, cpu, wall, error, where or ("?" if kind else ""), trace[-6000:])


# --------------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Budget:
    """How long a run goes: hypothesis examples per target, and optionally seconds per target."""

    examples: int
    seconds: float | None = None
    seed: int = 0
    batch: int = 200
    exhaustive: bool = False
    """Also run the targets' systematic cases (long runs)."""


def run_target(target: Target, budget: Budget, workdir: Path) -> TargetResult:
    """Every seed unmutated (and the systematic cases, in long runs), then hypothesis-drawn cases."""
    result = TargetResult(target.name)
    started = time.monotonic()
    if target.setup is not None:
        target.setup()
    try:
        systematic = target.exhaustive() if budget.exhaustive and target.exhaustive is not None else []
        for case in [*target.seeds(), *systematic]:
            result.record(case, check_case(target, case, workdir))
        strategy = target.cases()
        done, batch_seed = 0, budget.seed
        while done < budget.examples:
            if budget.seconds is not None and time.monotonic() - started > budget.seconds:
                break
            size = min(budget.batch, budget.examples - done)
            if budget.seconds is not None:
                size = min(size, 50)

            @settings(
                max_examples=size,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
                print_blob=False,
            )
            @hypothesis_seed(batch_seed)
            @given(strategy)
            def drive(case: Case) -> None:
                result.record(case, check_case(target, case, workdir))

            before = result.cases
            drive()
            done += max(1, result.cases - before)
            batch_seed += 1
    finally:
        if target.teardown is not None:
            target.teardown()
    result.seconds = time.monotonic() - started
    return result


# ----------------------------------------------------------------------------------------- findings


def save_finding(finding: Finding, folder: Path) -> Path:
    """Write the finding's smallest input and a note (target, exception, traceback) under ``folder``."""
    name = f"{finding.target}-{finding.kind}-{finding.exc_type}-{stable_hash(finding.where):07d}"
    out = folder / name
    write_case(finding.case, out)
    meta = {
        "target": finding.target,
        "kind": finding.kind,
        "exception": finding.exc_type,
        "where": finding.where,
        "message": finding.message,
        "count": finding.count,
        "name": finding.case.name,
        "arg": finding.case.arg,
        "seed": finding.case.seed,
        "extras": [n for n, _ in finding.case.extras],
    }
    (out / "finding.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "traceback.txt").write_text(finding.trace or finding.message)
    return out


def load_case(folder: Path) -> tuple[str, Case]:
    """The target name and case saved by ``save_finding``."""
    meta = json.loads((folder / "finding.json").read_text())
    extras = tuple((n, (folder / n).read_bytes()) for n in meta["extras"])
    data = (folder / meta["name"]).read_bytes()
    return meta["target"], Case(data, meta["name"], extras, meta["arg"], meta["seed"])


def replay(target: Target, case: Case, workdir: Path) -> Outcome:
    """Run one saved case and print what happened (the traceback, if any)."""
    outcome = check_case(target, case, workdir)
    print(f"{target.name}: {outcome.kind or 'ok'} in {outcome.cpu_s:.2f} s CPU, {outcome.wall_s:.2f} s wall")
    if outcome.trace:
        print(outcome.trace, file=sys.stderr)
    return outcome


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else default


def stable_hash(text: str) -> int:
    """A hash that does not change between runs (``hash()`` of str is salted)."""
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % 1_000_003
    return h
