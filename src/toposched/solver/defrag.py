"""Defragmentation by migration: the fewest moves of small instances that free room for a large one.

On a busy cluster free GPUs end up scattered: 8 free GPUs in all, but no NVLink domain with 8 free, so
a TP=8 instance waits. ``plan_defrag`` finds the NVLink domain (or node, with ``level="node"``) that
can be given ``need_gpus`` free GPUs with the fewest moves, then the fewest GPUs moved, and says where
each instance in the way goes:

* a replacement keeps the instance's degrees, its per-GPU HBM, its GPU type, its affinity level and
  the link between its TP ranks (so its predicted latency holds); it is never put inside the group
  being freed, and it goes into a partly used group before a wholly free one (``keeping_whole``), so
  a move breaks a whole free domain only when there is no other room;
* the search moves 1, then 2, ... up to ``max_moves`` instances; for each count it tries the subsets
  of every candidate group's occupants that free enough GPUs, fewest GPUs moved first (groups with
  more free GPUs need fewer moves, so they come first). For each subset it re-places the instances
  one by one on the index (``find_stages``, ``pick_in_group``), as trials that are undone afterwards,
  so ``plan_defrag`` decides without booking and leaves the scheduler exactly as it found it;
* work is bounded: at most ``MAX_SUBSETS_PER_GROUP`` subsets per group and move count, and
  ``MAX_TRIALS`` re-placement trials per plan.

Not moved: instances with pipeline stages (pp > 1), instances whose GPUs are not all inside the
group (a cross-domain fallback, a blind policy's spread), instances already moving (a replacement
booked and the old copy still held), and those ``movable`` refuses. GPUs that no tracked placement
holds but are not free (failed, booked by something else) cannot be freed. An instance of a
disaggregated deployment (its placement has a ``role``) moves only within its rack (its node, when the
node has no rack), so a decode instance stays near its prefill instance and a prefill instance near its
decode instances at the level ``solver/pd.py`` paired them; its replacement gets the KV NICs and host
NUMA nodes of its new GPUs.

Executing a move (``start_move`` then ``finish_move``): the replacement is booked first, under
``Move.replacement_id``, while the old copy keeps serving (the ledger holds both); once the new engine
is up and the old one drained, ``finish_move`` releases the old copy. toposched cannot restart
engines: the service and the CLI book and report; the simulator models the start-up and drain.
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from toposched.errors import InfeasibleError, InputError, LedgerConflict, StateError
from toposched.ledger.base import GpuAccount
from toposched.names import placement_id_problem
from toposched.solver.index import LEVELS, Group
from toposched.solver.pd import with_role
from toposched.solver.place import stage_links
from toposched.solver.request import ConstraintCheck, Placement, PlacementRequest, Rank
from toposched.solver.scheduler import Scheduler
from toposched.solver.stages import find_stages

MAX_SUBSETS_PER_GROUP = 2000
"""Subsets of occupants tried per group and move count (a 72-GPU NVL72 domain full of TP=1 instances
has C(72, 4) = 1 million subsets of four)."""
MAX_TRIALS = 256
"""Re-placement trials (subsets whose instances are placed elsewhere on the index) per plan."""
MOVED_FROM = "moved_from"
"""Booking record key of a replacement: the id of the copy it replaces."""
INSTANCE = "instance"
"""Booking record key: the instance's original id (a replacement serves the same instance)."""

_SUFFIX = re.compile(r"\.m(\d+)$")


@dataclass(frozen=True)
class Move:
    placement_id: str
    """The instance moved."""
    replacement_id: str
    """The id its new copy is booked under while both are held (a valid placement id)."""
    from_gpus: tuple[str, ...]
    to_gpus: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "placement_id": self.placement_id,
            "replacement_id": self.replacement_id,
            "from_gpus": list(self.from_gpus),
            "to_gpus": list(self.to_gpus),
        }


@dataclass(frozen=True)
class DefragPlan:
    group: str
    """The NVLink domain (DomainMap id) or node freed."""
    frees: tuple[str, ...]
    """Its GPUs that are free once the moves finish (at least ``need_gpus`` of them)."""
    moves: tuple[Move, ...]
    """In the order to start them; fewest moves, then fewest GPUs moved. Empty: there is room already."""
    gpus_moved: int

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "frees": list(self.frees),
            "moves": [m.to_json() for m in self.moves],
            "gpus_moved": self.gpus_moved,
        }


