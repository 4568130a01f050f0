"""SQLite specifics: a damaged or locked file is a clear error, never an empty ledger."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from toposched.errors import StateError
from toposched.ledger import open_ledger
from toposched.ledger.base import GIB
from toposched.ledger.sqlite import SqliteLedger


def test_not_a_database_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    path.write_bytes(b"this is not sqlite" * 500)
    ledger = open_ledger(f"sqlite:{path}")
    with pytest.raises(StateError) as caught:
        ledger.accounts()
    assert str(path) in caught.value.message and "not usable" in caught.value.message
    assert caught.value.fix and "restore a backup" in caught.value.fix
    assert path.read_bytes().startswith(b"this is not sqlite")  # left as it was


def test_damaged_pages_are_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    ledger = SqliteLedger(path)
    ledger.set_capacity({f"n/{i}": 80 * GIB for i in range(64)})
    for i in range(200):
        ledger.reserve(f"r{i}", {f"n/{i % 64}": GIB}, owner="x" * 200)
    ledger.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(path.read_bytes())
    assert len(data) > 3 * 4096
    data[2 * 4096 : 3 * 4096] = b"\xff" * 4096  # scribble over one page
    path.write_bytes(bytes(data))
    with pytest.raises(StateError) as caught:
        SqliteLedger(path).reservations()
    assert str(path) in caught.value.message


def test_locked_past_the_timeout_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    ledger = SqliteLedger(path, busy_timeout_s=0.2)
    ledger.set_capacity({"n/0": 80 * GIB})
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StateError) as caught:
            ledger.reserve("a", {"n/0": GIB})
        assert "locked" in caught.value.message and str(path) in caught.value.message
        assert ledger.accounts()["n/0"].reserved_bytes == 0  # readers are not blocked (WAL)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert ledger.reserve("a", {"n/0": GIB}).status == "reserved"


def test_other_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    SqliteLedger(path).set_capacity({"n/0": GIB})
    conn = sqlite3.connect(path)
    conn.execute("UPDATE ledger_meta SET value = '99' WHERE key = 'schema'")
    conn.commit()
    conn.close()
    with pytest.raises(StateError, match="ledger schema 99"):
        SqliteLedger(path).accounts()


def test_state_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    first = SqliteLedger(path)
    first.set_capacity({"n/0": 80 * GIB})
    first.reserve("a", {"n/0": 10 * GIB}, owner="svc")
    first.close()
    again = SqliteLedger(path)
    assert again.accounts()["n/0"].reserved_bytes == 10 * GIB
    assert [e.action for e in again.audit()] == ["reserve"]


def test_one_ledger_object_is_safe_across_threads(tmp_path: Path) -> None:
    import threading

    from toposched.ledger.sqlite import SqliteLedger

    ledger = SqliteLedger(tmp_path / "t.sqlite3")
    ledger.set_capacity({f"n/{i}": 8 for i in range(4)})
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for n in range(40):
                rid = f"t{k}-{n}"
                if ledger.reserve(rid, {f"n/{n % 4}": 1}).ok:
                    ledger.release(rid)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(a.reserved_bytes == 0 for a in ledger.accounts().values())
    assert ledger.reservations() == []
