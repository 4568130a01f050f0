"""Group commit for a ledger that runs on the event loop (SQLite): one fsync for the changes of many requests.

With the SQLite ledger every booking and release was its own transaction, fsync-ed before the call returned:
two fsyncs per create + delete pair, each 0.3 ms of CPU and about a millisecond of wall time on the 2-core
development VM, with the event loop stopped meanwhile. ``GroupCommit`` turns on the ledger's group commit
(``SqliteLedger.group_commit``) for the loop's thread: a change leaves the ledger's transaction open, the
changes of every request the loop runs before its next turn join it, and one ``flush`` scheduled with
``call_soon`` commits them all with one fsync.

What a client is told stays what is on disk: the app (``app.durable_send``) holds every HTTP answer's
start until the group open at that moment (``pending``) has committed (a change always happens before the
answer that reports it, so that group holds it). When the commit fails, SQLite rolls the whole group back:
each held answer is replaced by ``503 {"error": "state unavailable"}`` (the client retries; a booking it was
about to be told of does not exist), and the replica resyncs from the ledger before its next decision
(``commit_lost``). While no group is open, answers go out at once.

Only the loop's own thread defers; a call from another thread commits the group with its own change before
it returns. ``close`` commits the open group.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from toposched.errors import StateError
from toposched.ledger.sqlite import GroupHooks, SqliteLedger

log = logging.getLogger("toposched.service")


class Replica(Protocol):
    def commit_lost(self, error: StateError) -> None: ...


class GroupCommit:
    """The event loop's side of the ledger's group commit: schedules ``flush``, holds answers until it."""

    def __init__(self, ledger: SqliteLedger, replica: Replica, loop: asyncio.AbstractEventLoop) -> None:
        self.ledger = ledger
        self.replica = replica
        self.loop = loop
        self.pending: asyncio.Future[StateError | None] | None = None
        """Settles with the open group (None: committed; else the error): what answers wait for."""
        self.groups = 0
        """Groups committed or lost (the changes per group: ledger changes / groups)."""

    def start(self) -> None:
        """Group commit on for this (the loop's) thread."""
        self.ledger.group_commit(GroupHooks(opened=self._opened, settled=self._settled))

    def stop(self) -> None:
        """Group commit off: the open group is committed first."""
        self.ledger.group_commit(None)

    def _opened(self) -> None:
        if self.pending is None:
            self.pending = self.loop.create_future()
        self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        try:
            self.ledger.flush()
        except StateError:
            pass  # ``_settled`` has it: the answers waiting on the group get a 503
        except Exception:
            log.exception("group commit failed")

    def _settled(self, error: StateError | None) -> None:
        # called with the ledger's lock held, as ``_opened`` is: this group's future is ``pending`` now
        pending, self.pending = self.pending, None
        if self.loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            running = False
        if running:
            self._settle(pending, error)
        else:  # ``close`` or a change from another thread committed the group
            self.loop.call_soon_threadsafe(self._settle, pending, error)

    def _settle(self, pending: asyncio.Future[StateError | None] | None, error: StateError | None) -> None:
        self.groups += 1
        if error is not None:
            log.error("a group of ledger changes was not committed and is undone: %s", error.message)
            self.replica.commit_lost(error)
        if pending is not None and not pending.done():
            pending.set_result(error)
