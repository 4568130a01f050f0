"""Shared test fixtures: where the captured real outputs live, and a CLI runner."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """``../shared`` beside the repository (CI lays a copy there); ``TOPOSCHED_SHARED`` overrides."""
    env = os.environ.get("TOPOSCHED_SHARED")
    return Path(env) if env else REPO.parent / "shared"


FIXTURES = shared_dir() / "fixtures"


def pytest_configure(config: pytest.Config) -> None:
    if not FIXTURES.is_dir():
        raise pytest.UsageError(
            f"the captured real outputs are not at {FIXTURES}; clone beside ../shared or set TOPOSCHED_SHARED"
        )


@dataclass(frozen=True)
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


RunCli = Callable[..., CliResult]


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run ``toposched ARGS`` in-process and return exit code, stdout and stderr."""
    from toposched.cli.main import main

    def run(*args: str) -> CliResult:
        code = 0
        try:
            main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return run
