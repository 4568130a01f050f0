"""Progress of long commands on stderr, one mechanism for all of them.

A command that can run for seconds (``simulate``, ``plan`` on a large cluster, ``calibrate``, ``ledger
stress``, ``defrag``) reports its work as a sequence of stages through a :class:`Reporter`::

    with Reporter("simulate", quiet=quiet) as progress:
        for i, name in enumerate(names, 1):
            progress.stage(f"policy {name}", step=(i, len(names)), total=total)
            ...  # progress.update(done) as the work goes on
    print(results)  # after the ``with``: the bar is gone before stdout is written

How it shows, always on stderr, never on stdout (``--json`` output stays one JSON document):

* stderr a terminal (not ``TERM=dumb``): a Rich progress bar per stage, cleared at the end;
* stderr anything else (a CI log, ``nohup``, a pipe): a plain line when a stage starts and one when it
  ends, e.g. ``simulate: policy slo 1/2 ...`` then ``simulate: policy slo done in 41.2 s``;
* ``--quiet`` / ``-q``: nothing.

Nothing shows for a command that finishes quickly: progress appears once the command has run for
``$TOPOSCHED_PROGRESS_AFTER_S`` seconds (default 2; ``0`` shows every stage at once, as the tests do),
starting with the stage then running; the stages after it all show. A failed stage prints no "done" line
(the error follows).
"""

from __future__ import annotations

import os
import threading
import time
from types import TracebackType

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from toposched.cli._common import err_console

AFTER_ENV = "TOPOSCHED_PROGRESS_AFTER_S"
"""Seconds a command runs before its progress shows (default ``DEFAULT_AFTER_S``; 0: at once)."""
DEFAULT_AFTER_S = 2.0

QUIET = typer.Option(
    False,
    "--quiet",
    "-q",
    help="Show no progress on stderr (progress never goes to stdout, with --json or without).",
)
"""``--quiet/-q`` of every command that reports progress."""


def after_s() -> float:
    """The delay before progress shows: ``$TOPOSCHED_PROGRESS_AFTER_S``, else ``DEFAULT_AFTER_S``."""
    text = os.environ.get(AFTER_ENV, "").strip()
    try:
        value = float(text) if text else DEFAULT_AFTER_S
    except ValueError:
        return DEFAULT_AFTER_S
    return value if 0 <= value < 1e6 else DEFAULT_AFTER_S


class Reporter:
    """One command's stages on stderr (see the module docstring); a context manager.

    ``stage`` ends the stage running and starts the next; ``update`` moves the running stage's count;
    ``say`` is ``stage`` for the callbacks of library code (``Callable[[str], None]``) that announce
    each stage as a message."""

    def __init__(
        self, command: str, *, quiet: bool = False, console: Console | None = None, after: float | None = None
    ) -> None:
        self.command = command
        self.quiet = quiet
        self.console = console or err_console
        self.after = after_s() if after is None else after
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None
        self._shown = False
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._label = ""
        self._step: tuple[int, int] | None = None
        self._total: float | None = None
        self._done = 0.0
        self._started = 0.0
        self._announced = False  # the running stage's start is on screen (a line, or a task of the bar)
        self._running = False

    # ------------------------------------------------------------------ context

    def __enter__(self) -> Reporter:
        if self.quiet:
            return self
        if self.after <= 0:
            self._show()
        else:
            self._timer = threading.Timer(self.after, self._show)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._end(failed=kind is not None)
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
            self._shown = True  # a late timer shows nothing

    # ------------------------------------------------------------------ stages

    def stage(self, label: str, *, step: tuple[int, int] | None = None, total: float | None = None) -> None:
        """End the running stage (if any) and start ``label`` (``step``: its (number, count), e.g. policy 1 of 2;
        ``total``: the count ``update`` moves towards, None for a stage without one)."""
        if self.quiet:
            return
        with self._lock:
            self._end(failed=False)
            self._label, self._step, self._total, self._done = label, step, total, 0.0
            self._started = time.perf_counter()
            self._running = True
            self._announced = False
            if self._shown:
                self._announce()

    def say(self, message: str) -> None:
        """``stage(message)``: the callback form (``fit_profile(progress=...)``, ``run_stress(progress=...)``)."""
        self.stage(message)

    def update(self, completed: float) -> None:
        """The running stage's count so far (of its ``total``)."""
        if self.quiet:
            return
        with self._lock:
            self._done = completed
            if self._bar is not None and self._task is not None:
                self._bar.update(self._task, completed=completed, count=self._count())

    def end(self) -> None:
        """End the running stage (its "done" line) without starting another."""
        if self.quiet:
            return
        with self._lock:
            self._end(failed=False)

    # ------------------------------------------------------------------ output

    def _terminal(self) -> bool:
        return self.console.is_terminal and not self.console.is_dumb_terminal

    def _show(self) -> None:
        """The delay is over: from now on every stage shows (the running one first)."""
        with self._lock:
            if self._shown:
                return
            self._shown = True
            if self._terminal():
                self._bar = Progress(
                    TextColumn("{task.description}", markup=False),  # labels hold file names and URLs
                    BarColumn(),
                    TextColumn("{task.fields[count]}"),
                    TimeElapsedColumn(),
                    console=self.console,
                    transient=True,
                    redirect_stdout=False,  # stdout is the command's output: never moved to stderr
                    redirect_stderr=False,
                )
                self._bar.start()
            if self._running:
                self._announce()

    def _title(self) -> str:
        step = f" {self._step[0]}/{self._step[1]}" if self._step is not None else ""
        return f"{self.command}: {self._label}{step}"

    def _count(self) -> str:
        if self._total is None:
            return ""
        return f"{min(self._done, self._total):,.0f}/{self._total:,.0f}"

    def _announce(self) -> None:
        self._announced = True
        if self._bar is not None:
            self._task = self._bar.add_task(self._title(), total=self._total, count=self._count())
            self._bar.update(self._task, completed=self._done)
        else:
            self.console.print(f"{self._title()} ...", markup=False, highlight=False, soft_wrap=True)

    def _end(self, *, failed: bool) -> None:
        if not self._running:
            return
        self._running = False
        if not self._announced:
            return
        seconds = time.perf_counter() - self._started
        if self._bar is not None and self._task is not None:
            total = self._total if self._total is not None else 1.0
            self._done = total
            self._bar.update(self._task, total=total, completed=total, count=self._count())
            self._task = None
        elif not failed:
            self.console.print(
                f"{self.command}: {self._label} done in {seconds:.1f} s", markup=False, highlight=False, soft_wrap=True
            )


__all__ = ["AFTER_ENV", "DEFAULT_AFTER_S", "QUIET", "Reporter", "after_s"]
