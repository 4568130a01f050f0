"""etcd at real cluster sizes, under etcd's default limits (128 operations and 1.5 MiB per transaction).

The session's etcd (``conftest.py``) runs with etcd's defaults; every transaction the ledger sends is
recorded, so the tests can say how many there were and how big, not only that etcd accepted them.
"""

from __future__ import annotations

import math
import random
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ledger.conftest import EtcdServer
from tests.service.conftest import Server
from toposched.errors import StateError
from toposched.ledger.base import GIB
from toposched.ledger.etcd import CAPACITY_CHUNK, EtcdLedger
from toposched.ledger.etcd_client import ETCD_MAX_REQUEST_BYTES, ETCD_MAX_TXN_OPS, Json, op_bytes
from toposched.ledger.etcd_keys import BUCKETS, bucket_of
from toposched.ledger.stress import Replay


@dataclass(frozen=True)
class Txn:
    compares: int
    ops: int
    puts: int
    size: int


def record(ledger: EtcdLedger) -> list[Txn]:
    """Every transaction ``ledger`` sends from now on."""
    sent: list[Txn] = []
    inner = ledger.client.txn

    def txn(compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()) -> tuple[bool, Json]:
        puts = sum("requestPut" in op for op in success)
        sent.append(Txn(len(compare), len(success), puts, op_bytes([*compare, *success])))
        return inner(compare, success, failure)

    ledger.client.txn = txn  # type: ignore[method-assign]
    return sent


def cluster(gpus: int) -> dict[str, int]:
    return {f"node-{i // 8:04d}/{i % 8}": 80 * GIB for i in range(gpus)}


