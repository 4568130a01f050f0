"""``toposched ledger show|release|stress``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import RunCli
from toposched.ledger import open_ledger
from toposched.ledger.base import GIB


def test_stress_contract_sqlite(run_cli: RunCli, tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    result = run_cli("ledger", "stress", "--state", f"sqlite:{path}", "--clients", "4", "--ops", "200", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["ops"] == 200 and doc["ops_per_s"] > 0 and doc["backend"] == "sqlite"
    assert doc["double_bookings"] == 0 and doc["lost"] == 0


def test_stress_old_options_still_work_with_a_warning(run_cli: RunCli, tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    result = run_cli("ledger", "stress", "--backend", "sqlite", "--path", str(path), "--ops", "20", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["ops"] == 20
    assert result.stderr.splitlines() == [
        "warning: --backend/--path/--endpoint are deprecated; use --state sqlite:FILE or --state etcd:URL"
    ]
    assert "--backend" not in run_cli("ledger", "stress", "--help").stdout  # hidden


def test_stress_needs_the_right_location(run_cli: RunCli, tmp_path: Path) -> None:
    result = run_cli("ledger", "stress", "--clients", "2")
    assert result.exit_code == 2 and "--state sqlite:FILE" in result.stderr  # never the default state file
    result = run_cli("ledger", "stress", "--backend", "sqlite", "--clients", "2")
    assert result.exit_code == 2 and "--path FILE" in result.stderr
    result = run_cli("ledger", "stress", "--backend", "memory", "--path", str(tmp_path / "x"))
    assert result.exit_code == 2 and "valid: sqlite, etcd" in result.stderr
    result = run_cli("ledger", "stress", "--state", f"sqlite:{tmp_path / 'x'}", "--path", str(tmp_path / "x"))
    assert result.exit_code == 2 and "give --state alone" in result.stderr


def test_read_commands_never_create_state(run_cli: RunCli, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "x.sqlite3"
    for args in (("show",), ("show", "--json"), ("release", "inst-1")):
        result = run_cli("ledger", *args, "--state", f"sqlite:{missing}")
        assert result.exit_code == 2 and "does not exist" in result.stderr, result.stderr
    assert not (tmp_path / "no").exists()
    (tmp_path / "no" / "such").mkdir(parents=True)  # the folder exists, the file does not
    for args in (("show",), ("release", "inst-1")):
        result = run_cli("ledger", *args, "--state", f"sqlite:{missing}")
        assert result.exit_code == 2 and result.stderr.startswith(f"error: the state file {missing} does not exist")
    assert not missing.exists()


@pytest.mark.parametrize(
    ("state", "phrase"),
    [
        ("etc:http://10.0.0.5:2379", "unknown store 'etc'"),  # a mistyped etcd URL is not a file to create
        ("redis://x:1", "unknown store 'redis'"),
    ],
)
def test_a_state_with_an_unknown_scheme_is_refused(run_cli: RunCli, tmp_path: Path, state: str, phrase: str) -> None:
    result = run_cli("ledger", "show", "--state", state)
    assert result.exit_code == 2 and phrase in result.stderr, result.stderr


def test_stress_refuses_a_store_that_is_not_a_scratch_one(run_cli: RunCli, tmp_path: Path) -> None:
    path = tmp_path / "live.sqlite3"
    ledger = open_ledger(f"sqlite:{path}")
    ledger.set_capacity({"n/0": 80 * GIB})
    ledger.close()
    result = run_cli("ledger", "stress", "--state", f"sqlite:{path}", "--ops", "4", "--clients", "1")
    assert result.exit_code == 2 and "not a scratch store" in result.stderr, result.stderr
    assert list(open_ledger(f"sqlite:{path}").accounts()) == ["n/0"]  # nothing added


def test_show_and_release(run_cli: RunCli, tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    ledger = open_ledger(f"sqlite:{path}")
    ledger.set_capacity({"n/0": 80 * GIB, "n/1": 80 * GIB})
    ledger.reserve("inst-1", {"n/0": 20 * GIB, "n/1": 20 * GIB}, owner="svc", ttl_s=600)
    ledger.close()
    shown = run_cli("ledger", "show", "--state", f"sqlite:{path}", "--json", "--audit")
    assert shown.exit_code == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert [g["reserved_bytes"] for g in doc["gpus"]] == [20 * GIB, 20 * GIB]
    assert [r["id"] for r in doc["reservations"]] == ["inst-1"]
    assert [(e["action"], e["id"]) for e in doc["audit"]] == [("reserve", "inst-1")]
    table = run_cli("ledger", "show", "--state", str(path), "--audit")
    assert table.exit_code == 0 and "inst-1" in table.stdout and "reserve" in table.stdout
    assert run_cli("ledger", "release", "inst-1", "--state", str(path)).exit_code == 0
    again = run_cli("ledger", "release", "inst-1", "--state", str(path))
    assert again.exit_code == 2 and "no live reservation 'inst-1'" in again.stderr
    assert json.loads(run_cli("ledger", "show", "--state", str(path), "--json").stdout)["reservations"] == []


def test_damaged_state_file_is_one_clear_line(run_cli: RunCli, tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    path.write_bytes(b"garbage" * 1000)
    result = run_cli("ledger", "show", "--state", str(path))
    assert result.exit_code == 1 and result.stderr.startswith(f"error: the ledger file {path} is not usable")
    assert "Traceback" not in result.stderr
