"""What every part of a replica works on: its configuration, scheduler, ledger, instances, queue and counters.

``ServiceState`` (``state.py``) is assembled from one class per job, each in its own module and each a
subclass of ``ReplicaCore``:

    ReplicaCore   replica.py     the shared state below, ``call``, ``scheduler`` and ``ledger``
    Following     following.py   follow the ledger and the stored DomainMap (resync, sweep, refresh)
    Deciding      deciding.py    decide and retry, all or none; find, renew and release placements
    Admission     admission.py   the fair admission queue: enqueue, cancel, drain, its view
    Reporting     views.py       sidecar reports, the stats snapshot and the topology view
    ServiceState  state.py       open and close, the background sync

Every call that touches the ledger runs on one thread: the event loop's for a local ledger (SQLite, memory:
each call takes well under a millisecond, and a hop to another thread costs more than the call), the
state's worker thread for etcd (a call waits on the network; the loop keeps answering meanwhile). SQLite
connections belong to the thread that opened them, and the scheduler's index is single-threaded anyway;
readers on other threads take ``lock``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from toposched.errors import StateError
from toposched.perf.profile import set_thread_profile, use_profile
from toposched.service.config import ServiceConfig
from toposched.service.defrag import HeadPlan
from toposched.service.ledger_guard import GuardedLedger
from toposched.service.records import InstanceTable, ServiceScheduler
from toposched.solver.defrag import DefragLimiter
from toposched.solver.queue import FairQueue
from toposched.topology.sources import SourceRef
from toposched.topology.store import StoredTopology

if TYPE_CHECKING:
    from toposched.service.admission import Waiting
    from toposched.topology.store import DomainMapStore

OWNER_PREFIX = "toposched-service"
log = logging.getLogger("toposched.service")
P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class Counters:
    """What this replica did, for the metrics (per replica: other replicas count their own)."""

    decisions: Counter[str] = field(default_factory=Counter)
    placed_total: int = 0
    reports_total: int = 0
    drift_reports: int = 0
    migrations_proposed: int = 0
    resyncs: int = 0
    ledger_refusals: int = 0
    sync_failures: int = 0


def replica_name(config: ServiceConfig) -> str:
    return config.replica or f"{socket.gethostname()}-{os.getpid()}"


class ReplicaCore:
    """The state one replica's jobs share. The constructor does no I/O (``ServiceState.open`` does)."""

    def __init__(
        self,
        config: ServiceConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        ledger_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.ledger_clock = ledger_clock
        self.owner = f"{OWNER_PREFIX}/{replica_name(config)}"
        self.lock = threading.RLock()
        # a worker thread starts with an empty context: its initializer gives it the service's profile
        self.worker = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="toposched-state",
            initializer=set_thread_profile,
            initargs=(config.profile,),
        )
        self.inline = config.state.partition(":")[0] in ("sqlite", "memory")
        """Run on the caller's thread (the event loop) instead of ``worker``."""
        self.queue = FairQueue()
        self.waiting: dict[str, Waiting] = {}
        self.instances = InstanceTable()
        self.counters = Counters()
        self.clock = clock
        self.ready = False
        self.last_error: str | None = None
        """Why the last background sync failed (None once one works): /readyz answers 503 with it."""
        self.stranded: dict[str, str] = {}
        """Request id -> body key of failed requests whose release failed too (released at the next sync)."""
        self._sweep_error: Exception | None = None
        self._failed_syncs = 0
        self._logged: tuple[str, str] | None = None
        self._scheduler: ServiceScheduler | None = None
        self._guard: GuardedLedger | None = None
        self._store: DomainMapStore | None = None
        self.topology: StoredTopology | None = None
        self.source: SourceRef | None = config.source
        self._seq = 0
        """Position in the ledger's audit log up to which this replica's view is up to date."""
        self._state_checked_at = float("-inf")
        """``clock`` time of the last full check of the state file (``ServiceState._check_state``)."""
        self._next_resync = 0.0
        """``clock`` time of the background's next full resync (the safety net; ``Following.resync_due``)."""
        self._stale_at: float | None = None
        """Ledger time after which the oldest incomplete request the last full read found turns stale."""
        self.defrag_limiter = DefragLimiter(config.defrag_moves_per_window, config.defrag_window_s)
        self.head_plan: HeadPlan | None = None
        """The queue head's defragmentation plan, recomputed at most every ``defrag_plan_interval_s``."""

    def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run ``fn`` where the state lives and wait for it (for callers outside the event loop)."""
        if self.inline:
            with use_profile(self.config.profile):
                return fn(*args, **kwargs)
        return self.worker.submit(fn, *args, **kwargs).result()

    @property
    def scheduler(self) -> ServiceScheduler:
        if self._scheduler is None:
            raise StateError("the service is not ready yet (state not loaded)")
        return self._scheduler

    @property
    def ledger(self) -> GuardedLedger:
        if self._guard is None:
            raise StateError("the service is not ready yet (state not loaded)")
        return self._guard

    def new_id(self) -> str:
        return uuid.uuid4().hex[:16]

    def drain_after(self, what: str) -> None:
        """``drain`` after a change that already happened (a release, a request queued): a failure to serve
        the queue then is logged, not raised, so the change's caller gets its own answer; the background sync
        serves the queue again within ``follow_interval_s``."""
        try:
            self.drain()
        except Exception:
            log.warning("serving the admission queue after %s failed; the next background sync retries", what,
                        exc_info=True)  # fmt: skip

    def drain(self) -> None:
        """Serve what waits for capacity, after GPUs were freed (``Admission.drain``; nothing waits here)."""
