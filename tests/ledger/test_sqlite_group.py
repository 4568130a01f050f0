"""Group commit in the SQLite ledger (``SqliteLedger.group_commit``): many changes, one commit."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from toposched.errors import StateError
from toposched.ledger.base import GIB
from toposched.ledger.sqlite import GroupHooks, SqliteLedger


class Hooks:
    """What the ledger told its group's owner."""

    def __init__(self) -> None:
        self.opened = 0
        self.settled: list[StateError | None] = []

    def hooks(self) -> GroupHooks:
        def opened() -> None:
            self.opened += 1

        return GroupHooks(opened=opened, settled=self.settled.append)


def commits(ledger: SqliteLedger) -> int:
    return int(ledger.mark_path.read_text().split()[2])


def grouped(tmp_path: Path) -> tuple[SqliteLedger, Hooks]:
    ledger = SqliteLedger(tmp_path / "state.sqlite3")
    ledger.set_capacity({f"n/{i}": 80 * GIB for i in range(4)})
    seen = Hooks()
    ledger.group_commit(seen.hooks())
    return ledger, seen


def other_view(ledger: SqliteLedger) -> list[str]:
    """The reservation ids another process sees (a second connection, reading the file)."""
    with sqlite3.connect(ledger.path) as db:
        return sorted(row[0] for row in db.execute("SELECT id FROM ledger_reservations"))


def test_changes_join_one_transaction_and_one_commit_makes_them_durable(tmp_path: Path) -> None:
    ledger, seen = grouped(tmp_path)
    before = commits(ledger)
    assert ledger.reserve("a", {"n/0": GIB}).ok
    assert ledger.reserve("b", {"n/1": GIB}).ok
    assert ledger.release("a")
    assert seen.opened == 1 and seen.settled == []
    assert other_view(ledger) == []  # nothing is on disk before the flush
    assert [r.id for r in ledger.reservations()] == ["b"]  # this connection reads its group's changes
    assert [(e.action, e.id) for e in ledger.audit()] == [("reserve", "a"), ("reserve", "b"), ("release", "a")]
    ledger.flush()
    assert seen.settled == [None]
    assert other_view(ledger) == ["b"]
    assert commits(ledger) == before + 1
    ledger.flush()  # nothing open: nothing happens
    assert seen.settled == [None]
    ledger.close()
    again = SqliteLedger(ledger.path)  # the commit count, seqs and checksums agree on reopening
    assert [(e.seq, e.id) for e in again.audit()] == [(1, "a"), (2, "b"), (3, "a")]
    again.close()


def test_a_change_that_fails_is_undone_alone(tmp_path: Path) -> None:
    ledger, seen = grouped(tmp_path)
    with sqlite3.connect(ledger.path) as db:
        db.execute(
            "CREATE TRIGGER fail BEFORE INSERT ON ledger_audit WHEN NEW.rid = 'bad' "
            "BEGIN SELECT RAISE(ABORT, 'disk full'); END"
        )
    assert ledger.reserve("a", {"n/0": GIB}).ok
    with pytest.raises(StateError, match="disk full"):
        ledger.reserve("bad", {"n/1": GIB})
    assert ledger.reserve("c", {"n/2": GIB}).ok
    refused = ledger.reserve("d", {"n/0": 80 * GIB})  # a refusal changes nothing and keeps the group
    assert refused.status == "insufficient"
    ledger.flush()
    assert seen.settled == [None]
    assert other_view(ledger) == ["a", "c"]
    assert [(e.seq, e.id) for e in ledger.audit()] == [(1, "a"), (2, "c")]  # no gap where "bad" failed
    ledger.close()


