"""SQLite specifics: a damaged or locked file is a clear error, never an empty ledger."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.ledger.common import FakeClock
from toposched.errors import StateError
from toposched.ledger import open_ledger
from toposched.ledger.base import GIB, AuditEntry
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


# -- what a connection remembers while no other one commits (``_Known`` in ledger/sqlite.py) --------------


def _statements(ledger: SqliteLedger, action: Callable[[], object]) -> list[str]:
    """The SQL statements ``action`` runs on the ledger's connection (BEGIN and COMMIT included)."""
    conn = ledger._conn
    assert conn is not None
    seen: list[str] = []
    conn.set_trace_callback(seen.append)
    try:
        action()
    finally:
        conn.set_trace_callback(None)
    return seen


def test_a_booking_a_release_and_reading_own_entries_take_few_statements(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "state.sqlite3")
    ledger.set_capacity({"n/0": 80 * GIB})
    ledger.audit()
    booking = _statements(ledger, lambda: ledger.reserve("a", {"n/0": GIB}, meta={"model": "m"}))
    assert len(booking) == 9 and booking[0] == "BEGIN IMMEDIATE" and booking[-1] == "COMMIT"
    entries = ledger.audit(since=0)
    assert [(e.seq, e.action, e.id) for e in entries] == [(1, "reserve", "a")]
    release = _statements(ledger, lambda: ledger.release("a"))
    assert len(release) == 8 and release[-1] == "COMMIT"
    read: list[AuditEntry] = []
    assert _statements(ledger, lambda: read.extend(ledger.audit(since=1))) == ["PRAGMA data_version"]
    assert [(e.seq, e.action, e.id, e.gpus) for e in read] == [(2, "release", "a", {"n/0": GIB})]
    ledger.close()


def test_changes_by_another_connection_are_read_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    first, second = SqliteLedger(path), SqliteLedger(path)
    first.set_capacity({"n/0": 80 * GIB})
    assert first.reserve("a", {"n/0": GIB}).ok
    assert second.reserve("b", {"n/0": GIB}).ok
    assert first.reserve("c", {"n/0": GIB}).ok  # after b: the next seq is read again, not counted on
    assert first.release("b")
    log = [(e.seq, e.action, e.id) for e in first.audit(since=1)]
    assert log == [(2, "reserve", "b"), (3, "reserve", "c"), (4, "release", "b")]
    assert [e.id for e in second.audit(since=2)] == ["c", "b"]
    for ledger in (first, second):
        ledger.close()
    again = SqliteLedger(path)  # every seq once, and the commit count agrees with FILE-commits
    assert [e.seq for e in again.audit()] == [1, 2, 3, 4]
    again.close()


def test_an_audit_row_changed_by_another_connection_fails_its_check_when_read(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    ledger = SqliteLedger(path)
    ledger.set_capacity({"n/0": 80 * GIB})
    assert ledger.reserve("a", {"n/0": GIB}, owner="svc").ok
    with sqlite3.connect(path) as db:
        db.execute("UPDATE ledger_audit SET owner = 'someone' WHERE seq = 1")
    with pytest.raises(StateError, match="row ledger_audit seq=1 fails its checksum"):
        ledger.audit(since=0)
    ledger.close()


def test_a_transaction_that_fails_half_way_leaves_no_gap_in_the_log(tmp_path: Path) -> None:
    """A statement fails after the audit entry was written (a trigger stands in for a full disk): the
    connection forgets the seq and commit count it had counted on, so the next change is numbered right."""
    path = tmp_path / "state.sqlite3"
    ledger = SqliteLedger(path)
    ledger.set_capacity({"n/0": 80 * GIB})
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TRIGGER fail BEFORE UPDATE ON ledger_meta "
            "WHEN EXISTS (SELECT 1 FROM ledger_audit WHERE rid = 'b') BEGIN SELECT RAISE(ABORT, 'disk full'); END"
        )
    assert ledger.reserve("a", {"n/0": GIB}).ok
    with pytest.raises(StateError, match="disk full"):
        ledger.reserve("b", {"n/0": GIB})
    assert ledger.reserve("c", {"n/0": GIB}).ok
    assert [(e.seq, e.id) for e in ledger.audit()] == [(1, "a"), (2, "c")]
    ledger.close()
    again = SqliteLedger(path)
    assert sorted(r.id for r in again.reservations()) == ["a", "c"]
    again.close()


