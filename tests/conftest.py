"""Shared test fixtures: where the captured real outputs live, and a CLI runner.

Everything the tests read lives in the repository, under ``tests/data/`` (copied from the project's shared folder, each
file's origin in ``tests/data/README.md``): a clone on its own runs the whole suite.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_benchmark(name: str) -> Any:
    """``benchmarks/NAME.py`` as a module (its dataclasses look their module up in ``sys.modules``)."""
    import importlib.util
    import sys

    bench = REPO / "benchmarks"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))  # a benchmark may import the one next to it
    spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


DATA = REPO / "tests" / "data"
"""The test data vendored into the repository (``tests/data/README.md`` records where each file came from)."""
FIXTURES = DATA / "fixtures"
"""Real captured command outputs (``nvidia-smi topo -m``, ``-p2p``, ``nvlink``, NCCL logs) and model configs."""
REFERENCE = DATA / "reference"
"""Checked facts about the real tools and published measurements (engines.md, data/)."""


def pytest_configure(config: pytest.Config) -> None:
    if not FIXTURES.is_dir():
        raise pytest.UsageError(f"the captured real outputs are not at {FIXTURES}: the checkout is incomplete")


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