def test_a_commit_that_fails_undoes_the_whole_group_and_says_so(tmp_path: Path) -> None:
    ledger, seen = grouped(tmp_path)
    assert ledger.reserve("kept", {"n/3": GIB}).ok
    ledger.flush()
    assert ledger.reserve("a", {"n/0": GIB}).ok
    assert ledger.release("kept")
    conn = ledger._conn
    assert conn is not None

    def no_commit(action: int, operation: object, *_args: object) -> int:  # SQLite refuses the COMMIT itself
        return (
            sqlite3.SQLITE_DENY if (action, operation) == (sqlite3.SQLITE_TRANSACTION, "COMMIT") else sqlite3.SQLITE_OK
        )

    conn.set_authorizer(no_commit)
    with pytest.raises(StateError, match="not usable: not authorized"):
        ledger.flush()
    conn.set_authorizer(None)
    assert len(seen.settled) == 2 and seen.settled[0] is None
    lost = seen.settled[1]
    assert isinstance(lost, StateError) and "not authorized" in lost.message
    assert not conn.in_transaction
    assert [r.id for r in ledger.reservations()] == ["kept"]  # both changes of the group are undone
    assert [(e.seq, e.action, e.id) for e in ledger.audit()] == [(1, "reserve", "kept")]
    assert ledger.reserve("b", {"n/0": GIB}).ok  # the next group numbers on from what is on disk
    ledger.flush()
    assert [(e.seq, e.id) for e in ledger.audit()] == [(1, "kept"), (2, "b")]
    ledger.close()
    again = SqliteLedger(ledger.path)  # FILE-commits was not counted for the lost group
    assert sorted(r.id for r in again.reservations()) == ["b", "kept"]
    again.close()


def test_a_change_from_another_thread_commits_the_group_before_it_returns(tmp_path: Path) -> None:
    ledger, seen = grouped(tmp_path)
    assert ledger.reserve("a", {"n/0": GIB}).ok
    worker = threading.Thread(target=lambda: ledger.reserve("b", {"n/1": GIB}))
    worker.start()
    worker.join()
    assert seen.settled == [None]
    assert other_view(ledger) == ["a", "b"]
    ledger.close()


def test_close_and_turning_it_off_commit_the_open_group(tmp_path: Path) -> None:
    ledger, seen = grouped(tmp_path)
    assert ledger.reserve("a", {"n/0": GIB}).ok
    ledger.group_commit(None)
    assert seen.settled == [None] and other_view(ledger) == ["a"]
    assert ledger.reserve("b", {"n/1": GIB}).ok  # off: committed at once
    assert other_view(ledger) == ["a", "b"] and seen.opened == 1
    ledger.group_commit(seen.hooks())
    assert ledger.release("a")
    ledger.close()
    assert other_view(ledger) == ["b"] and seen.settled == [None, None]


def test_another_process_waits_for_the_group_and_then_sees_it_whole(tmp_path: Path) -> None:
    ledger, _seen = grouped(tmp_path)
    other = SqliteLedger(ledger.path, busy_timeout_s=0.05)
    assert other.accounts()["n/0"].reserved_bytes == 0  # (opens its connection before the group starts)
    assert ledger.reserve("a", {"n/0": 80 * GIB}).ok
    with pytest.raises(StateError, match="locked"):  # the group holds the write lock until it commits
        other.reserve("b", {"n/0": GIB})
    assert other.accounts()["n/0"].reserved_bytes == 0  # readers see the last commit
    ledger.flush()
    assert other.reserve("b", {"n/0": GIB}).status == "insufficient"
    ledger.close()
    other.close()


def test_a_group_that_cannot_be_rolled_back_is_dropped_with_its_connection(tmp_path: Path) -> None:
    """When even ROLLBACK fails, the connection is closed (SQLite undoes an open transaction then): the
    group's changes must never ride along with a later commit."""
    ledger, seen = grouped(tmp_path)
    assert ledger.reserve("a", {"n/0": GIB}).ok
    conn = ledger._conn
    assert conn is not None

    def no_end(action: int, *_args: object) -> int:
        return sqlite3.SQLITE_DENY if action == sqlite3.SQLITE_TRANSACTION else sqlite3.SQLITE_OK

    conn.set_authorizer(no_end)
    with pytest.raises(StateError, match="not authorized"):
        ledger.flush()
    assert isinstance(seen.settled[-1], StateError)
    assert ledger._conn is None
    assert ledger.reserve("b", {"n/1": GIB}).ok  # a new connection, checked as at open
    ledger.flush()
    assert other_view(ledger) == ["b"]
    ledger.close()