def plan_defrag(
    scheduler: Scheduler,
    need_gpus: int,
    *,
    level: str = "nvlink",
    max_moves: int = 4,
    movable: Callable[[Placement], bool] | None = None,
    exclude: Collection[str] = (),
) -> DefragPlan | None:
    """The fewest moves that leave ``need_gpus`` free GPUs in one group of ``level``; None if none.

    ``exclude``: group ids (NVLink domain or node names) not to free, e.g. one being freed already.
    A plan without moves means a group has the room already. Pure: books nothing, and the index,
    placements and cross-domain budget are as they were (``search_defrag`` also says why not).
    """
    plan, _why = search_defrag(scheduler, need_gpus, level=level, max_moves=max_moves, movable=movable, exclude=exclude)
    return plan


def search_defrag(
    scheduler: Scheduler,
    need_gpus: int,
    *,
    level: str = "nvlink",
    max_moves: int = 4,
    movable: Callable[[Placement], bool] | None = None,
    exclude: Collection[str] = (),
    progress: Callable[[str], None] | None = None,
) -> tuple[DefragPlan | None, str]:
    """``plan_defrag`` and, when there is no plan, one line saying why ('' with a plan); ``progress``: a line per
    move count tried."""
    if level not in LEVELS or level == "none":
        valid = ", ".join(lv for lv in LEVELS if lv != "none")
        raise InputError(f"defrag level {level!r} is not one of {valid}")
    if need_gpus < 1:
        raise InputError(f"need_gpus must be at least 1 (got {need_gpus})")
    if max_moves < 0:
        raise InputError(f"max_moves must not be negative (got {max_moves})")
    index = scheduler.index
    lvl = index.levels[level]
    skip = set(exclude)
    groups = [g for g in range(len(lvl.groups)) if lvl.size[g] >= need_gpus and lvl.groups[g].id not in skip]
    if not groups:
        return (
            None,
            f"no {level} group{' left' if skip else ''} holds {need_gpus} GPUs (the largest holds {lvl.max_size})",
        )
    for g in lvl.best_fit(need_gpus):  # room already: the tightest such group
        if lvl.groups[g].id not in skip:
            group = lvl.groups[g]
            return DefragPlan(group.id, tuple(r for r in group.gpus if r in index.free), (), 0), ""
    return _Search(scheduler, need_gpus, max_moves, movable).run(lvl.groups, groups, progress or (lambda _m: None))


def defrag_need(scheduler: Scheduler, request: PlacementRequest) -> tuple[int, str]:
    """(GPUs of one TP group, level of the group it must fit in) for the request's first degree option.

    The option is the one the ``slo`` policy tries first; ``InfeasibleError`` when the model fits no
    degree here or its TP group fits no single group (then no defragmentation can help).
    """
    cands, dropped = scheduler.candidates(request)
    if not cands:
        why = "; ".join(dropped[:3]) or "no degree within the limits"
        raise InfeasibleError(f"{request.model} fits no degree on this cluster: {why}")
    tp = cands[0].option.tp
    level = scheduler.index.resolve_level(request.affinity, tp)
    if level == "none":
        raise InfeasibleError(f"{request.model} at tp={tp}: no NVLink domain or node holds {tp} GPUs")
    return tp, level


def room_for(scheduler: Scheduler, need_gpus: int, level: str) -> bool:
    """Whether some group of ``level`` has ``need_gpus`` free GPUs now."""
    return next(iter(scheduler.index.levels[level].best_fit(need_gpus)), None) is not None


