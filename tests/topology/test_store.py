"""DomainMap versions in SQLite: versioning, staleness, damaged files."""

from __future__ import annotations

from pathlib import Path

import pytest

from toposched.errors import StateError
from toposched.topology.presets import load_preset
from toposched.topology.sources import SourceRef
from toposched.topology.store import TopologyStore


def test_versions_are_monotonic_and_latest_round_trips(tmp_path: Path) -> None:
    store = TopologyStore(tmp_path / "state.sqlite3")
    assert store.latest() is None
    first = store.save(load_preset("hgx-h100"), SourceRef(kind="preset", ref="hgx-h100"), now=1000.0)
    second = store.save(load_preset("dgx1-v100"), SourceRef(kind="preset", ref="dgx1-v100"), now=2000.0)
    assert (first.version, second.version) == (1, 2)
    latest = store.latest()
    assert latest is not None
    assert latest.version == 2
    assert latest.cluster == load_preset("dgx1-v100")
    assert latest.domain_map == second.domain_map
    assert latest.source.describe() == "preset:dgx1-v100"
    assert latest.age_s(now=2300.0) == 300.0
    assert [v for v, _, _ in store.versions()] == [1, 2]


def test_constructor_does_no_io(tmp_path: Path) -> None:
    TopologyStore(tmp_path / "deep" / "state.sqlite3")
    assert not (tmp_path / "deep").exists()


def test_a_file_that_is_not_sqlite_is_a_state_error_and_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StateError, match="not usable"):
        TopologyStore(path).latest()
    assert path.read_bytes() == b"this is not a database" * 100


def test_unwritable_location_is_a_state_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StateError, match=f"cannot create the folder of the state file {blocker}"):
        TopologyStore(blocker / "state.sqlite3").save(load_preset("dgx2"), SourceRef(kind="preset", ref="dgx2"))


def test_damaged_row_is_reported_not_guessed(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "state.sqlite3"
    store = TopologyStore(path)
    store.save(load_preset("dgx2"), SourceRef(kind="preset", ref="dgx2"))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE domain_maps SET cluster_json = '{\"nodes\": []}'")
    with pytest.raises(StateError, match="damaged"):
        store.latest()


def test_a_folder_given_as_the_state_file_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(StateError, match="is a folder, not a state file") as caught:
        TopologyStore(tmp_path).save(load_preset("dgx2"), SourceRef(kind="preset", ref="dgx2"))
    assert caught.value.fix is not None and "DIR/state.sqlite3" in caught.value.fix


def test_the_file_is_in_wal_mode_shared_with_the_ledger(tmp_path: Path) -> None:
    import sqlite3

    from toposched.ledger.base import GIB
    from toposched.ledger.sqlite import SqliteLedger

    path = tmp_path / "state.sqlite3"
    TopologyStore(path).save(load_preset("dgx2"), SourceRef(kind="preset", ref="dgx2"))
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    SqliteLedger(path).set_capacity({"n/0": GIB})  # one file holds both
    assert TopologyStore(path).latest_version() == 1
