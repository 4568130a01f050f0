"""What a replica keeps of each placement: its instances as rebuilt from the ledger, and decisions.

The ledger's reservation ``meta`` carries the whole placement record (the placement, the request's key and
id, the owner), so any replica can rebuild its ``Instance`` objects from the ledger alone (``instance_of``)
and any tool can build a scheduler holding what a service's state holds (``scheduler_from_ledger``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from toposched.errors import InputError
from toposched.ledger.base import Ledger, Reservation
from toposched.service.ledger_guard import GuardedLedger
from toposched.service.request import PdSpec, slot_ids
from toposched.solver.defrag import INSTANCE, MOVED_FROM
from toposched.solver.outcome import Outcome
from toposched.solver.pd import near_check, role_ids, role_request_id, with_role
from toposched.solver.place import Assessment
from toposched.solver.request import Placement, PlacementRequest, Role
from toposched.solver.scheduler import DEFAULT_BUDGET_GBPS, Scheduler
from toposched.topology.model import Cluster, Health

PD_PAIR = "pd_pair"
"""Reservation meta of a decode instance: the prefill instance it pairs with."""


@dataclass(frozen=True)
class PdBooking:
    """The disaggregated request being booked (``ServiceScheduler.booking_pd``): its record and its roles."""

    request_id: str
    spec: PdSpec
    meta: dict[str, str]
    ttl_s: float | None

    def role_of(self, pid: str) -> Role | None:
        """The role of instance ``pid`` of this request (None: not one of its instances)."""
        roles: tuple[tuple[Role, int], ...] = (("prefill", self.spec.prefill), ("decode", self.spec.decode))
        for role, count in roles:
            if pid in role_ids(self.request_id, role, count):
                return role
        return None


class ServiceScheduler(Scheduler):
    """The solver's scheduler plus what a replica needs: placement records on bookings, adopt/forget."""

    guard: GuardedLedger
    pd_booking: PdBooking | None = None

    @contextmanager
    def booking_pd(self, booking: PdBooking) -> Iterator[None]:
        """While ``solver.pd.place_pd`` books a disaggregated request here, each instance's ledger record is
        the service's (request key, id, owner, lease, the pair) and its placement carries its role, KV NICs
        and host NUMA nodes *as booked*, so a replica rebuilding from the ledger shows what was answered."""
        self.pd_booking = booking
        try:
            yield
        finally:
            self.pd_booking = None

    def place(
        self,
        request: PlacementRequest,
        policy: str = "slo",
        *,
        ttl_s: float | None = None,
        meta: dict[str, str] | None = None,
    ) -> Outcome:
        """``Scheduler.place``; an instance of the request in ``pd_booking`` gets its record and lease."""
        booking = self.pd_booking
        role = booking.role_of(request.id) if booking is not None else None
        if booking is None or role is None:
            return super().place(request, policy, ttl_s=ttl_s, meta=meta)
        record = {**booking.meta, **(meta or {}), "role": role}
        if role == "decode" and request.near:
            record[PD_PAIR] = request.near
        # the placement is booked under its role's request id: its SLO class is looked up there (commit)
        self._class_of[role_request_id(booking.request_id, role)] = request.slo_class
        return super().place(request, policy, ttl_s=booking.ttl_s if ttl_s is None else ttl_s, meta=record)

    def commit(self, chosen: Assessment, *, ttl_s: float | None = None, meta: dict[str, str] | None = None) -> None:
        """``Scheduler.commit``; an instance of the request in ``pd_booking`` is booked with its role, KV NICs
        and host NUMA nodes, and a decode instance with the ``near`` check of its pair (as ``place_pd`` adds
        it to a plan's decode placements: after booking, so only the plan's copy had it before)."""
        booking = self.pd_booking
        role = booking.role_of(chosen.placement.id) if booking is not None else None
        if booking is not None and role is not None:
            nodes = {n.name: n for n in self.cluster.nodes}
            rid = role_request_id(booking.request_id, role)
            placed = with_role(chosen.placement, role, rid, nodes, self.index.dmap)
            prefill = self.placements.get((meta or {}).get(PD_PAIR, ""))
            if role == "decode" and prefill is not None:  # the plan's ``near`` check, booked with it
                near = near_check(placed, prefill, nodes)
                placed = placed.model_copy(update={"constraints": (*placed.constraints, near)})
            chosen = dataclasses.replace(chosen, placement=placed)
        super().commit(chosen, ttl_s=ttl_s, meta=meta)

    def sync_index(self, held: set[str]) -> None:
        """Make the index's free set: every healthy GPU that no booking holds and that has not failed."""
        index = self.index
        nodes = self.cluster.nodes
        unhealthy = {f"{n.name}/{g.index}" for n in nodes for g in n.gpus if g.health is Health.UNAVAILABLE}
        busy = held | self.failed | unhealthy
        index.take([ref for ref in index.free if ref in busy])
        index.give([ref for ref in index.info if ref not in index.free and ref not in busy])