class _Search:
    """One plan search: the occupants of each candidate group, subsets by move count, trials."""

    def __init__(
        self, scheduler: Scheduler, need: int, max_moves: int, movable: Callable[[Placement], bool] | None
    ) -> None:
        self.s = scheduler
        self.need = need
        self.max_moves = max_moves
        self.movable = movable or (lambda _p: True)
        self.holder = {ref: p.id for p in scheduler.placements.values() for ref in p.gpu_refs}
        live = scheduler.ledger.reservations()
        self.booked_ids = {r.id for r in live}
        self.moving: set[str] = set()
        for r in live:  # a move in flight: neither copy moves again until it finishes
            old = r.meta.get(MOVED_FROM)
            if old and old in self.booked_ids:
                self.moving.update((old, r.id))
        self._accounts: dict[str, GpuAccount] | None = None
        self.trials = 0
        self.why = {"blocked": 0, "too-many": 0, "no-room": 0, "rack": 0}
        self.home = {n.name: n.rack or f"node:{n.name}" for n in scheduler.cluster.nodes}

    def run(self, groups: list[Group], cands: list[int], say: Callable[[str], None]) -> tuple[DefragPlan | None, str]:
        index = self.s.index
        # per candidate group: GPUs still to free, and the occupants that may move, largest first
        prepared: list[tuple[int, Group, int, list[Placement]]] = []
        for order, g in enumerate(cands):
            group = groups[g]
            needed = self.need - sum(1 for r in group.gpus if r in index.free)
            occupants = sorted(self._movable_occupants(group), key=lambda p: (-len(p.ranks), p.id))
            if sum(len(p.ranks) for p in occupants) < needed:
                self.why["blocked"] += 1
            elif sum(len(p.ranks) for p in occupants[: self.max_moves]) < needed:
                self.why["too-many"] += 1
            else:
                prepared.append((order, group, needed, occupants))
        for k in range(1, self.max_moves + 1):
            options: list[tuple[int, int, Group, tuple[Placement, ...]]] = []
            for order, group, needed, occupants in prepared:
                subsets = itertools.combinations(occupants, k)
                for subset in itertools.islice(subsets, MAX_SUBSETS_PER_GROUP):
                    moved = sum(len(p.ranks) for p in subset)
                    if moved >= needed:
                        options.append((moved, order, group, subset))
            options.sort(key=lambda o: (o[0], o[1]))
            say(f"trying {k} move(s): {len(options):,} choice(s) of instances")
            for moved, _order, group, subset in options:
                if self.trials >= MAX_TRIALS:
                    return None, f"no plan within {MAX_TRIALS} re-placement trials ({self._counts()})"
                moves = self._trial(group, subset)
                if moves is not None:
                    gone = {r for m in moves for r in m.from_gpus}
                    frees = tuple(r for r in group.gpus if r in index.free or r in gone)
                    return DefragPlan(group.id, frees, moves, moved), ""
        return None, f"no group can get {self.need} free GPUs with at most {self.max_moves} move(s): {self._counts()}"

    def _counts(self) -> str:
        why = self.why
        rack = f" ({why['rack']} of a disaggregated instance, which moves only within its rack)" if why["rack"] else ""
        return (
            f"{why['blocked']} group(s) hold too few GPUs that could be freed (instances with pp > 1, spanning "
            f"groups or with a move in flight stay), {why['too-many']} need more moves, "
            f"{why['no-room']} tried move(s) found no room elsewhere{rack}"
        )

    def _movable_occupants(self, group: Group) -> list[Placement]:
        """The placements that hold GPUs of ``group`` and may move: pp = 1, every GPU inside the group and
        healthy, no move in flight, and ``movable`` agrees. The others' GPUs stay busy."""
        found: dict[str, Placement] = {}
        inside = set(group.gpus)
        failed = self.s.failed
        for ref in group.gpus:
            pid = self.holder.get(ref)
            if pid is None or pid in found or ref in self.s.index.free:
                continue
            p = self.s.placements[pid]
            refs = set(p.gpu_refs)
            if p.pp == 1 and refs <= inside and not refs & failed and pid not in self.moving and self.movable(p):
                found[pid] = p
        return list(found.values())

    def _trial(self, group: Group, subset: tuple[Placement, ...]) -> tuple[Move, ...] | None:
        """Re-place each instance of ``subset`` outside ``group`` on the index, then undo; the moves or None."""
        self.trials += 1
        index = self.s.index
        forbidden = set(group.gpus)
        taken: list[tuple[str, ...]] = []
        moves: list[Move] = []
        ids = set(self.s.placements) | self.booked_ids
        try:
            with index.keeping_whole(True):
                for p in subset:  # largest first (sorted by the caller): the hardest to place
                    targets = self._target(p, forbidden)
                    if targets is None:
                        self.why["no-room"] += 1
                        self.why["rack"] += p.role is not None
                        return None
                    index.take(targets)
                    taken.append(targets)
                    new_id = replacement_id(p.id, ids)
                    ids.add(new_id)
                    moves.append(Move(p.id, new_id, p.gpu_refs, targets))
        finally:
            for refs in taken:
                index.give(refs)
        return tuple(moves)

    def _target(self, p: Placement, forbidden: set[str]) -> tuple[str, ...] | None:
        """GPUs for one instance's replacement: same GPU type, level and link, HBM room, not in ``forbidden``.

        An instance of a disaggregated deployment (``role`` set) stays in its rack (its node, for nodes
        without one), so its pairing's ``near`` level holds, and needs an RDMA NIC on each new GPU's NUMA
        node for its KV transfers (``_remapped`` recomputes its ``kv_nics`` and ``host_numa``)."""
        s = self.s
        homes = {self.home[r.node] for r in p.ranks} if p.role is not None else None
        gpu = s.gpu_of_node[p.ranks[0].node]
        need_bytes = p.hbm_per_gpu.total
        if self._accounts is None:  # read once, and only when a trial needs it (the largest cost on big clusters)
            self._accounts = s.ledger.accounts()
        accounts = self._accounts

        def allowed(ref: str) -> bool:
            account = accounts.get(ref)
            if homes is not None and self.home[s.index.info[ref].node] not in homes:
                return False
            return ref not in forbidden and account is not None and account.free_bytes >= need_bytes

        def accept(group: Group) -> bool:
            return all(s.gpu_of_node[n].name == gpu.name for n in group.nodes)

        level = p.level if p.level in LEVELS else "none"
        found = find_stages(s.index, p.tp, 1, level, accept, allowed)
        if found is None:
            return None
        targets = tuple(found[0][0])
        link, _in_domain, _pp_link = stage_links(s.index, [list(targets)], gpu)
        if link != p.link:
            return None  # another link would change the predicted latency: not a like-for-like move
        if p.role is not None:
            try:
                _remapped(s, p, Move(p.id, p.id, p.gpu_refs, targets))
            except InputError:  # a new GPU has no RDMA NIC on its NUMA node: no KV transfer from there
                return None
        return targets


