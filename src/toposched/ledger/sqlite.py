"""The embedded default ledger: one SQLite file, safe for several processes on one host.

The tables, their checksums and the checks of what is stored are ``toposched.ledger.sqlite_rows``.

Every change runs in a ``BEGIN IMMEDIATE`` transaction, which takes the file's single write lock
before it reads: the fit check and the insert see the same sums, so several processes can never
book the same bytes twice. Write transactions first sweep leases that have run out (deleting them
and logging ``expire``); reads filter by the clock, so an expired lease stops counting at once even
before a sweep. The file is opened through ``toposched.sqlite_file``, as the DomainMap store opens
it: WAL mode (readers never wait for the writer) with ``synchronous=FULL``, so a change is on disk
when the call returns and survives a power loss.

Damage: the first use in a process opens the file and refuses (``StateError`` naming the file, what is
wrong and the fix) to serve a ledger that differs from what was committed; the four checks are listed in
``toposched.ledger.sqlite_checks``, which the service also runs on an open file (``check``).

Rows are checked again whenever they are read (reservations, audit entries); sums (``accounts``,
the fit check) rely on the check at open. ``reservations()`` decodes only rows it has not read before: a
row read again exactly as stored last time (every value and the checksum equal) passed its check then, so
the Reservation decoded then is handed out again (decoding and checking cost 85 % of a full read). A row this
connection wrote (``reserve``, ``renew``) counts as read: its values and checksum are the ones it computed, so
reading it back exactly as written (``release``, ``renew``, ``get``, ``reservations()``) skips the check; a
row changed in the file in any way is checked as any other.

What the process knows (``_Known``). While no other connection has committed to the file (``PRAGMA
data_version`` unchanged) a connection knows the next audit seq and its time, the commit count, a lower bound
of the leases' expiry times and the audit entries it wrote itself: with no lease due a booking is 9
statements, a release 8, and ``audit()`` of its own entries that one pragma (docs/ledger.md). Leases are
judged in ledger time (``toposched.ledger.sqlite_time``), not by each process's own clock.

``FILE-commits`` is ``toposched.ledger.sqlite_mark``.

A folder or file the user may not write is reported as such (``sqlite_file.access_problem``), not as
damage. A file that stays locked past ``busy_timeout_s`` raises ``StateError`` too; the ledger never
starts empty over a file it cannot read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from toposched import sqlite_file
from toposched.config import default_state_path
from toposched.errors import StateError
from toposched.ledger.base import (
    BACKENDS,
    AuditAction,
    AuditEntry,
    Clock,
    Feature,
    GpuAccount,
    Reservation,
    ReserveResult,
    judge,
    validate_request,
    wall_clock,
)
from toposched.ledger.sqlite_checks import check_open, ledger_wal_damage
from toposched.ledger.sqlite_known import Known as _Known
from toposched.ledger.sqlite_mark import CommitMark
from toposched.ledger.sqlite_rows import (
    AUDIT_COLUMNS,
    COLUMNS,
    LIVE,
    Damaged,
    checked_row,
    damage_error,
    open_ledger,
    put_meta,
    row_to_reservation,
    sqlite_error,
    with_checksum,
)
from toposched.ledger.sqlite_time import LedgerTime

log = logging.getLogger(__name__)
_LOGGED_MAX = 1024
"""Own audit entries kept for ``audit()`` (the oldest half goes when there are more)."""


class SqliteLedger:
    """A ledger in a SQLite file. The constructor does no I/O; the file is opened on first use."""

    UNSUPPORTED: ClassVar[Mapping[Feature, str]] = {
        Feature.MULTI_HOST: "a SQLite file is shared by the processes of one host only; use etcd for replicas",
        Feature.WATCH: "other processes see changes when they read, not by notification",
    }

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Clock = wall_clock,
        busy_timeout_s: float = sqlite_file.BUSY_TIMEOUT_S,
        monotonic: Clock | None = None,
    ) -> None:
        self.path = Path(path)
        self._clock = clock
        # the elapsed-time source that bounds this process's clock: the real monotonic clock with the wall
        # clock; with another clock (a test's, the simulator's) that clock itself
        self._time = LedgerTime(clock, monotonic or (time.monotonic if clock is wall_clock else clock))
        self._busy_timeout_s = busy_timeout_s
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._ledger_id = ""
        self._mark = CommitMark(self.path.with_name(self.path.name + "-commits"))
        self._read_only = False  # the file is on a read-only file system (set when it is opened)
        self._known: _Known | None = None
        """What the connection knows while no other one commits (see the module docstring); None: read it."""
        # One connection per process, shared by its threads: transactions are serialised by this lock
        # (a thread-per-connection design would hit "database is locked" between threads instead).
        self._lock = threading.RLock()
        self._decoded: dict[str, tuple[tuple[Any, ...], Reservation]] = {}
        """Rows known good: id -> (the row as stored, checksum included; its Reservation). Those the last
        ``reservations()`` read, plus those this connection wrote since (and less those it deleted)."""

    @property
    def mark_path(self) -> Path:
        """``FILE-commits``: the ledger's id and how many commits it has acknowledged."""
        return self._mark.path

    # ------------------------------------------------------------------------------ opening

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None and self._pid == os.getpid():
            return self._conn
        self._read_only = sqlite_file.on_read_only_fs(self.path) and self.path.exists()
        if not self._read_only:
            sqlite_file.prepare(self.path, what="ledger file")
        wal = ledger_wal_damage(self.path)
        if wal is not None:
            raise damage_error(self.path, wal)
        mark = self._mark.read()
        conn: sqlite3.Connection | None = None
        try:
            if self._read_only:  # a snapshot or backup mount: shown, never changed (issue 37)
                conn = sqlite_file.connect_read_only(self.path, shared=True)
            else:
                conn = sqlite_file.connect(self.path, busy_timeout_s=self._busy_timeout_s, shared=True)
            ledger_id, commits = open_ledger(conn, self.path, read_only=self._read_only)
        except BaseException as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, sqlite3.Error):
                raise sqlite_error(self.path, exc, self._busy_timeout_s) from exc
            if isinstance(exc, Damaged):
                raise damage_error(self.path, str(exc)) from exc
            raise
        if mark is not None and mark[0] == ledger_id and mark[1] > commits:
            conn.close()
            raise StateError(
                f"the ledger file {self.path} lost committed changes: it holds {commits} commits, but "
                f"{self.mark_path.name} recorded {mark[1]} (a damaged, cut or deleted -wal file, or an older copy)",
                fix=f"restore the newest backup; if you put back an older copy on purpose, delete {self.mark_path}",
            )
        self._mark.close()
        if mark != (ledger_id, commits) and not self._read_only:
            self._mark.write(ledger_id, commits)
        self._conn, self._pid, self._ledger_id, self._known = conn, os.getpid(), ledger_id, None
        self._decoded = {}
        return conn

    # ------------------------------------------------------------------------------ transactions

    @contextmanager
    def _txn(self, *, write: bool) -> Iterator[tuple[sqlite3.Connection, float]]:
        """A transaction (write: ``BEGIN IMMEDIATE`` plus a sweep of due leases) and the time it runs at."""
        with self._lock:
            conn = self._connect()
            if write and self._read_only:
                raise StateError(
                    f"the ledger file {self.path} is on a read-only file system: it can be shown, not changed",
                    fix="mount it read-write, or copy it to a writable folder and use the copy",
                )
            yield from self._run(conn, write=write)

    def _run(self, conn: sqlite3.Connection, *, write: bool) -> Iterator[tuple[sqlite3.Connection, float]]:
        commits: int | None = None
        try:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                known = self._know(conn) if write else None
                now = self._ledger_now(conn, known) + 0.0  # + 0.0: SQLite keeps no -0.0, the checksum would differ
                before = conn.total_changes
                if known is not None and known.expiry_floor <= now:
                    self._sweep(conn, now, known)
                yield conn, now
                if known is not None and conn.total_changes != before:
                    known.commits += 1
                    put_meta(conn, "commits", str(known.commits))
                    commits = known.commits
                conn.execute("COMMIT")
            except BaseException:
                self._known = None  # it may hold changes that are not in the file: read it again
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise sqlite_error(self.path, exc, self._busy_timeout_s) from exc
        except Damaged as exc:
            raise damage_error(self.path, str(exc)) from exc
        if commits is not None:
            self._mark.write(self._ledger_id, commits)

    def _ledger_now(self, conn: sqlite3.Connection, known: _Known | None = None) -> float:
        """Ledger time (``sqlite_time.LedgerTime``): leases are judged against it. ``known`` (a write
        transaction's) gives the newest audit time and the earliest lease from memory; else two indexed reads."""
        if known is not None:
            return self._time.now(known.last_at, known.expiry_floor)
        row = conn.execute("SELECT at FROM ledger_audit ORDER BY seq DESC LIMIT 1").fetchone()
        (floor,) = conn.execute("SELECT min(expires_at) FROM ledger_reservations").fetchone()
        return self._time.now(None if row is None else float(row[0]), math.inf if floor is None else float(floor))

    def _know(self, conn: sqlite3.Connection) -> _Known:
        """``_Known`` for the transaction ``conn`` is in: kept when no other connection committed since it
        was read, else read again (next seq, commit count, earliest lease)."""
        (version,) = conn.execute("PRAGMA data_version").fetchone()
        known = self._known
        if known is not None and known.version == version:
            return known
        newest = conn.execute("SELECT seq, at FROM ledger_audit ORDER BY seq DESC LIMIT 1").fetchone()
        last, last_at = (0, None) if newest is None else (int(newest[0]), float(newest[1]))
        row = conn.execute("SELECT key, value, checksum FROM ledger_meta WHERE key = 'commits'").fetchone()
        if row is None:
            raise Damaged("ledger_meta has no commit count")
        commits = int(checked_row("ledger_meta", row)[1])
        (floor,) = conn.execute("SELECT min(expires_at) FROM ledger_reservations").fetchone()
        self._known = _Known(version, last + 1, commits, math.inf if floor is None else floor, last, last_at=last_at)
        return self._known

    def _sweep(self, conn: sqlite3.Connection, now: float, known: _Known) -> None:
        """Delete and log the leases that ran out; sets ``expiry_floor`` to the earliest lease left."""
        due = conn.execute(
            f"SELECT {COLUMNS} FROM ledger_reservations WHERE expires_at <= ? ORDER BY expires_at", (now,)
        ).fetchall()
        for row in due:
            rid, owner, _created, expires, gpus_json, _meta = checked_row("ledger_reservations", row)
            self._delete(conn, rid)
            self._log(conn, "expire", rid, owner, json.loads(gpus_json), expires, at=expires or now)
        (floor,) = conn.execute("SELECT min(expires_at) FROM ledger_reservations").fetchone()
        known.expiry_floor = math.inf if floor is None else floor

    def _delete(self, conn: sqlite3.Connection, rid: str) -> None:
        conn.execute("DELETE FROM ledger_reservations WHERE id = ?", (rid,))
        conn.execute("DELETE FROM ledger_holds WHERE rid = ?", (rid,))
        self._decoded.pop(rid, None)

    def _log(
        self,
        conn: sqlite3.Connection,
        action: AuditAction,
        rid: str,
        owner: str,
        gpus: Mapping[str, int],
        expires_at: float | None,
        *,
        at: float,
    ) -> None:
        """Append an audit entry (inside a write transaction, after ``_know``)."""
        known = self._known
        assert known is not None, "_log runs in a write transaction"
        values = (known.next_seq, float(at), action, rid, owner, json.dumps(gpus, sort_keys=True), expires_at)
        conn.execute(
            f"INSERT INTO ledger_audit ({AUDIT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            with_checksum("ledger_audit", values),
        )
        known.next_seq += 1
        known.last_at = float(at)
        self._time.wrote(float(at))
        known.logged.append(values)
        if len(known.logged) > _LOGGED_MAX:
            del known.logged[: _LOGGED_MAX // 2]
            known.logged_after = known.logged[0][0] - 1

    def _find_row(self, conn: sqlite3.Connection, rid: str, now: float) -> tuple[Any, ...] | None:
        """The live row ``rid`` without its checksum, checked unless it is stored exactly as known good."""
        row = conn.execute(f"SELECT {COLUMNS} FROM ledger_reservations r WHERE id = ? AND {LIVE}", (rid, now))
        found = row.fetchone()
        if found is None:
            return None
        known = self._decoded.get(rid)
        if known is not None and known[0] == found:
            return found[:-1]  # type: ignore[no-any-return]
        return checked_row("ledger_reservations", found)

    def _find(self, conn: sqlite3.Connection, rid: str, now: float) -> Reservation | None:
        values = self._find_row(conn, rid, now)
        if values is None:
            return None
        known = self._decoded.get(rid)
        if known is not None and known[0][:-1] == values:
            return known[1]
        return row_to_reservation(values)

    # ------------------------------------------------------------------------------ the interface

    def set_capacity(self, capacities: Mapping[str, int]) -> None:
        for ref, cap in capacities.items():
            if not isinstance(cap, int) or cap < 0:
                raise ValueError(f"capacity of {ref} must be an integer >= 0 (got {cap!r})")
        with self._txn(write=True) as (conn, _now):
            conn.executemany(
                "INSERT INTO ledger_gpus (ref, capacity, checksum) VALUES (?, ?, ?) "
                "ON CONFLICT (ref) DO UPDATE SET capacity = excluded.capacity, checksum = excluded.checksum",
                [with_checksum("ledger_gpus", (ref, int(cap))) for ref, cap in capacities.items()],
            )

    def accounts(self) -> dict[str, GpuAccount]:
        with self._txn(write=False) as (conn, now):
            caps = conn.execute("SELECT ref, capacity FROM ledger_gpus").fetchall()
            sums = dict(
                conn.execute(
                    "SELECT h.ref, SUM(h.bytes) FROM ledger_holds h JOIN ledger_reservations r ON r.id = h.rid "
                    f"WHERE {LIVE} GROUP BY h.ref",
                    (now,),
                ).fetchall()
            )
        return {ref: GpuAccount(ref=ref, capacity_bytes=cap, reserved_bytes=int(sums.get(ref, 0))) for ref, cap in caps}

    def reserve(
        self,
        rid: str,
        gpus: Mapping[str, int],
        *,
        ttl_s: float | None = None,
        owner: str = "",
        meta: Mapping[str, str] | None = None,
    ) -> ReserveResult:
        problem = validate_request(gpus, ttl_s)
        if problem:
            return ReserveResult(status="invalid", reasons={"request": problem})
        refs = sorted(gpus)
        marks = ",".join("?" * len(refs))
        with self._txn(write=True) as (conn, now):
            held = self._find(conn, rid, now)
            # every hold counts: the write transaction swept the leases that ran out
            rows = conn.execute(
                "SELECT g.ref, g.capacity, (SELECT coalesce(sum(h.bytes), 0) FROM ledger_holds h WHERE h.ref = g.ref) "
                f"FROM ledger_gpus g WHERE g.ref IN ({marks})",
                refs,
            ).fetchall()
            touched = {
                ref: GpuAccount(ref=ref, capacity_bytes=cap, reserved_bytes=int(used)) for ref, cap, used in rows
            }
            refusal = judge(rid, gpus, held, touched)
            if refusal is not None:
                return refusal
            reservation = Reservation(
                id=rid,
                gpus=dict(gpus),
                owner=owner,
                created_at=now,
                expires_at=None if ttl_s is None else now + float(ttl_s),
                meta=dict(meta or {}),
            )
            row = (
                rid,
                owner,
                now,
                reservation.expires_at,
                json.dumps(reservation.gpus, sort_keys=True),
                json.dumps(reservation.meta, sort_keys=True),
            )
            stored = with_checksum("ledger_reservations", row)
            conn.execute(f"INSERT INTO ledger_reservations ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)", stored)
            self._decoded[rid] = (stored, reservation)
            conn.executemany(
                "INSERT INTO ledger_holds (rid, ref, bytes, checksum) VALUES (?, ?, ?, ?)",
                [with_checksum("ledger_holds", (rid, r, int(gpus[r]))) for r in refs],
            )
            self._log(conn, "reserve", rid, owner, reservation.gpus, reservation.expires_at, at=now)
            self._lease_ends(reservation.expires_at)
        return ReserveResult(status="reserved", reservation=reservation)

    def _lease_ends(self, expires_at: float | None) -> None:
        """Keep ``expiry_floor`` a lower bound after a lease was written (in a write transaction)."""
        if expires_at is not None and self._known is not None:
            self._known.expiry_floor = min(self._known.expiry_floor, expires_at)

    def renew(self, rid: str, ttl_s: float) -> Reservation | None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive (got {ttl_s})")
        with self._txn(write=True) as (conn, now):
            values = self._find_row(conn, rid, now)
            if values is None:
                return None
            renewed = row_to_reservation(values).model_copy(update={"expires_at": now + float(ttl_s)})
            stored = with_checksum("ledger_reservations", (*values[:3], renewed.expires_at, *values[4:]))
            conn.execute(
                "UPDATE ledger_reservations SET expires_at = ?, checksum = ? WHERE id = ?",
                (renewed.expires_at, stored[-1], rid),
            )
            self._decoded[rid] = (stored, renewed)
            self._log(conn, "renew", rid, renewed.owner, renewed.gpus, renewed.expires_at, at=now)
            self._lease_ends(renewed.expires_at)
        return renewed

    def release(self, rid: str) -> bool:
        with self._txn(write=True) as (conn, now):
            values = self._find_row(conn, rid, now)
            if values is None:
                return False
            _rid, owner, _created, expires, gpus_json, _meta = values  # (the meta is not needed to log it)
            self._delete(conn, rid)
            self._log(conn, "release", rid, owner, json.loads(gpus_json), expires, at=now)
        return True

    def get(self, rid: str) -> Reservation | None:
        with self._txn(write=False) as (conn, now):
            return self._find(conn, rid, now)

    def reservations(self) -> list[Reservation]:
        """Every live reservation; a row unchanged since the last call is not decoded again (see above)."""
        with self._txn(write=False) as (conn, now):
            rows = conn.execute(f"SELECT {COLUMNS} FROM ledger_reservations r WHERE {LIVE} ORDER BY id", (now,))
            decoded: dict[str, tuple[tuple[Any, ...], Reservation]] = {}
            for row in rows.fetchall():
                known = self._decoded.get(row[0])
                if known is not None and known[0] == row:
                    decoded[row[0]] = known
                else:
                    decoded[row[0]] = (row, row_to_reservation(checked_row("ledger_reservations", row)))
            self._decoded = decoded  # only the rows live now: it never outgrows the table
        return [reservation for _row, reservation in decoded.values()]

    def audit(self, *, since: int = 0, limit: int | None = None) -> list[AuditEntry]:
        """The log after the expiries that are due are logged. Entries this process wrote come from memory
        when nobody else committed since (one pragma); otherwise one read transaction when no lease is due."""

        def entries(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
            rows = conn.execute(
                f"SELECT {AUDIT_COLUMNS} FROM ledger_audit WHERE seq > ? ORDER BY seq LIMIT ?",
                (since, -1 if limit is None else limit),
            ).fetchall()
            return [checked_row("ledger_audit", row) for row in rows]

        with self._lock:
            checked = self._own_entries(since)
            if checked is None:
                with self._txn(write=False) as (conn, now):
                    due = self._know(conn).expiry_floor <= now
                    checked = entries(conn) if not due else []
                if due:
                    with self._txn(write=True) as (conn, _now):  # a write transaction sweeps and logs the expired
                        checked = entries(conn)
            elif limit is not None:
                checked = checked[:limit]
        return [
            AuditEntry(seq=s, at=at, action=a, id=rid, owner=o, gpus=json.loads(g), expires_at=e)
            for s, at, a, rid, o, g, e in checked
        ]

    def _own_entries(self, since: int) -> list[tuple[Any, ...]] | None:
        """The entries after ``since`` from memory (``_Known.logged``): None unless the file holds no other
        entry (no other connection committed), ``since`` is not older than what is kept and no lease is due."""
        known = self._known
        if known is None or since < known.logged_after:
            return None
        conn = self._connect()
        if conn is not self._conn or self._known is not known:
            return None  # a new connection: read the file
        try:
            (version,) = conn.execute("PRAGMA data_version").fetchone()
        except sqlite3.Error as exc:
            raise sqlite_error(self.path, exc, self._busy_timeout_s) from exc
        if version != known.version or known.expiry_floor <= float(self._clock()):
            return None
        return known.logged[since - known.logged_after :]

    def check(self) -> None:
        """The checks of the open, again (``sqlite_checks.check_open``): ``StateError`` naming the damage. The
        service runs it every ``resync_interval_s`` so a row damaged under it stops it as it stops every new
        process (issue 37)."""
        with self._lock:
            check_open(self._connect(), self.path, self._busy_timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._mark.close()
            self._conn = None
            self._decoded = {}
            self._known = None


BACKENDS.register("sqlite", lambda arg, clock: SqliteLedger(arg or default_state_path(), clock=clock))
