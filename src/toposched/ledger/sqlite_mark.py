"""``FILE-commits``: the SQLite ledger's id and how many commits it has acknowledged, next to the file.

A file holding fewer commits than its mark lost some (a damaged last WAL frame, a cut or deleted
``-wal``, an older copy put back); ``toposched.ledger.sqlite.SqliteLedger`` refuses to serve it.

The mark is written after every commit through a descriptor kept open (one ``pwrite`` of a line of
fixed length, not an open, write, truncate and close: 59 µs of CPU per change then, 12 µs now, in
process on a loaded 2-core VM); it is not fsync-ed (it only has to be no further ahead than the file).
A mark removed while the ledger is open is written again when the ledger next connects.
"""

from __future__ import annotations

import logging
import os
import zlib
from contextlib import suppress
from pathlib import Path

log = logging.getLogger(__name__)


class CommitMark:
    """The ``FILE-commits`` of one ledger file: ``read`` it at open, ``write`` it after each commit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        """The mark, open for writing (``write``); None: opened at the next write."""
        self._pid = 0
        """The process that opened ``_fd`` (a descriptor inherited by a fork is only forgotten)."""
        self._len = -1
        """The length of the line last written through ``_fd`` (-1: truncate at the next write)."""
        self._ino = -1
        """The inode ``_fd`` writes: another at the path (deleted, replaced) makes it open that one."""

    def read(self) -> tuple[str, int] | None:
        """(ledger id, commits); None when missing or unreadable (then unchecked)."""
        try:
            with self.path.open("rb") as file:
                words = file.read(128).decode("ascii").split()
        except (OSError, UnicodeDecodeError):
            return None
        if len(words) != 4 or words[0] != "toposched-ledger-commits" or not words[2].isdigit():
            return None
        if f"{zlib.crc32(' '.join(words[:3]).encode()):08x}" != words[3]:
            return None  # a torn write: a power loss while it was written
        return words[1], int(words[2])

    def write(self, ledger_id: str, commits: int) -> None:
        """Written after the commit it counts (and never before), so it is never ahead of the file;
        concurrent writers may leave it a commit or two behind, which only weakens the check."""
        body = f"toposched-ledger-commits {ledger_id} {commits:020d}"
        line = f"{body} {zlib.crc32(body.encode()):08x}\n".encode()
        try:
            if self._fd is not None and (self._pid != os.getpid() or os.stat(self.path).st_ino != self._ino):
                self.close()  # deleted or replaced since, or inherited: write the one at the path
        except OSError:
            self.close()
        try:
            if self._fd is None:
                self._fd, self._len = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644), -1
                self._pid, self._ino = os.getpid(), os.fstat(self._fd).st_ino
            os.pwrite(self._fd, line, 0)
            if len(line) != self._len:  # the line's length is fixed for one ledger id
                os.ftruncate(self._fd, len(line))
                self._len = len(line)
        except OSError as exc:
            self.close()  # opened again at the next commit
            log.warning("cannot record the commit count in %s: %s", self.path, exc)

    def close(self) -> None:
        """Close the descriptor (one inherited from another process is only forgotten)."""
        fd, self._fd, self._len = self._fd, None, -1
        if fd is not None and self._pid == os.getpid():
            with suppress(OSError):
                os.close(fd)