def replacement_id(placement_id: str, taken: Collection[str]) -> str:
    """The id a moved instance's new copy is booked under: ``ID.mN`` with the first N not in ``taken``.

    A copy that moves again counts on (``x.m1`` -> ``x.m2``). The result is a valid placement id; an id
    too long for a suffix is shortened first.
    """
    base = placement_id
    n = 1
    m = _SUFFIX.search(base)
    if m is not None:
        base, n = base[: m.start()], int(m.group(1)) + 1
    while True:
        candidate = f"{base}.m{n}"
        if placement_id_problem(candidate) is not None:
            candidate = f"{base[:100].rstrip('._-')}.m{n}"
        if candidate not in taken:
            return candidate
        n += 1


def _remapped(scheduler: Scheduler, old: Placement, move: Move) -> Placement:
    """The old placement on the move's GPUs: the same ranks in the same order, under the new id.

    An instance of a disaggregated deployment gets the KV NICs and host NUMA nodes of its new GPUs
    (``solver.pd.with_role``; ``InputError`` when a new GPU has no RDMA NIC on its NUMA node)."""
    index = scheduler.index
    ranks = []
    for rank, ref in zip(old.ranks, move.to_gpus, strict=True):
        info = index.info[ref]
        ranks.append(Rank(rank=rank.rank, node=info.node, gpu=info.index, stage=rank.stage, tp_rank=rank.tp_rank))
    level = index.tightest_level(move.to_gpus)
    constraints = tuple(
        ConstraintCheck(name=c.name, held=c.held, detail=c.detail.replace(f"level {old.level}", f"level {level}", 1))
        if c.name == "domain-affinity"
        else c
        for c in old.constraints
    )
    new = old.model_copy(
        update={
            "id": move.replacement_id,
            "ranks": tuple(ranks),
            "level": level,
            "stage_domains": (index.domain_of(move.to_gpus),),
            "constraints": constraints,
        }
    )
    if old.role is None:
        return new
    nodes = {n.name: n for n in scheduler.cluster.nodes}
    return with_role(new, old.role, old.request_id, nodes, index.dmap)


