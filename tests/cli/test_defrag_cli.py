"""``toposched defrag``: dry run by default, --apply books, exit codes, read-only on a missing state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import RunCli
from toposched.ledger import open_ledger
from toposched.service.config import ServiceConfig
from toposched.service.schemas import PlaceBody
from toposched.service.state import ServiceState
from toposched.solver.defrag import MOVED_FROM
from toposched.topology.sources import SourceRef

SPEC = "name: three\nnodes:\n  - name: 'h{i}'\n    count: 3\n    preset: hgx-h100\n"


@pytest.fixture
def fragmented(tmp_path: Path) -> tuple[str, Path]:
    """A service state on 3 x HGX H100 with 8 GPUs free but no node with 8: node h2 is freed by 2 moves.

    h0: 2 free (0-1), h1: 2 free (6-7), h2: 4 free (2-3, 6-7) around two TP2 instances n2i0, n2i2.
    """
    spec = tmp_path / "cluster.yaml"
    spec.write_text(SPEC)
    url = f"sqlite:{tmp_path / 'state.sqlite3'}"
    source = SourceRef(kind="cluster", ref=str(spec))
    state = ServiceState(ServiceConfig(state=url, source=source, auth=False, replica="r1"))
    state.open()
    try:
        for n in range(3):
            for k, tp in enumerate((2, 2, 2, 1, 1)):
                body = PlaceBody.model_validate({"model": "llama-3.1-8b", "id": f"n{n}i{k}", "allowed_tp": [tp]})
                assert state.place(body).status == "placed"
        for rid in ("n0i0", "n1i3", "n1i4", "n2i1", "n2i3", "n2i4"):
            assert state.release(rid)
    finally:
        state.close()
    return url, spec


def reservations(url: str) -> dict[str, dict[str, str]]:
    ledger = open_ledger(url)
    try:
        return {r.id: r.meta for r in ledger.reservations()}
    finally:
        ledger.close()


def test_dry_run_prints_the_ordered_moves_and_books_nothing(run_cli: RunCli, fragmented: tuple[str, Path]) -> None:
    url, _spec = fragmented
    before = reservations(url)
    result = run_cli("defrag", "--state", url, "--need-gpus", "8", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["status"] == "planned" and doc["group"].startswith("h2") and doc["gpus_moved"] == 4
    assert [m["placement_id"] for m in doc["moves"]] == ["n2i0", "n2i2"]
    assert sorted(doc["frees"]) == [f"h2/{i}" for i in range(8)]
    assert reservations(url) == before
    human = run_cli("defrag", "--state", url, "--model", "llama-3.1-70b", "--tp", "8")
    assert human.exit_code == 0, human.stderr
    assert "n2i0.m1" in human.stdout and "n2i2.m1" in human.stdout and "Dry run" in human.stdout
    assert reservations(url) == before


def test_apply_books_replacements_then_releasing_the_old_copies_frees_the_node(
    run_cli: RunCli, fragmented: tuple[str, Path]
) -> None:
    url, spec = fragmented
    result = run_cli("defrag", "--state", url, "--cluster", str(spec), "--need-gpus", "8", "--apply")
    assert result.exit_code == 0, result.stderr
    assert "toposched ledger release" in result.stdout
    held = reservations(url)
    assert held["n2i0.m1"][MOVED_FROM] == "n2i0" and held["n2i2.m1"][MOVED_FROM] == "n2i2"
    assert "n2i0" in held and "n2i2" in held  # both copies are held until the old ones are drained
    again = run_cli("defrag", "--state", url, "--need-gpus", "8")
    assert again.exit_code == 1 and again.stderr.startswith("no plan:")  # moves in flight do not move
    for old in ("n2i0", "n2i2"):
        assert run_cli("ledger", "release", old, "--state", url).exit_code == 0
    done = run_cli("defrag", "--state", url, "--need-gpus", "8")
    assert done.exit_code == 0 and done.stdout.startswith("nothing to move")


def test_no_plan_is_exit_1_with_one_line_saying_why(run_cli: RunCli, fragmented: tuple[str, Path]) -> None:
    url, _spec = fragmented
    result = run_cli("defrag", "--state", url, "--need-gpus", "8", "--max-moves", "1")
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "at most 1 move(s)" in result.stderr
    as_json = run_cli("defrag", "--state", url, "--need-gpus", "16", "--json")
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["status"] == "no-plan"


def test_bad_input_is_exit_2_and_a_missing_state_is_not_created(
    run_cli: RunCli, fragmented: tuple[str, Path], tmp_path: Path
) -> None:
    url, _spec = fragmented
    missing = tmp_path / "nope.sqlite3"
    result = run_cli("defrag", "--state", f"sqlite:{missing}", "--need-gpus", "8")
    assert result.exit_code == 2 and "does not exist" in result.stderr and not missing.exists()
    both = run_cli("defrag", "--state", url, "--need-gpus", "8", "--model", "llama-3.1-8b")
    assert both.exit_code == 2 and "one of them" in both.stderr
    wrong = run_cli("defrag", "--state", url, "--preset", "hgx-h100", "--need-gpus", "8")
    assert wrong.exit_code == 2 and "not the cluster's" in wrong.stderr
    level = run_cli("defrag", "--state", url, "--need-gpus", "8", "--level", "rack")
    assert level.exit_code == 2 and "nvlink or node" in level.stderr
