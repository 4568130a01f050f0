"""The brief fuzz run: every target, a few dozen seeded cases each (``make fuzz`` runs long).

Each target gets its real seeds unmutated, then hypothesis-drawn mutations from a fixed seed, so CI
sees the same cases every run. A target passes when no case let an exception other than the
target's allowed ones escape, took over 5 s of CPU, blew up memory, ran an injected command or got a
5xx from the service. ``TOPOSCHED_FUZZ_EXAMPLES`` raises the example count per target.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzz.harness import Budget, env_int, run_target
from tests.fuzz.targets import TARGETS

pytestmark = pytest.mark.fuzz


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_target_survives_mutated_real_inputs(name: str, tmp_path: Path) -> None:
    target = TARGETS[name]
    budget = Budget(examples=env_int("TOPOSCHED_FUZZ_EXAMPLES", target.brief_examples), seed=0)
    result = run_target(target, budget, tmp_path)
    assert result.cases > len(target.seeds()), f"{name}: hypothesis drew no mutated cases"
    assert not result.findings, "\n" + result.describe()