def start_move(
    scheduler: Scheduler,
    move: Move,
    *,
    ttl_s: float | None = None,
    owner: str | None = None,
    meta: dict[str, str] | None = None,
) -> Placement:
    """Book the move's replacement (the ledger holds both copies until ``finish_move``); returns it.

    The booking's record is the old booking's (request, owner, ...) with the new placement, ``moved_from``
    (the old id) and ``instance`` (the instance's original id), then ``meta``; its owner is ``owner`` or
    the old booking's. ``LedgerConflict`` when the ledger refuses (nothing is left booked); ``StateError``
    when the plan is stale (the instance moved or went, or a target GPU is no longer free). Starting the
    same move twice returns the booked replacement.
    """
    old = scheduler.placements.get(move.placement_id)
    existing = scheduler.placements.get(move.replacement_id)
    if existing is not None:
        if existing.gpu_refs != move.to_gpus:
            raise StateError(f"{move.replacement_id} is already placed on other GPUs", fix="plan again")
        return existing
    if old is None:
        raise StateError(f"placement {move.placement_id} is not held (released, or moved)", fix="plan again")
    problem = placement_id_problem(move.replacement_id)
    if problem:
        raise InputError(f"replacement id: {problem}")
    if old.gpu_refs != move.from_gpus:
        raise StateError(f"placement {old.id} is no longer on {', '.join(move.from_gpus)}", fix="plan again")
    if len(move.to_gpus) != len(old.ranks) or len(set(move.to_gpus)) != len(move.to_gpus):
        raise InputError(f"move of {old.id}: {len(old.ranks)} distinct target GPUs needed, got {list(move.to_gpus)}")
    busy = [r for r in move.to_gpus if r not in scheduler.index.free]
    if busy:
        raise StateError(f"move of {old.id}: GPU(s) {', '.join(busy)} are not free any more", fix="plan again")
    new = _remapped(scheduler, old, move)
    held = scheduler.ledger.get(old.id)
    record = {k: v for k, v in (held.meta if held is not None else {}).items() if k not in ("placement", "hbm_bytes")}
    record.update({"model": new.model, "tp": str(new.tp), "pp": str(new.pp), "placement": new.model_dump_json()})
    record[MOVED_FROM] = old.id
    record[INSTANCE] = record.get(INSTANCE, old.id)
    record.update(meta or {})
    who = owner if owner is not None else (held.owner if held is not None else "toposched")
    bytes_each = old.hbm_per_gpu.total
    booked = scheduler.ledger.reserve(
        new.id, dict.fromkeys(move.to_gpus, bytes_each), ttl_s=ttl_s, owner=who, meta=record
    )
    if not booked.ok:
        raise LedgerConflict(f"ledger refused {new.id}: {booked.status} {booked.reasons}", result=booked)
    scheduler.index.take(move.to_gpus)
    slo_class, gbps = scheduler._cross_of.get(old.id, ("interactive", old.cross_domain_gbps))
    scheduler.adopt(new, slo_class, cross_gbps=gbps)
    return new


def finish_move(scheduler: Scheduler, move: Move) -> None:
    """Release the old copy once its replacement is booked (after the new engine is up and the old drained)."""
    if move.replacement_id not in scheduler.placements:
        raise StateError(
            f"the replacement {move.replacement_id} of {move.placement_id} is not booked",
            fix="start the move first (its old copy keeps serving until then)",
        )
    if not scheduler.release(move.placement_id):
        scheduler.ledger.release(move.placement_id)  # not tracked here (released elsewhere): make sure


class DefragLimiter:
    """A sliding-window rate limit: at most ``moves`` moves per ``window_s`` seconds (the caller's clock)."""

    def __init__(self, moves: int, window_s: float) -> None:
        if moves < 0 or not window_s > 0:
            raise InputError(f"defrag limit: moves >= 0 and window_s > 0 needed (got {moves}, {window_s})")
        self.moves = moves
        self.window_s = window_s
        self._done: deque[tuple[float, int]] = deque()
        self._total = 0

    def _expire(self, now: float) -> None:
        while self._done and self._done[0][0] <= now - self.window_s:
            _t, count = self._done.popleft()
            self._total -= count

    def used(self, now: float) -> int:
        """Moves recorded within the window ending at ``now``."""
        self._expire(now)
        return self._total

    def allow(self, now: float, count: int) -> bool:
        """Whether ``count`` more moves fit in the window ending at ``now``."""
        return self.used(now) + count <= self.moves

    def retry_after(self, now: float, count: int) -> float:
        """Seconds until ``count`` more moves fit (inf when they never can)."""
        if count > self.moves:
            return float("inf")
        excess = self.used(now) + count - self.moves
        for t, n in self._done:
            if excess <= 0:
                break
            excess -= n
            if excess <= 0:
                return max(t + self.window_s - now, 0.0)
        return 0.0

    def record(self, now: float, count: int) -> None:
        """Count ``count`` moves started at ``now``."""
        if count > 0:
            self._done.append((now, count))
            self._total += count


__all__ = [
    "DefragLimiter",
    "DefragPlan",
    "Move",
    "defrag_need",
    "finish_move",
    "plan_defrag",
    "replacement_id",
    "room_for",
    "search_defrag",
    "start_move",
]
