"""Opening the SQLite state file: the one place its connections are set up.

The embedded state file (``--state sqlite:PATH``) holds the HBM ledger (``ledger/sqlite.py``) and the
DomainMap versions (``topology/store.py``); both open it here, so both get the same folder and
permission checks, the same busy timeout and the same journal settings:

* ``prepare`` creates the folder and refuses, before SQLite touches the file, a path this user may
  not use as SQLite needs (``access_problem``): SQLite writes the file and creates ``FILE-wal`` and
  ``FILE-shm`` next to it, so the folder must be writable too. Otherwise SQLite reports such a path
  as "unable to open database file" or as a read-only database, which reads like damage.
* ``connect`` opens a connection in autocommit mode (callers say ``BEGIN`` / ``BEGIN IMMEDIATE``
  themselves) that waits up to ``busy_timeout_s`` for another process's write lock.
* ``use_wal`` switches the file to WAL mode, so readers never wait for the writer and several
  processes on one host share it, with ``synchronous=FULL``.

Errors are ``StateError`` naming the file and the fix.
"""

from __future__ import annotations

import os
import pwd
import sqlite3
from collections.abc import Callable
from pathlib import Path

from toposched.errors import StateError

BUSY_TIMEOUT_S = 10.0
"""How long a connection waits for another process's write lock before the call fails."""


def _can(path: Path, mode: int) -> bool:
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _shown(path: Path) -> str:
    text = str(path)
    return text if len(text) <= 80 else text[:77] + "..."


def access_problem(
    path: Path, *, what: str = "ledger file", can: Callable[[Path, int], bool] | None = None
) -> tuple[str, str] | None:
    """(message, fix) when this user may not use the SQLite file ``path`` as SQLite needs, else None.

    ``what`` names the file in messages ("ledger file", "state file"). The folder must be writable
    (for ``FILE-wal`` and ``FILE-shm``), and the file and its companions readable and writable.
    """
    can = can or _can
    user = _user_name(os.geteuid())
    folder = path.parent
    try:
        if path.is_dir():
            return (f"{_shown(path)} is a folder, not a {what}", "point --state at a file, e.g. DIR/state.sqlite3")
        path.exists()
    except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL byte
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        noun = what.removesuffix(" file")
        return (f"the {noun} path {_shown(path)} cannot be used: {reason}", "give a shorter, plain path")
    redirect = "or point --state (TOPOSCHED_STATE) at a writable place"
    if not can(folder, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
            owner = _user_name(folder.stat().st_uid)
        except OSError:
            read_only, owner = False, "?"
        if read_only:
            return (
                f"the folder {folder} is on a read-only file system; SQLite needs to write the {what} "
                f"{path.name} and create {path.name}-wal and {path.name}-shm next to it",
                f"remount it read-write, {redirect}",
            )
        return (
            f"the folder {folder} is not writable by user {user}; SQLite needs to create {path.name}-wal and "
            f"{path.name}-shm next to the {what} {path.name}",
            f"run toposched as {owner} (the folder's owner), let {user} write to the folder, {redirect}",
        )
    for each in (path, *(path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-commits"))):
        if each.exists() and not can(each, os.R_OK | os.W_OK):
            owner = _user_name(each.stat().st_uid)
            return (
                f"the {what} {each} is not readable and writable by user {user} (it belongs to {owner})",
                f"run toposched as {owner}, give {user} read and write access to {path.name}*, {redirect}",
            )
    return None


def prepare(path: Path, *, what: str) -> None:
    """Create the folder of ``path`` and check that this user may use the file; ``StateError`` if not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StateError(
            f"cannot create the folder of the {what} {path}: {exc}",
            fix="create it as a user who may, or point --state (TOPOSCHED_STATE) at a writable place",
        ) from exc
    problem = access_problem(path, what=what)
    if problem is not None:
        raise StateError(problem[0], fix=problem[1])


def connect(path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S, shared: bool = False) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit ``BEGIN``s) that waits up to
    ``busy_timeout_s`` for the write lock; ``shared`` lets the threads of one process use it (the
    caller serialises them). Raises ``sqlite3.Error``: callers translate it, knowing what the file holds."""
    return sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=not shared)


def on_read_only_fs(path: Path) -> bool:
    """The folder of ``path`` is on a file system mounted read-only (a snapshot, a backup mount)."""
    try:
        return bool(os.statvfs(path.parent).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def connect_read_only(path: Path, *, shared: bool = False) -> sqlite3.Connection:
    """A read-only connection to a file on a read-only file system, where SQLite can create neither
    ``FILE-wal`` nor ``FILE-shm``: ``immutable=1`` when there is no write-ahead log to replay (SQLite then
    reads the main file as it is), else ``mode=ro`` (which needs the ``-shm`` file the writer left).
    ``StateError`` naming the fix when the log cannot be read."""
    wal = path.with_name(path.name + "-wal")
    pending = wal.exists() and wal.stat().st_size > 0
    uri = f"{path.resolve().as_uri()}?{'mode=ro' if pending else 'immutable=1'}"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=not shared)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.Error as exc:
        conn.close()
        raise StateError(
            f"the state file {_shown(path)} is on a read-only file system and its write-ahead log "
            f"{wal.name} cannot be read without writing beside it ({exc})",
            fix="copy the file and its -wal and -shm files to a writable folder and show the copy",
        ) from None
    return conn


def use_wal(conn: sqlite3.Connection) -> None:
    """Put the file in WAL mode (refusing a file that cannot be) with ``synchronous=FULL``: a commit
    is on disk when it returns and survives a power loss."""
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()
    if mode is None or str(mode[0]).lower() != "wal":
        raise sqlite3.OperationalError(f"cannot switch to WAL mode (got {mode})")
    conn.execute("PRAGMA synchronous=FULL")
