"""The embedded default ledger: one SQLite file, safe for several processes on one host.

Layout (schema ``LEDGER_SCHEMA``; the file may also hold ``topology.store``'s DomainMap versions):

    gpus(ref, capacity)                      capacity per GPU
    reservations(id, owner, created_at, expires_at, gpus_json, meta_json)
    holds(rid, ref, bytes)                   one row per GPU of a reservation (reserved sums)
    audit(seq, at, action, rid, owner, gpus_json, expires_at)

Every change runs in a ``BEGIN IMMEDIATE`` transaction, which takes the file's single write lock
before it reads: the fit check and the insert see the same sums, so several processes can never
book the same bytes twice. Write transactions first sweep leases that have run out (deleting them
and logging ``expire``); reads filter by the clock, so an expired lease stops counting at once even
before a sweep. The file is in WAL mode (readers never wait for the writer) with
``synchronous=NORMAL``: a committed change survives a crash of the process; a power loss may roll
back the last commits but never damages the file.

A file that is not a database, is damaged, or stays locked past ``busy_timeout_s`` raises
``StateError`` naming the file; the ledger never starts empty over a file it cannot read.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

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

LEDGER_SCHEMA = 1

_TABLES = """
CREATE TABLE IF NOT EXISTS ledger_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ledger_gpus (ref TEXT PRIMARY KEY, capacity INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS ledger_reservations (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    gpus_json TEXT NOT NULL,
    meta_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_reservations_expiry ON ledger_reservations (expires_at);
CREATE TABLE IF NOT EXISTS ledger_holds (
    rid TEXT NOT NULL,
    ref TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    PRIMARY KEY (rid, ref)
);
CREATE INDEX IF NOT EXISTS ledger_holds_ref ON ledger_holds (ref);
CREATE TABLE IF NOT EXISTS ledger_audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    action TEXT NOT NULL,
    rid TEXT NOT NULL,
    owner TEXT NOT NULL,
    gpus_json TEXT NOT NULL,
    expires_at REAL
);
"""

_LIVE = "(r.expires_at IS NULL OR r.expires_at > ?)"
_COLUMNS = "id, owner, created_at, expires_at, gpus_json, meta_json"


def _row_to_reservation(row: tuple[str, str, float, float | None, str, str]) -> Reservation:
    rid, owner, created, expires, gpus_json, meta_json = row
    return Reservation(
        id=rid,
        owner=owner,
        created_at=created,
        expires_at=expires,
        gpus=json.loads(gpus_json),
        meta=json.loads(meta_json),
    )


class SqliteLedger:
    """A ledger in a SQLite file. The constructor does no I/O; the file is opened on first use."""

    UNSUPPORTED: ClassVar[Mapping[Feature, str]] = {
        Feature.MULTI_HOST: "a SQLite file is shared by the processes of one host only; use etcd for replicas",
        Feature.WATCH: "other processes see changes when they read, not by notification",
    }

    def __init__(self, path: str | Path, *, clock: Clock = wall_clock, busy_timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        self._clock = clock
        self._busy_timeout_s = busy_timeout_s
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        # One connection per process, shared by its threads: transactions are serialised by this lock
        # (a thread-per-connection design would hit "database is locked" between threads instead).
        self._lock = threading.RLock()

    # ------------------------------------------------------------------------------ connection

    def _fail(self, exc: sqlite3.Error) -> StateError:
        text = str(exc)
        if "locked" in text or "busy" in text:
            return StateError(
                f"the ledger file {self.path} is locked by another process (waited {self._busy_timeout_s:g} s)",
                fix=f"find the process holding it (`fuser {self.path}`) or retry when it is done",
            )
        return StateError(
            f"the ledger file {self.path} is not usable: {text}",
            fix="move it aside and restore a backup; toposched will not start an empty ledger over it",
        )

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None and self._pid == os.getpid():
            return self._conn
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateError(f"cannot create the folder of the ledger file {self.path}: {exc}") from exc
        conn: sqlite3.Connection | None = None
        try:
            conn = sqlite3.connect(
                self.path, timeout=self._busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            check = conn.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check[0] if check else 'no answer'}")
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()
            if mode is None or str(mode[0]).lower() != "wal":
                raise sqlite3.OperationalError(f"cannot switch to WAL mode (got {mode})")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _TABLES.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                row = conn.execute("SELECT value FROM ledger_meta WHERE key = 'schema'").fetchone()
                if row is None:
                    conn.execute("INSERT INTO ledger_meta VALUES ('schema', ?)", (str(LEDGER_SCHEMA),))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            raise self._fail(exc) from exc
        if row is not None and row[0] != str(LEDGER_SCHEMA):
            conn.close()
            raise StateError(
                f"the ledger file {self.path} has ledger schema {row[0]}; this toposched reads {LEDGER_SCHEMA}",
                fix="use the toposched version that wrote it, or move the file aside",
            )
        self._conn, self._pid = conn, os.getpid()
        return conn

    @contextmanager
    def _txn(self, *, write: bool) -> Iterator[tuple[sqlite3.Connection, float]]:
        """A transaction (write: ``BEGIN IMMEDIATE`` plus a sweep of due leases) and the time it runs at."""
        with self._lock:
            conn = self._connect()
            yield from self._run(conn, write=write)

    def _run(self, conn: sqlite3.Connection, *, write: bool) -> Iterator[tuple[sqlite3.Connection, float]]:
        try:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                now = self._clock()
                if write:
                    self._sweep(conn, now)
                yield conn, now
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise self._fail(exc) from exc

    def _sweep(self, conn: sqlite3.Connection, now: float) -> None:
        due = conn.execute(
            f"SELECT {_COLUMNS} FROM ledger_reservations WHERE expires_at <= ? ORDER BY expires_at", (now,)
        ).fetchall()
        for row in due:
            held = _row_to_reservation(row)
            self._delete(conn, held.id)
            self._log(conn, "expire", held, at=held.expires_at or now)

    @staticmethod
    def _delete(conn: sqlite3.Connection, rid: str) -> None:
        conn.execute("DELETE FROM ledger_reservations WHERE id = ?", (rid,))
        conn.execute("DELETE FROM ledger_holds WHERE rid = ?", (rid,))

    @staticmethod
    def _log(conn: sqlite3.Connection, action: AuditAction, held: Reservation, *, at: float) -> None:
        conn.execute(
            "INSERT INTO ledger_audit (at, action, rid, owner, gpus_json, expires_at) VALUES (?, ?, ?, ?, ?, ?)",
            (at, action, held.id, held.owner, json.dumps(held.gpus, sort_keys=True), held.expires_at),
        )

    @staticmethod
    def _find(conn: sqlite3.Connection, rid: str, now: float) -> Reservation | None:
        row = conn.execute(f"SELECT {_COLUMNS} FROM ledger_reservations r WHERE id = ? AND {_LIVE}", (rid, now))
        found = row.fetchone()
        return None if found is None else _row_to_reservation(found)

    # ------------------------------------------------------------------------------ the interface

    def set_capacity(self, capacities: Mapping[str, int]) -> None:
        for ref, cap in capacities.items():
            if cap < 0:
                raise ValueError(f"capacity of {ref} must be >= 0 (got {cap})")
        with self._txn(write=True) as (conn, _now):
            conn.executemany(
                "INSERT INTO ledger_gpus (ref, capacity) VALUES (?, ?) "
                "ON CONFLICT (ref) DO UPDATE SET capacity = excluded.capacity",
                list(capacities.items()),
            )

    def accounts(self) -> dict[str, GpuAccount]:
        with self._txn(write=False) as (conn, now):
            caps = conn.execute("SELECT ref, capacity FROM ledger_gpus").fetchall()
            sums = dict(
                conn.execute(
                    "SELECT h.ref, SUM(h.bytes) FROM ledger_holds h JOIN ledger_reservations r ON r.id = h.rid "
                    f"WHERE {_LIVE} GROUP BY h.ref",
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
            caps = dict(conn.execute(f"SELECT ref, capacity FROM ledger_gpus WHERE ref IN ({marks})", refs).fetchall())
            sums = dict(
                conn.execute(
                    f"SELECT ref, SUM(bytes) FROM ledger_holds WHERE ref IN ({marks}) GROUP BY ref", refs
                ).fetchall()
            )
            touched = {
                ref: GpuAccount(ref=ref, capacity_bytes=cap, reserved_bytes=int(sums.get(ref, 0)))
                for ref, cap in caps.items()
            }
            refusal = judge(rid, gpus, held, touched)
            if refusal is not None:
                return refusal
            reservation = Reservation(
                id=rid,
                gpus=dict(gpus),
                owner=owner,
                created_at=now,
                expires_at=None if ttl_s is None else now + ttl_s,
                meta=dict(meta or {}),
            )
            conn.execute(
                f"INSERT INTO ledger_reservations ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    rid,
                    owner,
                    now,
                    reservation.expires_at,
                    json.dumps(reservation.gpus, sort_keys=True),
                    json.dumps(reservation.meta, sort_keys=True),
                ),
            )
            conn.executemany(
                "INSERT INTO ledger_holds (rid, ref, bytes) VALUES (?, ?, ?)", [(rid, r, gpus[r]) for r in refs]
            )
            self._log(conn, "reserve", reservation, at=now)
        return ReserveResult(status="reserved", reservation=reservation)

    def renew(self, rid: str, ttl_s: float) -> Reservation | None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive (got {ttl_s})")
        with self._txn(write=True) as (conn, now):
            held = self._find(conn, rid, now)
            if held is None:
                return None
            renewed = held.model_copy(update={"expires_at": now + ttl_s})
            conn.execute("UPDATE ledger_reservations SET expires_at = ? WHERE id = ?", (renewed.expires_at, rid))
            self._log(conn, "renew", renewed, at=now)
        return renewed

    def release(self, rid: str) -> bool:
        with self._txn(write=True) as (conn, now):
            held = self._find(conn, rid, now)
            if held is None:
                return False
            self._delete(conn, rid)
            self._log(conn, "release", held, at=now)
        return True

    def get(self, rid: str) -> Reservation | None:
        with self._txn(write=False) as (conn, now):
            return self._find(conn, rid, now)

    def reservations(self) -> list[Reservation]:
        with self._txn(write=False) as (conn, now):
            rows = conn.execute(f"SELECT {_COLUMNS} FROM ledger_reservations r WHERE {_LIVE} ORDER BY id", (now,))
            return [_row_to_reservation(row) for row in rows.fetchall()]

    def audit(self, *, since: int = 0, limit: int | None = None) -> list[AuditEntry]:
        with self._txn(write=False) as (conn, now):
            due = conn.execute("SELECT 1 FROM ledger_reservations WHERE expires_at <= ? LIMIT 1", (now,)).fetchone()
        if due is not None:
            with self._txn(write=True):
                pass  # the write transaction sweeps and logs the expired leases
        with self._txn(write=False) as (conn, _now):
            rows = conn.execute(
                "SELECT seq, at, action, rid, owner, gpus_json, expires_at FROM ledger_audit "
                "WHERE seq > ? ORDER BY seq LIMIT ?",
                (since, -1 if limit is None else limit),
            ).fetchall()
        return [
            AuditEntry(seq=s, at=at, action=a, id=rid, owner=o, gpus=json.loads(g), expires_at=e)
            for s, at, a, rid, o, g, e in rows
        ]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None


BACKENDS.register("sqlite", lambda arg, clock: SqliteLedger(arg or default_state_path(), clock=clock))
