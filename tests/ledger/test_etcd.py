"""etcd specifics: outages give clear errors and lose nothing; changes reach other replicas by watch."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.ledger.conftest import EtcdServer, free_port
from toposched.errors import StateError
from toposched.ledger import open_ledger
from toposched.ledger.base import GIB, AuditEntry
from toposched.ledger.etcd import EtcdLedger
from toposched.ledger.etcd_client import Json, put_op
from toposched.ledger.etcd_transport import TRANSPORT_ENV, Transport
from toposched.ledger.stress import Replay, StressConfig, run_stress


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, which it may stop and start."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def transport_env(etcd_transport: Transport, monkeypatch: pytest.MonkeyPatch) -> Transport:
    """Each transport in turn, chosen for ``open_ledger`` (and forked clients) through the environment."""
    monkeypatch.setenv(TRANSPORT_ENV, etcd_transport)
    return etcd_transport


def test_unreachable_is_a_clear_error(transport_env: Transport) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    ledger = open_ledger(f"etcd:{url}")
    with pytest.raises(StateError) as caught:
        ledger.accounts()
    assert f"etcd at {url} is unreachable" in caught.value.message and "\n" not in caught.value.message
    assert caught.value.fix and "start etcd" in caught.value.fix
    assert type(ledger.client).__name__ == {"http": "EtcdClient", "grpc": "EtcdGrpcClient"}[transport_env]


def test_restart_loses_and_duplicates_nothing(own_etcd: EtcdServer, transport_env: Transport) -> None:
    ledger = open_ledger(f"etcd:{own_etcd.url}")
    ledger.set_capacity({"n/0": 80 * GIB, "n/1": 80 * GIB})
    assert ledger.reserve("leased", {"n/0": 30 * GIB}, ttl_s=30).ok
    assert ledger.reserve("plain", {"n/0": 10 * GIB, "n/1": 5 * GIB}).ok
    own_etcd.stop()
    with pytest.raises(StateError, match="unreachable"):
        ledger.reserve("during", {"n/1": GIB})
    with pytest.raises(StateError, match="unreachable"):
        ledger.accounts()
    own_etcd.start()
    assert sorted(r.id for r in ledger.reservations()) == ["leased", "plain"]
    assert ledger.reserve("leased", {"n/0": 30 * GIB}, ttl_s=30).status == "already_held"
    assert ledger.reserve("during", {"n/1": GIB}).status == "reserved"
    sums = {ref: a.reserved_bytes for ref, a in ledger.accounts().items()}
    assert sums == {"n/0": 40 * GIB, "n/1": 6 * GIB}
    assert ledger.renew("leased", 30) is not None  # the lease survived the restart


def test_stress_through_a_restart(own_etcd: EtcdServer, transport_env: Transport) -> None:
    def bounce() -> None:
        # the outage once the clients are booking (an etcd run's clients are spawned: they start later)
        watcher = open_ledger(f"etcd:{own_etcd.url}")
        deadline = time.monotonic() + 60
        while len(watcher.audit()) < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        watcher.close()
        own_etcd.stop()
        time.sleep(1.0)
        own_etcd.start()

    thread = threading.Thread(target=bounce)
    thread.start()
    result = run_stress(StressConfig(url=f"etcd:{own_etcd.url}", clients=3, ops=900, retry_s=30))
    thread.join()
    assert result["double_bookings"] == 0 and result["lost"] == 0
    assert result["retried"] > 0  # the clients did see the outage and came through it
    # the clients (from a fork server started by whichever run came first) used this run's transport
    assert result["transports"] == [{"http": "EtcdClient", "grpc": "EtcdGrpcClient"}[transport_env]]


def test_a_call_right_after_a_restart_is_answered(own_etcd: EtcdServer, transport_env: Transport) -> None:
    """Five times: etcd goes down, a call fails, etcd comes back, the very next call is answered (a gRPC
    channel still in its reconnection backoff waits for the connection instead of failing at once)."""
    ledger = open_ledger(f"etcd:{own_etcd.url}")
    ledger.set_capacity({"n/0": 80 * GIB})
    for attempt in range(5):
        own_etcd.stop()
        began = time.monotonic()
        with pytest.raises(StateError, match="unreachable"):
            ledger.accounts()
        assert time.monotonic() - began < 4.0  # a dead etcd is reported within about a backoff step
        own_etcd.start()
        assert ledger.reserve(f"r{attempt}", {"n/0": GIB}).status == "reserved"
    assert ledger.accounts()["n/0"].reserved_bytes == 5 * GIB
    ledger.close()


def test_audit_reaches_another_replica_by_watch(etcd_url: str) -> None:
    writer, watcher = EtcdLedger(etcd_url), EtcdLedger(etcd_url)
    writer.set_capacity({"n/0": 80 * GIB})
    seen: list[AuditEntry] = []

    def follow() -> None:
        for entry in watcher.watch_audit():
            seen.append(entry)
            if len(seen) == 2:
                return

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    time.sleep(0.3)
    writer.reserve("a", {"n/0": GIB}, owner="r1")
    writer.release("a")
    thread.join(5)
    assert [(e.action, e.id, e.owner) for e in seen] == [("reserve", "a", "r1"), ("release", "a", "r1")]
    assert seen == writer.audit()


def test_namespaces_are_separate(etcd_server: EtcdServer) -> None:
    a, b = EtcdLedger(f"{etcd_server.url}/ns-a"), EtcdLedger(f"{etcd_server.url}/ns-b")
    a.set_capacity({"n/0": GIB})
    assert b.accounts() == {}


CHURN_CAP = {f"c/{i}": 10 * GIB for i in range(4)}


def _churn(url: str, seed: int, renews: bool, until: float) -> int:
    """Book, renew and release on a few small GPUs with 2 s leases; a client that ``renews`` nothing
    lets every lease run out. Returns how many reservations it made."""
    ledger, rng, made = EtcdLedger(url), random.Random(seed), 0
    held: list[str] = []
    while time.monotonic() < until:
        roll = rng.random()
        if held and renews and roll < 0.3:
            ledger.renew(held[rng.randrange(len(held))], 2)
        elif held and renews and roll < 0.5:
            ledger.release(held.pop(rng.randrange(len(held))))
        else:
            rid = f"s{seed}-{made}-{rng.randrange(10**6)}"
            gpus = {ref: rng.randint(2, 5) * GIB for ref in rng.sample(sorted(CHURN_CAP), rng.randint(1, 2))}
            if ledger.reserve(rid, gpus, ttl_s=rng.choice([1, 2]), owner=f"churn{seed}").ok:
                made += 1
                held.append(rid)
        time.sleep(0.01)
    ledger.close()
    return made


def test_audit_log_replays_to_the_ledger_under_lease_churn(etcd_url: str) -> None:
    """Expired leases' bytes are booked again at once; each ``expire`` must come before the reserve
    that reuses its bytes, so no GPU is ever over capacity at any point of the replay."""
    ledger = EtcdLedger(etcd_url)
    ledger.set_capacity(CHURN_CAP)
    assert ledger.reserve("kept", {"c/0": GIB}).ok  # no lease: still there at the end
    until = time.monotonic() + 4.5
    with ThreadPoolExecutor(4) as pool:
        made = sum(pool.map(lambda k: _churn(etcd_url, k, k % 2 == 0, until), range(4)))
    deadline = time.monotonic() + 6  # every lease (2 s, no longer renewed) runs out
    while len(ledger.reservations()) > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    entries = ledger.audit()
    replay = Replay(CHURN_CAP)
    replay.apply(entries)
    expired = sum(e.action == "expire" for e in entries)
    assert made > 12 and expired > 6  # the run did book bytes that leases had freed
    assert replay.violations == 0, f"{replay.violations} of {replay.entries} log entries put a GPU over capacity"
    assert replay.held == {r.id: r.gpus for r in ledger.reservations()} == {"kept": {"c/0": GIB}}
    assert [e.seq for e in entries] == sorted({e.seq for e in entries})
    assert all(e.at == e.expires_at for e in entries if e.action == "expire")


def test_expires_at_is_never_after_the_lease_end(etcd_url: str) -> None:
    """A reserve that has to retry keeps the lease it was granted first; the end it reports is the
    grant's, not the commit's, so the lease can never run out before ``expires_at``."""
    ledger, other = EtcdLedger(etcd_url), EtcdLedger(etcd_url)
    ledger.set_capacity({"n/0": 80 * GIB})
    commit = ledger.client.txn
    raced: list[bool] = []

    def racing_txn(compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()) -> tuple[bool, Json]:
        if compare and not raced:  # the first commit: another replica books first, a second passes
            raced.append(True)
            time.sleep(1.2)
            assert other.reserve("other", {"n/0": GIB}).ok
        return commit(compare, success, failure)

    ledger.client.txn = racing_txn  # type: ignore[method-assign]
    result = ledger.reserve("a", {"n/0": GIB}, ttl_s=2)
    assert raced and result.status == "reserved" and result.reservation is not None
    expires_at = result.reservation.expires_at
    assert expires_at is not None
    while ledger.get("a") is not None:
        time.sleep(0.05)
    assert expires_at <= time.time()  # etcd ended the lease no earlier than the reservation said
    renewed = other.renew("other", 2)
    assert renewed is not None and renewed.expires_at is not None and renewed.expires_at <= time.time() + 2


def test_a_reservation_over_etcds_request_limit_is_refused_clearly(etcd_url: str) -> None:
    ledger = EtcdLedger(etcd_url, max_request_bytes=40_000)  # as if etcd ran with a small limit
    caps = {f"node-{i // 8:03d}/{i % 8}": 80 * GIB for i in range(512)}
    ledger.set_capacity(caps)
    result = ledger.reserve("huge", dict.fromkeys(caps, GIB))
    assert result.status == "invalid" and "over etcd's request limit (40000 bytes" in result.reasons["request"]
    assert ledger.reservations() == [] and ledger.audit() == []
    assert ledger.reserve("fits", dict.fromkeys(list(caps)[:64], GIB)).ok


def test_a_ledger_in_the_old_key_layout_is_not_read_as_empty(etcd_url: str) -> None:
    ledger = EtcdLedger(etcd_url)
    ledger.client.txn([], [put_op(f"{ledger.prefix}cap/n%2F0", str(80 * GIB))])  # as toposched wrote before
    with pytest.raises(StateError, match="another key layout") as caught:
        ledger.set_capacity({"n/0": 80 * GIB})
    assert caught.value.fix and "new namespace" in caught.value.fix


def _count_calls(ledger: EtcdLedger) -> list[str]:
    """The calls (``txn``, ``grant``, ``range``) ``ledger`` makes to etcd from now on, in order, on either transport."""
    calls: list[str] = []
    for name in ("txn", "grant", "range"):
        inner = getattr(ledger.client, name)

        def counted(*args: Any, _name: str = name, _inner: Any = inner, **kwargs: Any) -> Any:
            calls.append(_name)
            return _inner(*args, **kwargs)

        setattr(ledger.client, name, counted)
    return calls


def test_round_trips_per_change(etcd_url: str, etcd_transport: Transport) -> None:
    """A reserve on GPUs this ledger object has not seen reads once and commits once; on GPUs whose keys
    it remembers (from its reads and its own commits) it commits at once. Leases are shared, never
    revoked; a release or renew of a reservation this ledger booked is one transaction."""
    ledger = EtcdLedger(etcd_url, transport=etcd_transport)
    ledger.set_capacity({f"n/{i}": 80 * GIB for i in range(4)})
    calls = _count_calls(ledger)
    for k in range(10):  # k = 0, 1, 2 each bring one GPU not seen before; from k = 3 on all are known
        assert ledger.reserve(f"r{k}", {f"n/{k % 4}": GIB, f"n/{(k + 1) % 4}": GIB}, ttl_s=30).ok
    assert calls.count("grant") == 1 and calls.count("txn") == 3 * 2 + 7 and len(calls) == 14
    calls.clear()
    assert ledger.renew("r0", 30) is not None and ledger.release("r1") and ledger.release("r0")
    assert calls == ["txn"] * 3
    calls.clear()
    assert ledger.reserve("again", {"n/0": 60 * GIB, "n/1": 60 * GIB}, ttl_s=30).ok  # fits once r0, r1 are gone
    assert calls == ["txn"]
    assert sorted(r.id for r in ledger.reservations()) == ["again"] + [f"r{k}" for k in range(2, 10)]


def test_a_reserve_from_memory_sees_what_others_did(etcd_url: str) -> None:
    """A remembers n/0 and n/1; B then books most of n/0 and frees n/1. A's commit from memory fails its
    compare (the failure branch reads afresh) and A refuses n/0; a booking that memory says does not fit
    (n/1, freed by B) is read afresh before it is refused, and goes through."""
    a, b = EtcdLedger(etcd_url), EtcdLedger(etcd_url)
    a.set_capacity({"n/0": 80 * GIB, "n/1": 80 * GIB})
    assert a.reserve("a1", {"n/0": 10 * GIB, "n/1": 10 * GIB}, ttl_s=30).ok
    assert b.reserve("b1", {"n/1": 60 * GIB}, ttl_s=30).ok
    assert a.reserve("a2", {"n/1": 5 * GIB}, ttl_s=30).ok  # a's memory of n/1 is stale: one retry, booked
    assert b.reserve("b2", {"n/0": 65 * GIB}, ttl_s=30).ok and b.release("b1")
    calls = _count_calls(a)
    result = a.reserve("a3", {"n/0": 10 * GIB}, ttl_s=30)  # memory: 70 GiB free on n/0; now 5
    assert result.status == "insufficient" and set(result.reasons) == {"n/0"}
    assert calls == ["txn"]  # the commit that failed: its failure branch read n/0 afresh
    calls.clear()
    assert a.reserve("a4", {"n/1": 60 * GIB}, ttl_s=30).ok  # memory: 5 GiB free on n/1 (b1 is gone since)
    assert calls == ["txn", "txn"]  # refused from memory only after a fresh read: a read and a commit
    sums = {ref: acc.reserved_bytes for ref, acc in b.accounts().items()}
    assert sums == {"n/0": 75 * GIB, "n/1": 75 * GIB}
    replay = Replay({"n/0": 80 * GIB, "n/1": 80 * GIB})
    replay.apply(a.audit())
    assert replay.violations == 0


def test_threads_sharing_one_ledger_object_and_its_memory_never_double_book(etcd_url: str) -> None:
    """Four threads of one process book and release on three GPUs through one ledger object (one memory of
    the ranges, commits from it racing each other and another replica); the log never puts a GPU over."""
    caps = {f"n/{i}": 80 * GIB for i in range(3)}
    shared, other = EtcdLedger(etcd_url), EtcdLedger(etcd_url)
    shared.set_capacity(caps)
    booked: list[str] = []

    def work(seed: int, ledger: EtcdLedger) -> None:
        rng = random.Random(seed)
        mine: list[str] = []
        for k in range(12):
            if mine and rng.random() < 0.35:
                assert ledger.release(mine.pop(rng.randrange(len(mine))))
                continue
            gpus = {ref: rng.randint(10, 40) * GIB for ref in rng.sample(sorted(caps), rng.randint(1, 2))}
            if ledger.reserve(f"t{seed}-{k}", gpus, ttl_s=30).ok:
                mine.append(f"t{seed}-{k}")
        booked.extend(mine)

    with ThreadPoolExecutor(5) as pool:
        for future in [pool.submit(work, n, shared if n < 4 else other) for n in range(5)]:
            future.result()
    replay = Replay(caps)
    replay.apply(shared.audit())
    assert replay.violations == 0 and replay.entries >= 12  # how many commits win the races varies
    assert replay.held.keys() == set(booked) == {r.id for r in other.reservations()}
    assert all(a.reserved_bytes <= a.capacity_bytes for a in other.accounts().values())


def test_a_change_from_stale_memory_acts_on_the_reservation_as_it_is_now(etcd_url: str) -> None:
    """Replica A remembers ``x`` as it booked it; B releases it and books ``x`` again on other GPUs. A's
    release must fail its compare, read ``x`` afresh and free B's GPUs, not the ones A remembers."""
    a, b = EtcdLedger(etcd_url), EtcdLedger(etcd_url)
    a.set_capacity({"n/0": 80 * GIB, "n/1": 80 * GIB})
    assert a.reserve("x", {"n/0": 10 * GIB}, ttl_s=30).ok
    assert b.release("x")
    assert b.reserve("x", {"n/1": 20 * GIB}, ttl_s=30).ok
    renewed = a.renew("x", 30)
    assert renewed is not None and renewed.gpus == {"n/1": 20 * GIB}
    assert a.release("x")
    assert {ref: acc.reserved_bytes for ref, acc in b.accounts().items()} == {"n/0": 0, "n/1": 0}
    assert a.release("x") is False and b.release("x") is False
    assert [e.action for e in a.audit()] == ["reserve", "release", "reserve", "renew", "release"]


