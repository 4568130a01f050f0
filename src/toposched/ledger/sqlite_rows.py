"""The SQLite ledger's tables and the checks of what is stored in them.

Layout (schema ``LEDGER_SCHEMA``; the file may also hold ``topology.store``'s DomainMap versions):

    ledger_meta(key, value)                  schema, ledger id, number of commits
    ledger_gpus(ref, capacity)               capacity per GPU
    ledger_reservations(id, owner, created_at, expires_at, gpus_json, meta_json)
    ledger_holds(rid, ref, bytes)            one row per GPU of a reservation (reserved sums)
    ledger_audit(seq, at, action, rid, owner, gpus_json, expires_at)

and on every row a ``checksum`` of its values (``row_checksum``). A schema-1 file (no checksums) is
upgraded in place on first open, after it passes the integrity check (``upgrade_from_1``). ``verify``
checks every row against its checksum, each reservation against its ``ledger_holds`` rows and the audit
seqs for gaps; ``checked_row`` checks one row as it is read. Stored content that fails a check raises
``Damaged``, which ``toposched.ledger.sqlite.SqliteLedger`` turns into ``damage_error``'s ``StateError``
naming the file; ``sqlite_error`` says what one of SQLite's errors on the file means for its user.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from toposched import sqlite_file
from toposched.errors import StateError
from toposched.ledger.base import Reservation

LEDGER_SCHEMA = 2

TABLES = """
CREATE TABLE IF NOT EXISTS ledger_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL, checksum INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS ledger_gpus (ref TEXT PRIMARY KEY, capacity INTEGER NOT NULL, checksum INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS ledger_reservations (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    gpus_json TEXT NOT NULL,
    meta_json TEXT NOT NULL,
    checksum INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_reservations_expiry ON ledger_reservations (expires_at);
CREATE TABLE IF NOT EXISTS ledger_holds (
    rid TEXT NOT NULL,
    ref TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    checksum INTEGER NOT NULL,
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
    expires_at REAL,
    checksum INTEGER NOT NULL
);
"""

# The columns each row's checksum covers, in order; the first KEYS[table] of them name the row.
ROWS: dict[str, tuple[str, ...]] = {
    "ledger_meta": ("key", "value"),
    "ledger_gpus": ("ref", "capacity"),
    "ledger_reservations": ("id", "owner", "created_at", "expires_at", "gpus_json", "meta_json"),
    "ledger_holds": ("rid", "ref", "bytes"),
    "ledger_audit": ("seq", "at", "action", "rid", "owner", "gpus_json", "expires_at"),
}
KEYS = {"ledger_meta": 1, "ledger_gpus": 1, "ledger_reservations": 1, "ledger_holds": 2, "ledger_audit": 1}
LIVE = "(r.expires_at IS NULL OR r.expires_at > ?)"
COLUMNS = "id, owner, created_at, expires_at, gpus_json, meta_json, checksum"
AUDIT_COLUMNS = "seq, at, action, rid, owner, gpus_json, expires_at, checksum"


def row_checksum(table: str, values: Sequence[object]) -> int:
    """CRC-32 of ``ascii((table, *values))``: the row's values as SQLite returns them (str, int, float,
    None), spelled the same way by every Python version. Random damage goes unseen with odds 2**-32."""
    return zlib.crc32(ascii((table, *values)).encode())


def with_checksum(table: str, values: Sequence[object]) -> tuple[object, ...]:
    return (*values, row_checksum(table, values))


class Damaged(Exception):
    """Stored content that fails a check; the ledger turns it into a StateError naming the file."""


def checked_row(table: str, row: Sequence[Any]) -> tuple[Any, ...]:
    """A row's values without its checksum, once the checksum matches them."""
    *values, checksum = row
    if row_checksum(table, values) != checksum:
        key = ", ".join(f"{col}={value!r}" for col, value in zip(ROWS[table], values[: KEYS[table]], strict=False))
        raise Damaged(f"row {table} {key} fails its checksum")
    return tuple(values)


def row_to_reservation(values: Sequence[Any]) -> Reservation:
    rid, owner, created, expires, gpus_json, meta_json = values
    return Reservation(
        id=rid,
        owner=owner,
        created_at=created,
        expires_at=expires,
        gpus=json.loads(gpus_json),
        meta=json.loads(meta_json),
    )


def open_ledger(conn: sqlite3.Connection, path: Path, *, read_only: bool = False) -> tuple[str, int]:
    """Check a new connection's file (``path``), create or upgrade the ledger tables; the ledger's id and
    commits. Raises ``Damaged`` for content that fails a check, ``StateError`` for a schema it cannot read.
    ``read_only``: check only (a file on a read-only file system: nothing is created or upgraded)."""
    # The whole file, not only the ledger's tables: that also checks the free-page list, whose damage
    # would let SQLite hand out a page in use. It costs 18 ms at 4,096 GPUs (+0.5 ms per MiB of DomainMaps).
    check = conn.execute("PRAGMA integrity_check").fetchall()
    if [tuple(row) for row in check] != [("ok",)]:
        more = f" (and {len(check) - 1} more)" if len(check) > 1 else ""
        raise Damaged(f"integrity_check: {check[0][0] if check else 'no answer'}{more}")
    if read_only:
        return _check_read_only(conn, path)
    sqlite_file.use_wal(conn)
    conn.execute("BEGIN IMMEDIATE")
    try:
        for statement in TABLES.split(";"):
            if statement.strip():
                conn.execute(statement)
        row = conn.execute("SELECT value FROM ledger_meta WHERE key = 'schema'").fetchone()
        if row is None:
            put_meta(conn, "schema", str(LEDGER_SCHEMA))
            put_meta(conn, "ledger_id", uuid.uuid4().hex)
            put_meta(conn, "commits", "0")
        elif row[0] == "1":
            upgrade_from_1(conn)
        elif row[0] != str(LEDGER_SCHEMA):
            raise StateError(
                f"the ledger file {path} has ledger schema {row[0]}; this toposched reads {LEDGER_SCHEMA}",
                fix="use the toposched version that wrote it, or move the file aside",
            )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    if row is None:  # put the new ledger's id in the main file at once (see FILE-commits)
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
    conn.execute("BEGIN")
    try:
        return verify(conn)
    finally:
        conn.execute("COMMIT")


def _check_read_only(conn: sqlite3.Connection, path: Path) -> tuple[str, int]:
    """``open_ledger`` of a file that may not be written: its schema must be this version's already."""
    try:
        row = conn.execute("SELECT value FROM ledger_meta WHERE key = 'schema'").fetchone()
    except sqlite3.OperationalError:
        row = None
    if row is None or row[0] != str(LEDGER_SCHEMA):
        found = "no ledger" if row is None else f"ledger schema {row[0]}"
        raise StateError(
            f"the ledger file {path} is on a read-only file system and holds {found}; this toposched reads "
            f"schema {LEDGER_SCHEMA} and cannot create or upgrade it there",
            fix="copy it to a writable folder (toposched upgrades a copy on first use), or mount it read-write",
        )
    conn.execute("BEGIN")
    try:
        return verify(conn)
    finally:
        conn.execute("COMMIT")


def put_meta(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute(
        "INSERT INTO ledger_meta (key, value, checksum) VALUES (?, ?, ?) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value, checksum = excluded.checksum",
        with_checksum("ledger_meta", (key, value)),
    )


def upgrade_from_1(conn: sqlite3.Connection) -> None:
    """Schema 1 had no checksums: add them over the rows as they are (after integrity_check)."""
    for table, columns in ROWS.items():
        conn.execute(f"ALTER TABLE {table} ADD COLUMN checksum INTEGER NOT NULL DEFAULT 0")
        rows = conn.execute(f"SELECT rowid, {', '.join(columns)} FROM {table}").fetchall()
        conn.executemany(
            f"UPDATE {table} SET checksum = ? WHERE rowid = ?", [(row_checksum(table, r[1:]), r[0]) for r in rows]
        )
    put_meta(conn, "schema", str(LEDGER_SCHEMA))
    put_meta(conn, "ledger_id", uuid.uuid4().hex)
    put_meta(conn, "commits", "0")


def verify(conn: sqlite3.Connection) -> tuple[str, int]:
    """Every ledger row against its checksum, reservations against their holds, audit seqs without
    gaps; the ledger's id and commit count. Runs inside a read transaction."""

    def rows(table: str) -> Iterator[tuple[Any, ...]]:
        query = f"SELECT {', '.join(ROWS[table])}, checksum FROM {table} ORDER BY rowid"
        cursor = conn.execute(query)
        try:
            for row in cursor:
                yield checked_row(table, row)
        finally:
            # a check that raises half-way must not leave the statement open: it would hold the read
            # snapshot as long as the exception's traceback lives, and the next check would see the damage
            # it read even after a repair
            cursor.close()

    meta = {key: value for key, value in rows("ledger_meta")}
    gpus = {ref for ref, _capacity in rows("ledger_gpus")}
    holds: dict[str, dict[str, int]] = {}
    for rid, ref, size in rows("ledger_holds"):
        if ref not in gpus:
            raise Damaged(f"ledger_holds row rid={rid!r}, ref={ref!r} names a GPU that is not in ledger_gpus")
        holds.setdefault(rid, {})[ref] = size
    for rid, *_, gpus_json, _meta_json in rows("ledger_reservations"):
        try:
            booked = json.loads(gpus_json)
        except ValueError:
            booked = None
        if booked != holds.pop(rid, None):
            raise Damaged(f"reservation {rid!r} and its rows in ledger_holds disagree")
    if holds:
        raise Damaged(f"ledger_holds has rows of no reservation (rid={min(holds)!r})")
    count = first = last = 0
    for seq, *_ in rows("ledger_audit"):
        first, last, count = first or seq, seq, count + 1
    if count != last - first + 1 and count:
        raise Damaged(f"ledger_audit holds {count} entries for seq {first}..{last}")
    if not meta.get("ledger_id") or not meta.get("commits", "").isdigit():
        raise Damaged("ledger_meta has no ledger id or commit count")
    return meta["ledger_id"], int(meta["commits"])


def damage_error(path: Path, what: str, *, state: str = "is damaged") -> StateError:
    """The error of a ledger file whose content fails a check (``what``): keep it, restore a backup."""
    return StateError(
        f"the ledger file {path} {state}: {what}",
        fix=f"stop toposched, move {path.name} and its -wal/-shm/-commits files aside (keep them) and "
        "restore a backup; without one, an empty ledger starts and holders must reserve again",
    )


def sqlite_error(path: Path, exc: sqlite3.Error, busy_timeout_s: float) -> StateError:
    """What SQLite's error ``exc`` on the ledger file means for its user: locked, not allowed, damaged."""
    text = str(exc)
    name = getattr(exc, "sqlite_errorname", "") or ""
    if "locked" in text or "busy" in text:
        return StateError(
            f"the ledger file {path} is locked by another process (waited {busy_timeout_s:g} s)",
            fix=f"find the process holding it (`fuser {path}`) or retry when it is done",
        )
    access = sqlite_file.access_problem(path)
    if access is not None:
        return StateError(access[0], fix=access[1])
    if name == "SQLITE_NOTADB":
        return damage_error(path, f"{text} (or its first page is damaged)", state="is not usable")
    if name.startswith("SQLITE_CORRUPT") or "decode" in text:
        return damage_error(path, f"{text} ({name or type(exc).__name__})")
    return StateError(
        f"the ledger file {path} is not usable: {text} ({name or type(exc).__name__})",
        fix="check the file and the disk; toposched will not start an empty ledger over it",
    )