def spread(refs: list[str], size: int) -> list[str]:
    """``size`` GPUs spread over as many nodes as possible."""
    return refs[:: len(refs) // size][:size]


def within_defaults(sent: list[Txn]) -> bool:
    return all(t.compares <= ETCD_MAX_TXN_OPS and t.ops <= ETCD_MAX_TXN_OPS for t in sent) and all(
        t.size < ETCD_MAX_REQUEST_BYTES for t in sent
    )


@pytest.mark.parametrize("gpus", [256, 4096])
def test_capacity_and_reservations_of_any_size(etcd_url: str, gpus: int) -> None:
    ledger = EtcdLedger(etcd_url)
    sent = record(ledger)
    caps = cluster(gpus)
    ledger.set_capacity(caps)
    assert len(sent) == 1 + math.ceil(gpus / CAPACITY_CHUNK)  # one read, then chunks of 100 GPUs
    assert sum(t.puts for t in sent) == gpus + 1  # every GPU once, plus the layout version
    assert {ref: a.capacity_bytes for ref, a in ledger.accounts().items()} == caps
    sent.clear()
    ledger.set_capacity(caps)  # a restart: nothing changed, nothing written
    assert [t.puts for t in sent] == [0]

    refs = sorted(caps)
    seen: set[str] = set()  # buckets this ledger object has read (it remembers them)
    for size in sorted({72, 128, 256, gpus}):
        booked = spread(refs, size)
        buckets = {bucket_of(ref) for ref in booked}
        sent.clear()
        result = ledger.reserve(f"r{size}", dict.fromkeys(booked, 70 * GIB), ttl_s=30)
        assert result.status == "reserved", result.reasons
        # a read (unless it remembers every bucket) and a commit, whose size is bounded by the buckets
        assert len(sent) == (1 if buckets <= seen else 2) and within_defaults(sent)
        seen |= buckets
        assert sent[-1].compares <= 2 + BUCKETS and sent[-1].ops <= 3 + BUCKETS
        accounts = ledger.accounts()
        assert sum(a.reserved_bytes for a in accounts.values()) == size * 70 * GIB
        assert all(accounts[ref].reserved_bytes == 70 * GIB for ref in booked)
        clash = ledger.reserve("clash", {booked[-1]: 20 * GIB, refs[1]: GIB})
        assert clash.status == "insufficient" and set(clash.reasons) == {booked[-1]}
        sent.clear()
        assert ledger.release(f"r{size}") is True
        assert within_defaults(sent)
        assert all(a.reserved_bytes == 0 for a in ledger.accounts().values())
    assert [e.action for e in ledger.audit()] == ["reserve", "release"] * len({72, 128, 256, gpus})


def test_capacity_writes_resume_after_a_crash(etcd_url: str) -> None:
    ledger = EtcdLedger(etcd_url)
    caps = cluster(1024)
    inner = ledger.client.txn
    chunks: list[int] = []

    def dies_at_the_third_chunk(
        compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()
    ) -> tuple[bool, Json]:
        if success and "requestPut" in success[0]:
            chunks.append(len(success))
            if len(chunks) == 3:
                raise StateError("etcd went away")
        return inner(compare, success, failure)

    ledger.client.txn = dies_at_the_third_chunk  # type: ignore[method-assign]
    with pytest.raises(StateError):
        ledger.set_capacity(caps)
    ledger.client.txn = inner  # type: ignore[method-assign]
    written = len(ledger.accounts())
    assert written == 199  # two chunks: the layout version and 99 GPUs, then 100
    sent = record(ledger)
    ledger.set_capacity(caps)  # run again: only what is missing
    assert sum(t.puts for t in sent) == 1024 - written
    assert {ref: a.capacity_bytes for ref, a in ledger.accounts().items()} == caps


def interleave(mine: EtcdLedger, theirs: EtcdLedger, taken: list[str], rid: str = "theirs") -> list[Txn]:
    """Make ``theirs`` book ``taken`` (whole GPUs, as ``rid``) just before ``mine`` first commits;
    ``mine``'s transactions from then on."""
    sent = record(mine)
    inner = mine.client.txn

    def txn(compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()) -> tuple[bool, Json]:
        if compare and not theirs.get(rid):
            assert theirs.reserve(rid, dict.fromkeys(taken, 80 * GIB)).ok
        return inner(compare, success, failure)

    mine.client.txn = txn  # type: ignore[method-assign]
    return sent


@pytest.mark.parametrize(("first", "second"), [(8, 8), (8, 72), (72, 8), (72, 128), (256, 256)])
def test_a_booking_between_read_and_commit_is_seen(etcd_url: str, first: int, second: int) -> None:
    """Another replica books one of my GPUs while my reserve is between its read and its commit:
    whatever the two sizes (per-GPU keys for small reservations, per-bucket keys for large ones), my
    commit fails, and reading again I refuse the GPU now full; nothing is booked twice."""
    caps = cluster(256)
    mine, theirs = EtcdLedger(etcd_url), EtcdLedger(etcd_url)
    mine.set_capacity(caps)
    refs = sorted(caps)
    wanted, taken = refs[:first], refs[first - 1 :][:second]  # they take my last GPU and the next ones
    sent = interleave(mine, theirs, taken)
    result = mine.reserve("mine", dict.fromkeys(wanted, 80 * GIB))
    assert result.status == "insufficient" and set(result.reasons) == {refs[first - 1]}
    assert sum(t.compares > 0 for t in sent) == 1  # the one commit it tried failed
    accounts = mine.accounts()
    assert all(a.reserved_bytes <= a.capacity_bytes for a in accounts.values())
    assert sum(a.reserved_bytes for a in accounts.values()) == len(taken) * 80 * GIB


def test_bookings_on_other_gpus_cost_at_most_a_retry(etcd_url: str) -> None:
    """Small reservations conflict only on shared GPUs (not on other GPUs of the same node); a large
    one conflicts with bookings in the buckets it touches, and books after one more read."""
    caps = cluster(256)
    mine, theirs = EtcdLedger(etcd_url), EtcdLedger(etcd_url)
    mine.set_capacity(caps)
    refs = sorted(caps)
    sent = interleave(mine, theirs, refs[4:8])
    assert mine.reserve("mine", dict.fromkeys(refs[:4], 80 * GIB)).status == "reserved"
    assert sum(t.compares > 0 for t in sent) == 1  # same node, other GPUs: no conflict at all

    mine, theirs = EtcdLedger(etcd_url), EtcdLedger(etcd_url)
    wanted, near = refs[8:79], refs[79]  # 71 GPUs of nodes 1-9; they take the last GPU of node 9
    assert bucket_of(near) in {bucket_of(ref) for ref in wanted}
    sent = interleave(mine, theirs, [near], "theirs-2")
    assert mine.reserve("large", dict.fromkeys(wanted, 80 * GIB)).status == "reserved"
    assert sum(t.compares > 0 for t in sent) == 2  # a booking in one of its buckets: one retry
    assert sum(a.reserved_bytes for a in mine.accounts().values()) == (4 + 4 + 71 + 1) * 80 * GIB


def test_concurrent_reservations_never_double_book_at_4096_gpus(etcd_url: str) -> None:
    """Four replicas book whole GPUs (so any shared GPU is a clash) in windows of 8 to 256 GPUs that
    overlap often; the audit log and the accounts show no GPU ever booked twice."""
    caps = cluster(4096)
    EtcdLedger(etcd_url).set_capacity(caps)
    refs = sorted(caps)[:1024]
    results: list[tuple[str, list[str]]] = []
    lock = threading.Lock()

    def replica(seed: int) -> None:
        ledger, rng = EtcdLedger(etcd_url), random.Random(seed)
        for k in range(8):
            size = rng.choice([8, 8, 72, 128, 256])
            first = rng.randrange(0, len(refs) - size)
            booked = refs[first : first + size]
            if ledger.reserve(f"w{seed}-{k}", dict.fromkeys(booked, 80 * GIB), ttl_s=30).ok:
                with lock:
                    results.append((f"w{seed}-{k}", booked))
        ledger.close()

    threads = [threading.Thread(target=replica, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger = EtcdLedger(etcd_url)
    owners: dict[str, str] = {}
    for rid, booked in results:
        for ref in booked:
            assert ref not in owners, f"{ref} booked by {owners.get(ref)} and {rid}"
            owners[ref] = rid
    replay = Replay(caps)
    replay.apply(ledger.audit())
    assert replay.violations == 0 and replay.held.keys() == {rid for rid, _ in results}
    assert {ref: a.reserved_bytes for ref, a in ledger.accounts().items() if a.reserved_bytes} == dict.fromkeys(
        owners, 80 * GIB
    )
    assert 2 <= len(results) < 32  # some bookings won, some clashed


def test_serve_starts_on_etcd_with_256_gpus(etcd_server: EtcdServer, tmp_path: Path) -> None:
    url = f"{etcd_server.url}/svc{uuid.uuid4().hex[:8]}"
    server = Server(["--preset", "cluster-32x-hgx-h100", "--state", f"etcd:{url}"], tmp_path / "serve.log")
    try:
        assert server.client.get("/readyz").status_code == 200
        answer = server.client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": "p1", "allowed_tp": [8]})
        assert answer.status_code == 201, answer.text
        accounts = EtcdLedger(url).accounts()
        assert len(accounts) == 256 and sum(a.reserved_bytes > 0 for a in accounts.values()) == 8
    finally:
        server.stop()
