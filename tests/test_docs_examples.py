"""Every concrete CLI example in README.md and docs/*.md runs and exits 0 (issue 18: docs that match the code).

An example is a ``toposched ...`` line in a ``sh``/``bash``/``console`` code block. Synopses are not
examples: a line with a placeholder (an upper-case word such as FILE or N, ``...``, ``[``, ``(`` or
``|`` alternatives), a command that starts a server or watches hardware (``serve``, ``sidecar``,
``--live``), a built-in scenario that runs for minutes (``SLOW``), or a file argument that the docs
assume the reader has (``mine.json``) is skipped, and the skips are counted so a change that turns
every example into a synopsis fails here too.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import REPO, RunCli

SHELL_FENCES = ("```", "```sh", "```bash", "```console", "```shell")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]+$|\.\.\.|^[\[(]|[\[\]()]|^-?-?[a-z-]+\|")
FILE_ARG = re.compile(r"\.(json|jsonl|csv|yaml|yml|txt|sqlite3)$")
NOT_HERE = ("serve", "sidecar")
SLOW = ("churn-128", "large-16k")
"""Built-in scenarios of 20 s to minutes: ``benchmarks/sim_bench.py`` runs them; tests/sim covers the code on
``churn-tiny`` and ``small``."""


def _blocks(text: str) -> list[list[str]]:
    """The lines of each shell (or untagged) fenced code block, fences paired in order."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    shell = False
    for line in text.splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            if current is None:
                current, shell = [], fence in SHELL_FENCES
            else:
                if shell:
                    blocks.append(current)
                current = None
            continue
        if current is not None:
            current.append(line)
    return blocks


def _examples() -> tuple[list[tuple[str, list[str]]], list[str]]:
    runnable: list[tuple[str, list[str]]] = []
    skipped: list[str] = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in _blocks(doc.read_text(encoding="utf-8")):
            for raw in block:
                line = raw.strip().removeprefix("$ ")
                if not line.startswith(("toposched ", ".venv/bin/toposched ")):
                    continue
                line = line.split(" #", 1)[0].split(" | ", 1)[0].strip()
                words = shlex.split(line)[1:]
                where = f"{doc.name}: {line}"
                if (
                    words[0] in NOT_HERE
                    or "--live" in words
                    or any(w in SLOW for w in words)
                    or any(PLACEHOLDER.search(w) for w in words)
                    or any(FILE_ARG.search(w) and not (REPO / w).exists() for w in words)
                ):
                    skipped.append(where)
                    continue
                runnable.append((where, words))
    return runnable, skipped


RUNNABLE, SKIPPED = _examples()


def test_the_docs_have_runnable_examples() -> None:
    assert len(RUNNABLE) >= 6, (RUNNABLE, SKIPPED)
    assert len(SKIPPED) < 3 * len(RUNNABLE) + 30  # synopses are allowed, not docs made only of them


@pytest.mark.parametrize(("where", "words"), RUNNABLE, ids=[w for w, _ in RUNNABLE])
def test_a_docs_example_runs(
    where: str, words: list[str], run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # examples that write (--out report/) write here
    monkeypatch.setenv("TOPOSCHED_STATE", str(tmp_path / "state.sqlite3"))
    result = run_cli(*words)
    assert result.exit_code == 0, f"{where}\n{result.stderr[-2000:]}"
