"""Defragmentation in the service: the queue head's plan, POST /v1/defrag and POST /v1/defrag/finish.

The plans come from ``solver/defrag.py``. The service never runs a plan on its own: it cannot restart
engines. It shows the admission queue's head a plan when the head's TP group finds no room
(``plan_head``, in the queue view), books the replacements when an operator asks (``defrag`` with
``dry_run`` false; all or none, rate-limited by ``DefragLimiter``, each move counted as a migration),
and releases an old copy once its new engine is up and the old one drained (``finish``).

Each function takes the replica (``ServiceState``) and runs where the state lives, under its lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from toposched.errors import InputError, LedgerConflict, StateError
from toposched.solver.defrag import (
    MOVED_FROM,
    DefragPlan,
    Move,
    defrag_need,
    finish_move,
    room_for,
    search_defrag,
    start_move,
)
from toposched.solver.queueline import QueuedItem
from toposched.solver.request import PlacementRequest

log = logging.getLogger("toposched.service")

if TYPE_CHECKING:
    from toposched.service.admission import Waiting
    from toposched.service.following import Following
    from toposched.service.records import Instance
    from toposched.service.replica import ReplicaCore


@dataclass(frozen=True)
class HeadPlan:
    """The defragmentation plan computed for the queue's head (shown in the queue view, never run)."""

    item_id: str
    at: float
    need_gpus: int
    level: str
    plan: DefragPlan | None
    reason: str

    def to_json(self, now: float) -> dict[str, Any]:
        empty: dict[str, Any] = {"group": None, "frees": [], "moves": [], "gpus_moved": 0}
        plan = self.plan.to_json() if self.plan is not None else empty
        return {
            "need_gpus": self.need_gpus,
            "level": self.level,
            **plan,
            "reason": self.reason or None,
            "planned_s_ago": round(now - self.at, 3),
        }


@dataclass(frozen=True)
class DefragAnswer:
    """What POST /v1/defrag answers: a plan (booked or not), or why not."""

    status: Literal["planned", "booked", "no-plan", "limited", "conflict"]
    need_gpus: int = 0
    level: str = ""
    plan: DefragPlan | None = None
    reason: str = ""
    retry_after_s: float = 0.0


@dataclass(frozen=True)
class FinishAnswer:
    """What POST /v1/defrag/finish answers."""

    status: Literal["released", "not-found", "not-a-move"]
    released: tuple[str, ...] = ()
    reason: str = ""


def plan_head(state: ReplicaCore, head: QueuedItem, waiting: Waiting) -> None:
    """A plan for a head whose TP group finds no room, at most every ``defrag_plan_interval_s``.

    Only the head gets one (it is the next to be served, and the queue lets nothing overtake it). It is
    shown in the queue view and counted (``defrag-plan``); booking it is an operator's call (POST
    /v1/defrag with ``dry_run: false``), since the engines must be restarted by whoever runs them.
    """
    now = state.clock()
    seen = state.head_plan
    if seen is not None and seen.item_id == head.item_id and now - seen.at < state.config.defrag_plan_interval_s:
        return
    state.head_plan = None
    try:
        need, level = max(defrag_need(state.scheduler, r) for r, _n in waiting.body.roles(waiting.request_id))
    except InputError:
        return
    if level not in ("nvlink", "node") or room_for(state.scheduler, need, level):
        return  # its TP group has room: it waits for something else (budget, replicas, SLO)
    plan, why = search_defrag(state.scheduler, need, level=level, max_moves=state.config.defrag_max_moves)
    state.head_plan = HeadPlan(head.item_id, now, need, level, plan, why)
    if plan is not None and plan.moves:
        state.counters.decisions["defrag-plan"] += 1


