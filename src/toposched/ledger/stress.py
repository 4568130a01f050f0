"""A load generator for ledger backends: client processes booking the same GPUs, and a checker.

``run_stress`` sets up ``gpus`` GPUs named ``stress/N`` with a small capacity, so clients compete,
then starts ``clients`` processes that between them run ``ops`` operations (reserve 55 %, release
35 %, renew 10 %) with leases, each remembering what it holds. A call that fails because the store
is away is retried with the same id until it gets an answer (reserve is idempotent by id).

An independent reader process checks the ledger after every operation: it follows the audit log
(every change, in commit order) and keeps its own per-GPU sums, so even an over-commit that lasts
one operation is seen; between log reads it also sums the live reservations itself and compares
the backend's own per-GPU accounts with the capacity. ``double_bookings`` counts the operations
(and snapshots) after which some GPU's reserved bytes exceeded its capacity.

At the end ``lost`` counts reservations that a client holds but the ledger does not although their lease
has not run out, the reverse, and those held on both sides with different GPUs. A reservation the ledger
dropped after its lease ran out unrenewed (``--ttl`` shorter than the run) is not lost: that is what a
lease is for; ``expired_unrenewed`` counts them apart (each client notes when each of its leases ends, by
this host's clock, after the call returned: no earlier than the ledger's own end). The run then releases
what it booked.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import random
import resource
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier, Event
from typing import Any

from toposched.errors import StateError
from toposched.ledger.base import GIB, AuditEntry, Ledger, open_ledger

STRESS_NODE = "stress"


@dataclass(frozen=True)
class StressConfig:
    url: str  # "sqlite:PATH" or "etcd:http://HOST:PORT"
    clients: int = 4
    ops: int = 1000  # in total, shared out between the clients
    gpus: int = 8
    capacity_gib: int = 64
    ttl_s: float = 60.0
    seed: int = 0
    retry_s: float = 60.0  # how long a client keeps retrying one call while the store is away


@dataclass
class Replay:
    """Per-GPU sums rebuilt from the audit log; counts entries after which a GPU was over capacity."""

    capacity: Mapping[str, int]
    held: dict[str, dict[str, int]] = field(default_factory=dict)
    sums: dict[str, int] = field(default_factory=dict)
    entries: int = 0
    violations: int = 0

    def apply(self, entries: Iterable[AuditEntry]) -> None:
        for entry in entries:
            self.entries += 1
            if entry.action == "reserve":
                self.held[entry.id] = entry.gpus
                for ref, b in entry.gpus.items():
                    self.sums[ref] = self.sums.get(ref, 0) + b
            elif entry.action in ("release", "expire") and entry.id in self.held:
                for ref, b in self.held.pop(entry.id).items():
                    self.sums[ref] -= b
            if any(self.sums.get(ref, 0) > cap for ref, cap in self.capacity.items()):
                self.violations += 1


def stress_refs(gpus: int) -> list[str]:
    return [f"{STRESS_NODE}/{i}" for i in range(gpus)]


def _own_cpu_s() -> float:
    """CPU seconds this process spent so far, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _retry(cfg: StressConfig, counts: dict[str, int], call: Any, *args: Any, **kwargs: Any) -> Any:
    deadline = time.monotonic() + cfg.retry_s
    while True:
        try:
            return call(*args, **kwargs)
        except StateError:
            if time.monotonic() > deadline:
                raise
            counts["retried"] += 1
            time.sleep(0.1)


def _settings() -> dict[str, str]:
    """This process's ``TOPOSCHED_*`` environment (the etcd transport, ...), for the client processes: a fork
    server's children inherit the environment of when it started, not of now."""
    return {name: value for name, value in os.environ.items() if name.startswith("TOPOSCHED_")}


def _adopt(settings: Mapping[str, str]) -> None:
    for name in [name for name in os.environ if name.startswith("TOPOSCHED_")]:
        del os.environ[name]
    os.environ.update(settings)


