"""The simulator's entities: ``Unit`` (one logical model instance of a deployment, with its lifetime
and request stream) and ``SimInstance`` (one placed copy of a unit: a booking in the ledger and a
continuous-batching engine, ``sim/batching.py``; a unit has two copies while a defragmentation move
runs). Requests are ``SimRequest`` (``sim/workload.py``)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from toposched.sim.admission import MoveRun
from toposched.sim.batching import Batcher
from toposched.sim.deployment import Deployment
from toposched.solver.request import Placement, PlacementRequest


@dataclass(eq=False)
class Unit:
    """One logical instance of a deployment: arrives, is placed (perhaps again), serves, departs."""

    id: int
    deployment: Deployment
    lifetime_s: float
    arrival_s: float
    state: str = "new"  # pending | active | draining | done | abandoned | unplaced
    copy: SimInstance | None = None  # the copy that serves (or will, once up)
    copies: set[SimInstance] = field(default_factory=set)  # booked copies (two while a move runs)
    departs_at: float = math.inf
    up_since: float = -1.0
    attempts: int = 0
    waits: int = 0  # times it has waited for placement (stale timers check it)
    pending_since: float = 0.0
    cross_ok: bool = False
    headroom_waived: bool = False  # placed without ``keep_whole_domains`` (its wait for room is over)
    held_headroom: bool = False  # has waited because of the headroom
    waited_nvlink: bool = False
    placed: bool = False
    placed_s: float = -1.0  # first booked
    stream: random.Random | None = None
    stream_version: int = 0
    ready_s: float = 0.0
    """Churn: when the tenant's demand starts (arrival + start-up: when an instance placed at once
    would serve) and its lifetime starts counting; waiting for GPUs does not move it."""
    demand: bool = False  # the demand window (requests, departure) has been scheduled

    def next_id(self) -> str:
        self.attempts += 1
        return f"{self.deployment.tenant.name}.{self.id}-{self.attempts}"


@dataclass(eq=False)
class SimInstance:
    """One placed copy: its booking, its batching engine and where it is in its life."""

    placement: Placement
    request: PlacementRequest
    unit: Unit
    batcher: Batcher
    in_domain: bool
    state: str = "starting"  # starting | up | draining | gone
    version: int = 0
    move: MoveRun | None = None

    @property
    def id(self) -> str:
        return self.placement.id

    @property
    def gpus(self) -> int:
        return len(self.placement.ranks)