def defrag(
    state: Following,
    *,
    need_gpus: int | None = None,
    request: PlacementRequest | None = None,
    level: Literal["nvlink", "node"] | None = None,
    max_moves: int = 4,
    dry_run: bool = True,
) -> DefragAnswer:
    """Plan the fewest moves that make room; unless ``dry_run``, book the replacements (all or none).

    Room for ``need_gpus`` free GPUs in one group at ``level`` (default nvlink), or for the TP group of
    ``request`` (its level unless ``level`` is given): exactly one of the two.

    Booking is rate-limited (``defrag_moves_per_window`` per ``defrag_window_s``) and each booked move
    counts as a migration. The old copies stay booked until ``finish``.
    """
    with state.lock:
        state.follow()
        scheduler = state.scheduler
        if (need_gpus is None) == (request is None):
            raise InputError("defrag: give need_gpus or a request to make room for (one of them)")
        if request is not None:
            need, needed_level = defrag_need(scheduler, request)
            group = level or needed_level
        else:
            assert need_gpus is not None
            need, group = need_gpus, level or "nvlink"
        if group not in ("nvlink", "node"):
            return DefragAnswer("no-plan", need, group, reason=f"a TP group of {need} GPUs needs level {group}")
        max_moves = min(max_moves, state.config.defrag_max_moves)
        plan, why = search_defrag(scheduler, need, level=group, max_moves=max_moves)
        if plan is None:
            return DefragAnswer("no-plan", need, group, reason=why)
        if plan.moves:
            state.counters.decisions["defrag-plan"] += 1
        if dry_run or not plan.moves:
            return DefragAnswer("planned", need, group, plan)
        now = state.clock()
        limiter = state.defrag_limiter
        if not limiter.allow(now, len(plan.moves)):
            config = state.config
            reason = (
                f"{len(plan.moves)} move(s) would pass the limit of {config.defrag_moves_per_window} "
                f"per {config.defrag_window_s:g} s"
            )
            return DefragAnswer(
                "limited", need, group, plan, reason, retry_after_s=limiter.retry_after(now, len(plan.moves))
            )
        booked: list[Move] = []
        try:
            for move in plan.moves:
                ttl = lease_of(state.instances.get(move.placement_id))
                start_move(scheduler, move, ttl_s=ttl, owner=state.owner, meta={"owner": state.owner})
                state.ledger.booked.pop(move.replacement_id, None)
                booked.append(move)
        except BaseException as exc:  # all or none: whatever failed, no replacement stays booked
            failed = plan.moves[len(booked)] if len(booked) < len(plan.moves) else None
            unbook(state, booked, failed if not isinstance(exc, LedgerConflict) else None)
            if not isinstance(exc, LedgerConflict | StateError):
                raise
            state.counters.ledger_refusals += isinstance(exc, LedgerConflict)
            state.resync()
            return DefragAnswer("conflict", need, group, plan, f"{exc.message}; nothing was booked")
        limiter.record(now, len(booked))
        state.counters.migrations_proposed += len(booked)
        state.counters.decisions["defrag-move"] += len(booked)
        state.resync()
        return DefragAnswer("booked", need, group, plan)


def unbook(state: Following, moves: list[Move], failed: Move | None = None) -> None:
    """Release the replacements of ``moves``, and ``failed``'s when the ledger holds it as this replica's copy
    of that instance (the failure came after the ledger booked it). When a release fails too, the error goes
    to the log and the copy stays until its lease ends or the operator releases it."""
    for move in [*moves, *([failed] if failed is not None else [])]:
        state.ledger.booked.pop(move.replacement_id, None)
        try:
            if move is failed:
                held = state.ledger.get(move.replacement_id)
                if held is None or held.owner != state.owner or held.meta.get(MOVED_FROM) != move.placement_id:
                    continue  # not booked, or another's: not ours to release
            if not state.scheduler.release(move.replacement_id):
                state.ledger.release(move.replacement_id)
        except Exception:
            log.warning("defrag: could not release replacement %s after a failed booking", move.replacement_id)


def finish(state: Following, placement_id: str, replacement_id: str) -> FinishAnswer:
    """Release a moved instance's old copy once its replacement is booked.

    ``not-found`` when neither copy is known; ``not-a-move`` when the replacement is not a booked copy of
    that instance (nothing is released); ``released`` lists the old copy, or nothing when it was gone
    already. Frees GPUs, so the queue is served after.
    """
    with state.lock:
        state.follow()
        old, new = state.instances.get(placement_id), state.instances.get(replacement_id)
        if old is None and new is None:
            state.resync()
            old, new = state.instances.get(placement_id), state.instances.get(replacement_id)
        if old is None and new is None:
            return FinishAnswer("not-found", reason=f"no placement {placement_id} or {replacement_id}")
        if new is None or new.moved_from != placement_id:
            return FinishAnswer("not-a-move", reason=f"{replacement_id} is not a booked replacement of {placement_id}")
        if old is None:
            return FinishAnswer("released")
        move = Move(placement_id, replacement_id, old.placement.gpu_refs, new.placement.gpu_refs)
        finish_move(state.scheduler, move)
        state.instances.pop(placement_id, None)
    state.drain()
    return FinishAnswer("released", (placement_id,))


def lease_of(instance: Instance | None) -> float | None:
    """The lease (``ttl_s``) the instance's request asked for, given to the copy a move books; None: none."""
    ttl = instance.body.get("ttl_s") if instance is not None else None
    return float(ttl) if isinstance(ttl, int | float) and ttl > 0 else None