def test_a_renewal_does_not_extend_the_others_on_its_lease(etcd_url: str) -> None:
    """Two reservations share a lease; renewing one moves it to a new lease, the other still runs out."""
    ledger = EtcdLedger(etcd_url)
    ledger.set_capacity({"n/0": 80 * GIB})
    assert ledger.reserve("kept", {"n/0": GIB}, ttl_s=2).ok and ledger.reserve("left", {"n/0": GIB}, ttl_s=2).ok
    deadline = time.monotonic() + 8
    while ledger.get("left") is not None and time.monotonic() < deadline:
        assert ledger.renew("kept", 2) is not None
        time.sleep(0.5)
    assert ledger.get("left") is None and ledger.get("kept") is not None


def test_a_shared_lease_that_is_gone_is_replaced(etcd_url: str) -> None:
    """A lease that ran out (here: revoked, as if while etcd was down) is not reused: the next reserve or
    renew that would take it is refused by etcd, grants a new one and goes through."""
    ledger = EtcdLedger(etcd_url)
    ledger.set_capacity({"n/0": 80 * GIB})
    assert ledger.reserve("short", {"n/0": GIB}, ttl_s=5).ok and ledger.reserve("long", {"n/0": GIB}, ttl_s=30).ok
    kvs, _rev = ledger.client.range(f"{ledger.prefix}res/short")
    ledger.client.revoke(json.loads(kvs[0].value)["lease"])
    assert ledger.get("short") is None
    renewed = ledger.renew("long", 5)  # the shared lease for 5 s is the revoked one
    assert renewed is not None and ledger.get("long") is not None
    assert ledger.reserve("again", {"n/0": GIB}, ttl_s=5).ok and ledger.get("again") is not None
    # the expiry is logged when something needs it: here the audit read
    assert [e.action for e in ledger.audit()] == ["reserve", "reserve", "renew", "reserve", "expire"]


