"""Every finding the fuzzer made once, replayed on every run: each must now pass its target's checks.

``tests/fuzz/regressions/NAME/`` holds a finding as ``python -m tests.fuzz.runner`` saved it (the
input files and ``finding.json``; the traceback it had is left out). Add a folder when a finding is
fixed; ``python -m tests.fuzz.runner --replay FOLDER`` reruns one by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzz.harness import check_case, load_case
from tests.fuzz.targets import TARGETS

REGRESSIONS = Path(__file__).parent / "regressions"
FOLDERS = sorted(p for p in REGRESSIONS.iterdir() if (p / "finding.json").is_file())


def test_there_are_regressions_to_replay() -> None:
    assert len(FOLDERS) >= 7


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_a_past_finding_now_passes(folder: Path, tmp_path: Path) -> None:
    name, case = load_case(folder)
    outcome = check_case(TARGETS[name], case, tmp_path)
    assert outcome.kind is None, outcome