def _client(
    cfg: StressConfig, run: str, index: int, ops: int, start: Barrier, out: mp.Queue[Any], settings: dict[str, str]
) -> None:
    try:
        _adopt(settings)
        rng = random.Random(cfg.seed * 1000 + index)
        refs = stress_refs(cfg.gpus)
        ledger = open_ledger(cfg.url)
        held: dict[str, dict[str, int]] = {}
        ends: dict[str, float] = {}  # when each held lease runs out unless renewed (this host's wall clock)
        counts = dict.fromkeys(("reserved", "refused", "released", "renewed", "expired", "retried"), 0)
        gc.freeze()  # the imports' objects are never garbage: the collector need not walk them again
        start.wait()
        began_cpu = _own_cpu_s()  # the operations' CPU (a spawned client's imports are not theirs)
        for k in range(ops):
            roll = rng.random()
            if not held or roll < 0.55:
                rid = f"{run}-{index}-{k}"
                gpus = {ref: rng.randint(1, 24) * GIB for ref in rng.sample(refs, rng.randint(1, min(4, len(refs))))}
                owner = f"stress:{run}:{index}"
                result = _retry(cfg, counts, ledger.reserve, rid, gpus, ttl_s=cfg.ttl_s, owner=owner)
                if result.ok:
                    held[rid] = gpus
                    ends[rid] = time.time() + cfg.ttl_s
                counts["reserved" if result.ok else "refused"] += 1
            elif roll < 0.9:
                rid = rng.choice(sorted(held))
                _retry(cfg, counts, ledger.release, rid)
                del held[rid]
                counts["released"] += 1
            else:
                rid = rng.choice(sorted(held))
                if _retry(cfg, counts, ledger.renew, rid, cfg.ttl_s) is None:
                    del held[rid]
                    counts["expired"] += 1
                else:
                    ends[rid] = time.time() + cfg.ttl_s
                    counts["renewed"] += 1
        ledger.close()
        transport = type(getattr(ledger, "client", None)).__name__  # etcd's: EtcdGrpcClient or EtcdClient
        out.put(
            (
                "client",
                {
                    "held": held,
                    "ends": {k: ends[k] for k in held},
                    "counts": counts,
                    "cpu_s": _own_cpu_s() - began_cpu,
                    "transport": transport,
                },
            )
        )
    except Exception:
        out.put(("error", f"client {index}: {traceback.format_exc()}"))


def _reader(
    cfg: StressConfig, since: int, capacity: dict[str, int], done: Event, out: mp.Queue[Any], settings: dict[str, str]
) -> None:
    try:
        _adopt(settings)
        began_cpu = _own_cpu_s()  # the checking's CPU, not a spawned reader's imports
        ledger = open_ledger(cfg.url)
        replay = Replay(capacity)
        snapshots = snapshot_violations = 0
        last = since
        outage_since: float | None = None
        while True:
            finished = done.is_set()
            try:
                entries = ledger.audit(since=last)
                sums: dict[str, int] = {}
                for r in ledger.reservations():
                    for ref, b in r.gpus.items():
                        sums[ref] = sums.get(ref, 0) + b
                accounts = ledger.accounts()
            except StateError:  # the store is away: keep trying as long as the clients do
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since > cfg.retry_s:
                    raise
                time.sleep(0.1)
                continue
            outage_since = None
            replay.apply(entries)
            if entries:
                last = entries[-1].seq
            snapshots += 1
            over = [ref for ref, cap in capacity.items() if max(sums.get(ref, 0), accounts[ref].reserved_bytes) > cap]
            snapshot_violations += bool(over)
            if finished and not entries:
                break
            if not entries:
                time.sleep(0.002)
        ledger.close()
        out.put(
            (
                "reader",
                {"entries": replay.entries, "violations": replay.violations, "snapshots": snapshots}
                | {"snapshot_violations": snapshot_violations, "cpu_s": _own_cpu_s() - began_cpu},
            )
        )
    except Exception:
        out.put(("error", f"reader: {traceback.format_exc()}"))


def _last_seq(ledger: Ledger) -> int:
    entries = ledger.audit()
    return entries[-1].seq if entries else 0