@dataclass
class Instance:
    """One placed instance as the service keeps it (rebuilt from the ledger on resync).

    ``slot`` is the instance id of the request it serves (``instance_ids``): the placement id itself,
    or, for a copy booked by a defragmentation move, the original's; ``moved_from`` names the copy a
    replacement replaces. While a move is in flight a slot has two copies and the old one serves.
    """

    placement: Placement
    request_id: str
    key: str
    body: dict[str, Any]
    owner: str
    expires_at: float | None
    degraded: bool = False
    drifted: bool = False
    """Its sidecar's latest report has topology drift (``toposched_sidecar_drift_ratio``)."""
    moving: bool = False
    """A re-placement was proposed on its sidecar's latest report (``toposched_migration_ratio``)."""
    slot: str = ""
    moved_from: str | None = None
    pair: str | None = None
    """A decode instance of a disaggregated request: the prefill instance it pairs with."""

    def __post_init__(self) -> None:
        if not self.slot:
            self.slot = self.placement.id


class InstanceTable(dict[str, Instance]):
    """Live instances by placement id, with a second index by request id kept in step on every change,
    so finding a request's instances (``Deciding.members``) does not scan every instance."""

    def __init__(self) -> None:
        super().__init__()
        self._by_request: dict[str, dict[str, Instance]] = {}

    def __setitem__(self, pid: str, instance: Instance) -> None:
        old = self.get(pid)
        if old is not None:
            self._unindex(pid, old)
        super().__setitem__(pid, instance)
        self._by_request.setdefault(instance.request_id, {})[pid] = instance

    def __delitem__(self, pid: str) -> None:
        instance = self[pid]
        super().__delitem__(pid)
        self._unindex(pid, instance)

    def pop(self, pid: str, *default: Any) -> Any:
        if pid in self:
            instance = self[pid]
            del self[pid]
            return instance
        if default:
            return default[0]
        raise KeyError(pid)

    def clear(self) -> None:
        super().clear()
        self._by_request.clear()

    def _unindex(self, pid: str, instance: Instance) -> None:
        members = self._by_request.get(instance.request_id)
        if members is not None:
            members.pop(pid, None)
            if not members:
                del self._by_request[instance.request_id]

    def of_request(self, rid: str) -> list[Instance]:
        """The instances of request ``rid`` (any order)."""
        return list(self._by_request.get(rid, {}).values())


@dataclass(frozen=True)
class Decision:
    """The answer to one request: placed (or existing) with its instances, or why not."""

    status: Literal["placed", "existing", "no-capacity", "rejected", "conflict"]
    request_id: str
    instances: tuple[Instance, ...] = ()
    reasons: tuple[str, ...] = ()


@functools.lru_cache(maxsize=4096)
def replicas_in(key: str) -> int | None:
    """``replicas`` of a request body key (cached: every resync and list asks again for each request)."""
    try:
        replicas = json.loads(key).get("replicas", 1)
    except (ValueError, AttributeError):
        return None
    return replicas if isinstance(replicas, int) and 1 <= replicas <= 10_000 else None


@functools.lru_cache(maxsize=4096)
def pd_in(key: str) -> PdSpec | None:
    """The disaggregation of a request body key (None: a plain request, or a damaged key)."""
    try:
        data = json.loads(key).get("pd")
        return None if data is None else PdSpec.model_validate(data)
    except (ValueError, AttributeError):
        return None


