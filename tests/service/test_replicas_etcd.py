"""Three ``toposched serve`` replicas on one real etcd, concurrent clients: no GPU is ever booked twice."""

from __future__ import annotations

import random
import threading
import uuid

import httpx

from tests.ledger.conftest import EtcdServer
from tests.service.conftest import Server, StartServer
from toposched.ledger import open_ledger

THREADS = 6
ROUNDS = 25


def test_three_replicas_on_one_etcd_never_double_book(serve: StartServer, etcd_server: EtcdServer) -> None:
    url = f"{etcd_server.url}/svc{uuid.uuid4().hex[:8]}"
    replicas = [serve("--preset", "hgx-h100", "--state", f"etcd:{url}", "--replica", f"r{n}") for n in range(3)]
    held: dict[str, set[str]] = {}  # placement id -> GPU refs, as the clients believe
    lock = threading.Lock()
    errors: list[str] = []

    def work(k: int) -> None:
        rng = random.Random(k)
        mine: list[str] = []
        clients = [httpx.Client(base_url=r.url, headers=r.client.headers, timeout=60) for r in replicas]
        try:
            for n in range(ROUNDS):
                client = clients[rng.randrange(3)]
                if mine and rng.random() < 0.4:
                    pid = mine.pop(rng.randrange(len(mine)))
                    with lock:  # give up the claim first: once the DELETE is sent, its GPUs may go elsewhere
                        held.pop(pid, None)
                    answer = client.delete(f"/v1/placements/{pid}")  # often another replica than the placer
                    if answer.status_code != 200:
                        errors.append(f"DELETE {pid}: {answer.status_code} {answer.text}")
                    continue
                pid = f"t{k}-{n}"
                tp = rng.choice([1, 2, 4])
                answer = client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": pid, "allowed_tp": [tp]})
                if answer.status_code == 201:
                    gpus = {f"{r['node']}/{r['gpu']}" for r in answer.json()["ranks"]}
                    with lock:
                        for other, refs in held.items():
                            if refs & gpus:
                                errors.append(f"{pid} got {sorted(refs & gpus)} that {other} holds")
                        held[pid] = gpus
                    mine.append(pid)
                elif answer.status_code != 409:
                    errors.append(f"POST {pid}: {answer.status_code} {answer.text}")
        finally:
            for c in clients:
                c.close()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []

    ledger = open_ledger(f"etcd:{url}")
    try:
        live = {r.id: r for r in ledger.reservations()}
        assert set(live) == set(held)  # every placement a client holds exists, and nothing else
        for pid, refs in held.items():
            assert set(live[pid].gpus) == refs
        owners: dict[str, str] = {}
        for r in live.values():
            for ref in r.gpus:
                assert ref not in owners, f"{ref} booked by {owners.get(ref)} and {r.id}"
                owners[ref] = r.id
        for account in ledger.accounts().values():
            assert account.reserved_bytes <= account.capacity_bytes
    finally:
        ledger.close()

    # every replica answers for every placement, whichever made it
    for server in replicas:
        for pid in held:
            assert server.client.get(f"/v1/placements/{pid}").status_code == 200
    check_replicas_agree(replicas, held)


def check_replicas_agree(replicas: list[Server], held: dict[str, set[str]]) -> None:
    for server in replicas:
        listed = {p["id"] for p in server.client.get("/v1/placements").json()["placements"]}
        assert listed == set(held)
        free = server.client.get("/v1/topology").json()["free"]
        assert free == 8 - sum(len(g) for g in held.values())
