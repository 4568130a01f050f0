"""Checks on a SQLite ledger file: before SQLite touches it, and of its content (``check_open``).

``wal_damage`` reads the ``-wal`` file frame by frame with SQLite's own checksum rule: SQLite replays a
WAL only up to the first frame that fails its checksum and silently drops every later commit, so the
ledger refuses instead. (Whether the user may write the file's folder is ``toposched.sqlite_file``'s
``access_problem``, shared with the DomainMap store.)

The checks of the ledger file (``ledger/sqlite.py``): the first use in a process opens the file and refuses
(``StateError`` naming the file, what is wrong and the fix) to serve a ledger that differs from what was
committed:

1. the ``-wal`` file is read before SQLite sees it (``wal_damage``): SQLite replays it up to the
   first frame that fails its checksum and silently drops every later commit;
2. ``PRAGMA integrity_check`` of the whole file: pages, the free-page list, every index against its table;
3. every row's checksum, each reservation against its ``ledger_holds`` rows, audit seqs without gaps;
4. the commit count in ``ledger_meta`` against ``FILE-commits``, written after every commit: a
   file holding fewer commits than that lost some (a damaged last WAL frame, a cut or deleted
   ``-wal``, an older copy put back).
"""

from __future__ import annotations

import sqlite3
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

_M32 = 0xFFFFFFFF
_WAL_MAGIC = 0x377F0682  # | 1 when the checksum words are big-endian
_WAL_VERSION = 3007000


def _wal_sum(words: Sequence[int]) -> tuple[int, int]:
    """SQLite's WAL checksum of 32-bit ``words`` from a zero seed."""
    s0 = s1 = 0
    pairs = iter(words)
    for x0, x1 in zip(pairs, pairs, strict=True):
        s0 += x0 + s1
        s1 += x1 + s0
        if s1 >> 60:  # reduce mod 2**32 only now and then: a quarter faster than on every step
            s0, s1 = s0 & _M32, s1 & _M32
    return s0 & _M32, s1 & _M32


def _wal_seeded(pairs: int) -> Callable[[tuple[int, int], tuple[int, int]], tuple[int, int]]:
    """The checksum is affine in its seed: sum(seed) = M**pairs @ seed + sum(0), M = [[1, 1], [1, 2]]."""
    a, b, c, d = 1, 0, 0, 1
    for _ in range(pairs):
        a, b, c, d = (a + c) & _M32, (b + d) & _M32, (a + 2 * c) & _M32, (b + 2 * d) & _M32

    def seeded(seed: tuple[int, int], zero: tuple[int, int]) -> tuple[int, int]:
        return (a * seed[0] + b * seed[1] + zero[0]) & _M32, (c * seed[0] + d * seed[1] + zero[1]) & _M32

    return seeded


def wal_damage(wal: Path, page_size: int | None) -> str | None:
    """Why SQLite would silently drop committed transactions of this ``-wal`` file, or None.

    SQLite replays a WAL from its header up to the first frame whose salts or checksum do not match
    and ignores the rest. A frame's checksum chains from the one stored in the frame before, so each
    frame can also be checked on its own (from its predecessor's stored or recomputed checksum): a
    genuine commit frame that SQLite would not replay is a committed transaction it would lose.
    Undetectable here: damage to the last commit frame itself (``FILE-commits`` catches that).
    """
    try:
        file = wal.open("rb")
    except OSError:  # none (the usual case) or unreadable (SQLite then fails with its own error)
        return None
    with file:
        head = file.read(32)
        if len(head) < 32:
            return None
        magic, version, size, _, salt1, salt2, h0, h1 = struct.unpack(">8I", head)
        order = ">" if magic & 1 else "<"
        size_ok = 512 <= size <= 65536 and size & (size - 1) == 0
        page = size if size_ok else page_size
        if not page:
            return None
        header_sum = _wal_sum(struct.unpack(order + "6I", head[:24]))
        header_ok = magic | 1 == _WAL_MAGIC | 1 and version == _WAL_VERSION and size_ok and header_sum == (h0, h1)
        seeded = _wal_seeded((8 + page) // 8)
        salts = (salt1, salt2) if header_ok else None  # a damaged header: frame 1's salts are the log's
        chain: tuple[int, int] | None = (h0, h1) if header_ok else None  # SQLite's running checksum
        replayed = 0  # frames SQLite replays: up to its last commit frame before the first bad one
        first_bad: int | None = None
        prev_stored, prev_computed = (h0, h1), header_sum
        lost = index = 0
        while len(frame_head := file.read(24)) == 24 and len(data := file.read(page)) == page:
            pgno, commit, fsalt1, fsalt2, k0, k1 = struct.unpack(">6I", frame_head)
            zero = _wal_sum(struct.unpack(f"{order}{2 + page // 4}I", frame_head[:8] + data))
            salts = salts or (fsalt1, fsalt2)
            stored = (k0, k1)
            fits = pgno != 0 and (fsalt1, fsalt2) == salts
            if chain is not None:
                if fits and seeded(chain, zero) == stored:
                    chain = stored
                    replayed = index + 1 if commit else replayed
                else:
                    chain, first_bad = None, index
            genuine = fits and stored in (seeded(prev_stored, zero), seeded(prev_computed, zero))
            if genuine and commit and chain is None:
                lost += 1
            prev_computed, prev_stored = seeded(prev_stored, zero), stored
            index += 1
    if not lost:
        return None
    if first_bad is None:
        return f"the header of {wal.name} is damaged, so SQLite would ignore the file: {lost} committed transaction(s)"
    return (
        f"frame {first_bad + 1} of {wal.name} (byte {32 + first_bad * (24 + page)}) fails its checksum, so SQLite "
        f"would silently drop the {lost} committed transaction(s) after it"
    )


def ledger_wal_damage(path: Path) -> str | None:
    """``wal_damage`` of the ledger file ``path``'s ``-wal`` file (with the page size its header gives),
    asked twice before answering: a writer appending while it is read can make a frame look bad once,
    not at the same place twice in a row."""
    try:
        with path.open("rb") as db:
            raw = db.read(18)
    except OSError:
        raw = b""
    page_size = int.from_bytes(raw[16:18], "big") if len(raw) == 18 else 0
    page = 65536 if page_size == 1 else page_size or None
    wal = path.with_name(path.name + "-wal")
    problem = wal_damage(wal, page)
    return problem if problem is None or wal_damage(wal, page) == problem else None


def check_open(conn: sqlite3.Connection, path: Path, busy_timeout_s: float) -> None:
    """The checks a new connection runs (``integrity_check`` of the whole file, every ledger row against its
    checksum, holds against reservations, audit seqs), on an open one: ``StateError`` naming the damage."""
    from toposched.ledger.sqlite_rows import Damaged, damage_error, sqlite_error, verify

    try:
        check = conn.execute("PRAGMA integrity_check").fetchall()
        if [tuple(row) for row in check] != [("ok",)]:
            raise Damaged(f"integrity_check: {check[0][0] if check else 'no answer'}")
        conn.execute("BEGIN")
        try:
            verify(conn)
        finally:
            conn.execute("COMMIT")
    except sqlite3.Error as exc:
        raise sqlite_error(path, exc, busy_timeout_s) from exc
    except Damaged as exc:
        raise damage_error(path, str(exc)) from exc