def run_stress(cfg: StressConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the load; the result has ``ops``, ``ops_per_s``, ``double_bookings`` and ``lost``.

    ``progress``: called with a line as each stage starts (setting up, the clients' run, the check)."""
    say = progress or (lambda _msg: None)
    say(f"setting up {cfg.gpus} GPUs in the store")
    run = uuid.uuid4().hex[:8]
    refs = stress_refs(cfg.gpus)
    capacity = dict.fromkeys(refs, cfg.capacity_gib * GIB)
    ledger = open_ledger(cfg.url)
    ledger.set_capacity(capacity)
    for old in ledger.reservations():  # leftovers of an earlier run on the stress GPUs
        if set(old.gpus) & set(refs):
            ledger.release(old.id)
    since = _last_seq(ledger)

    # etcd's client is grpcio, whose threads do not survive a fork of a process that has used it (issue 33,
    # docs/ledger.md): the clients of an etcd run come from a fork server, a fresh interpreter that imports
    # the ledger and never opens a channel (the start barrier keeps the children's own set-up out of the
    # timing). The other backends keep fork (and a test can patch the backend in the parent).
    ctx: mp.context.ForkServerContext | mp.context.ForkContext
    if cfg.url.startswith("etcd"):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__, "toposched.ledger.etcd", "toposched.ledger.etcd_grpc"])
    else:
        ctx = mp.get_context("fork")
    out: mp.Queue[Any] = ctx.Queue()
    start, done = ctx.Barrier(cfg.clients + 1), ctx.Event()
    shares = [cfg.ops // cfg.clients + (i < cfg.ops % cfg.clients) for i in range(cfg.clients)]
    settings = _settings()
    reader = ctx.Process(target=_reader, args=(cfg, since, capacity, done, out, settings), daemon=True)
    clients = [
        ctx.Process(target=_client, args=(cfg, run, i, n, start, out, settings), daemon=True)
        for i, n in enumerate(shares)
    ]
    say(f"starting {cfg.clients} client processes")
    reader.start()
    for proc in clients:
        proc.start()
    start.wait()
    say(f"{cfg.clients} clients running {sum(shares):,} ops")
    began = time.perf_counter()
    reports: list[dict[str, Any]] = []
    errors: list[str] = []
    while len(reports) + len(errors) < cfg.clients:
        try:
            kind, body = out.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in clients):
                errors.append("a client process died without a report")
            continue
        (reports if kind == "client" else errors).append(body)
    seconds = time.perf_counter() - began
    say("checking every change for double bookings")
    done.set()
    checked: dict[str, Any] = {}
    while not checked and not errors:
        kind, body = out.get(timeout=cfg.retry_s + 30)
        if kind == "reader":
            checked = body
        else:
            errors.append(body)
    for proc in [*clients, reader]:
        proc.join(5)
    if errors:
        raise StateError("the stress run failed: " + errors[0].strip().splitlines()[-1], fix="\n".join(errors))

    held: dict[str, dict[str, int]] = {}
    ends: dict[str, float] = {}
    for report in reports:
        held.update(report["held"])
        ends.update(report["ends"])
    in_ledger = {r.id: r.gpus for r in ledger.reservations() if r.owner.startswith(f"stress:{run}:")}
    now = time.time()
    missing = held.keys() - in_ledger.keys()
    expired = {k for k in missing if ends[k] <= now}  # its lease ran out unrenewed: the ledger may drop it
    lost = len(missing - expired) + len(in_ledger.keys() - held.keys())
    lost += sum(held[k] != in_ledger[k] for k in held.keys() & in_ledger.keys())
    for rid in in_ledger:
        ledger.release(rid)
    ledger.close()
    totals = {k: sum(r["counts"][k] for r in reports) for k in reports[0]["counts"]} if reports else {}
    ops = sum(shares)
    return {
        "backend": cfg.url.partition(":")[0],
        "clients": cfg.clients,
        "ops": ops,
        "seconds": round(seconds, 3),
        "ops_per_s": round(ops / seconds, 1) if seconds > 0 else 0.0,
        "reservations_per_s": round(totals.get("reserved", 0) / seconds, 1) if seconds > 0 else 0.0,
        "double_bookings": checked["violations"] + checked["snapshot_violations"],
        "lost": lost,
        "expired_unrenewed": len(expired),
        "held_at_end": len(held),
        "checked_changes": checked["entries"],
        "checked_snapshots": checked["snapshots"],
        "client_cpu_s": round(sum(r["cpu_s"] for r in reports), 3),
        "transports": sorted({r["transport"] for r in reports}),
        "checker_cpu_s": round(checked["cpu_s"], 3),
        **totals,
    }