def test_the_size_bound_that_spares_a_reserve_the_exact_count_is_never_below_it() -> None:
    """``_size_bound`` lets a reserve skip building its transaction to measure it: it must never say less than
    the exact count, whatever the names (long, non-ASCII, characters JSON escapes) and GPU counts up to 32."""
    from toposched.ledger.base import Reservation
    from toposched.ledger.etcd_client import op_bytes, range_op

    rng = random.Random(17)
    alphabet = 'ab/%"\\\n\u00e9\u4e2d\U0001f600'
    text = lambda most: "".join(rng.choice(alphabet) for _ in range(rng.randint(1, most)))  # noqa: E731
    for _ in range(300):
        ledger = EtcdLedger(f"http://127.0.0.1:1/{text(30).replace('/', 'x')}")  # no I/O
        gpus = {f"{text(20)}/{i}": rng.randint(1, 1 << 40) for i in range(rng.randint(1, 32))}
        draft = Reservation(id=text(60), gpus=gpus, owner=text(40), created_at=1.0e9, meta={text(9): text(30)})
        watched = ledger._watched(gpus)
        compare, success = ledger._booking(
            draft.model_copy(update={"expires_at": 2.0e9}), 1 << 62, [1 << 62] * len(watched)
        )
        base = ledger._find_ops(draft.id) + [range_op(key, prefix=prefix) for key, prefix in watched]
        assert ledger._size_bound(draft) >= op_bytes([*compare, *success, *base])