def test_a_lease_shortened_by_renew_runs_out_at_the_new_time(tmp_path: Path) -> None:
    clock = FakeClock()
    ledger = SqliteLedger(tmp_path / "state.sqlite3", clock=clock)
    ledger.set_capacity({"n/0": 80 * GIB})
    assert ledger.reserve("a", {"n/0": 80 * GIB}, ttl_s=100).ok
    assert ledger.renew("a", 10) is not None
    clock.now += 20
    assert [(e.action, e.id) for e in ledger.audit(since=2)] == [("expire", "a")]
    assert ledger.reserve("b", {"n/0": 80 * GIB}).ok  # the bytes are free again
    ledger.close()


def test_a_clock_two_hours_ahead_cannot_expire_a_live_lease(tmp_path: Path) -> None:
    """Issue 37: a client whose clock was 2 h ahead expired the service's live 600 s lease and booked the GPU.
    Leases are judged in ledger time (the newest change plus real time elapsed since), so it is refused."""
    path = tmp_path / "state.sqlite3"
    service = SqliteLedger(path)
    service.set_capacity({"n/0": 80 * GIB})
    assert service.reserve("held", {"n/0": 80 * GIB}, ttl_s=600, owner="service").ok
    ahead = SqliteLedger(path, clock=lambda: time.time() + 7200)  # its wall clock, the real monotonic one
    booked = ahead.reserve("stolen", {"n/0": 80 * GIB}, ttl_s=600, owner="client")
    assert not booked.ok and booked.status == "insufficient"  # the 80 GiB are held
    assert [r.id for r in ahead.reservations()] == ["held"]
    assert [r.id for r in service.reservations()] == ["held"]
    ahead.close()
    # the same for a forward step of the host's clock seen by every process: nothing expires early
    stepped = SqliteLedger(path, clock=lambda: time.time() + 7200)
    assert stepped.get("held") is not None and not stepped.reserve("again", {"n/0": GIB}, ttl_s=1).ok
    stepped.close()
    service.close()


def test_ledger_time_still_expires_a_dead_holders_lease(tmp_path: Path) -> None:
    """A holder that stops renewing loses its lease after its TTL of real time, whatever the clocks say."""
    path = tmp_path / "state.sqlite3"
    mono = [1000.0]
    holder = SqliteLedger(path)
    holder.set_capacity({"n/0": 80 * GIB})
    assert holder.reserve("short", {"n/0": 80 * GIB}, ttl_s=5, owner="dead").ok
    holder.close()
    other = SqliteLedger(path, clock=lambda: time.time() + 7200, monotonic=lambda: mono[0])
    assert not other.reserve("x", {"n/0": GIB}, ttl_s=60).ok  # 0 s of real time seen: still live
    mono[0] += 6  # six seconds of real time since this process first saw the last change
    assert other.reserve("x", {"n/0": GIB}, ttl_s=60).ok
    assert [e.action for e in other.audit() if e.id == "short"] == ["reserve", "expire"]
    other.close()


def test_a_second_process_with_its_clock_two_hours_ahead_books_nothing_held(tmp_path: Path) -> None:
    """The same across two processes (issue 37's report: a client process 2 h ahead of the service)."""
    import subprocess
    import sys

    path = tmp_path / "state.sqlite3"
    service = SqliteLedger(path)
    service.set_capacity({"n/0": 80 * GIB})
    assert service.reserve("held", {"n/0": 80 * GIB}, ttl_s=600, owner="service").ok
    code = (
        "import sys, time\n"
        "from toposched.ledger.sqlite import SqliteLedger\n"
        "ledger = SqliteLedger(sys.argv[1], clock=lambda: time.time() + 7200)\n"
        "print(ledger.reserve('stolen', {'n/0': 80 << 30}, ttl_s=600, owner='client').status)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "insufficient"
    assert [r.id for r in service.reservations()] == ["held"]
    service.close()