def expected_slots(rid: str, key: str) -> list[str] | None:
    """The instance ids request ``rid`` with body ``key`` books (None: the key is damaged)."""
    replicas = replicas_in(key)
    return None if replicas is None else slot_ids(rid, replicas, pd_in(key))


def serving(members: list[Instance]) -> list[Instance]:
    """One copy per instance slot, in slot order: the old copy while a move is in flight, else the only one.

    A disaggregated request's slots go in its booking order (prefill, then decode: ``slot_ids``), as
    the answer to its POST lists them; a plain request's by id.
    """
    by_slot: dict[str, list[Instance]] = {}
    for instance in members:
        by_slot.setdefault(instance.slot, []).append(instance)
    first = members[0] if members else None
    pd = pd_in(first.key) if first is not None else None
    order = {} if first is None or pd is None else {s: n for n, s in enumerate(slot_ids(first.request_id, 1, pd))}
    out = []
    for _slot, copies in sorted(by_slot.items(), key=lambda item: (order.get(item[0], len(order)), item[0])):
        ids = {c.placement.id for c in copies}
        serving = [c for c in copies if c.moved_from not in ids] or copies
        out.append(min(serving, key=lambda c: c.placement.id))
    return out


def complete(members: list[Instance]) -> bool:
    """Whether ``members`` (one request's booked instances) hold every instance slot of the request."""
    if not members:
        return False
    first = members[0]
    expected = expected_slots(first.request_id, first.key)
    if expected is None or any(i.key != first.key for i in members):
        return False
    return sorted({i.slot for i in members}) == sorted(expected)


def instance_of(reservation: Reservation) -> Instance | None:
    meta = reservation.meta
    if "placement" not in meta or "request" not in meta:
        return None
    try:
        placement = Placement.model_validate_json(meta["placement"])
        body = json.loads(meta["request"])
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    body["id"] = meta.get("request_id", placement.request_id)
    return Instance(
        placement=placement,
        request_id=meta.get("request_id", placement.request_id),
        key=meta["request"],
        body=body,
        owner=reservation.owner or meta.get("owner", ""),
        expires_at=reservation.expires_at,
        slot=meta.get(INSTANCE, placement.id),
        moved_from=meta.get(MOVED_FROM),
        pair=meta.get(PD_PAIR),
    )


def scheduler_from_ledger(
    cluster: Cluster, ledger: Ledger, *, gpu: str | None = None, budget_gbps: float = DEFAULT_BUDGET_GBPS
) -> tuple[ServiceScheduler, dict[str, Instance]]:
    """A scheduler holding what ``ledger`` holds, and the service's instances in it; writes nothing.

    For tools that act on a service's state without being a replica (``toposched defrag``): bookings
    go through ``GuardedLedger`` (whole GPUs, as the service books) with the capacities the ledger has.
    ``InputError`` when the ledger and the cluster disagree on the GPUs (another topology was given).
    """
    accounts = ledger.accounts()
    refs = {f"{n.name}/{g.index}" for n in cluster.nodes for g in n.gpus}
    if not accounts:
        raise InputError("the state holds no GPUs: no `toposched serve` has used it", fix="give the service's --state")
    stray = sorted(set(accounts) - refs)
    if stray:
        raise InputError(
            f"the state's GPUs are not the cluster's ({len(stray)} unknown, e.g. {stray[0]})",
            fix="give the topology the service was started with (or none: the one stored in the state)",
        )
    guard = GuardedLedger(ledger, {ref: a.capacity_bytes for ref, a in accounts.items()})
    scheduler = ServiceScheduler(cluster, ledger=guard, gpu=gpu, budget_gbps=budget_gbps)
    scheduler.guard = guard
    instances: dict[str, Instance] = {}
    for reservation in guard.reservations():
        instance = instance_of(reservation)
        if instance is not None and set(instance.placement.gpu_refs) <= refs:
            scheduler.adopt(instance.placement, str(instance.body.get("slo_class", "interactive")))
            instances[reservation.id] = instance
    return scheduler, instances
