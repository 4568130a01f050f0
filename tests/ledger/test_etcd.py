"""etcd specifics: outages give clear errors and lose nothing; changes reach other replicas by watch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ledger.conftest import EtcdServer, free_port
from toposched.errors import StateError
from toposched.ledger import open_ledger
from toposched.ledger.base import GIB, AuditEntry
from toposched.ledger.etcd import EtcdLedger
from toposched.ledger.stress import StressConfig, run_stress


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, which it may stop and start."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


def test_unreachable_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    ledger = open_ledger(f"etcd:{url}")
    with pytest.raises(StateError) as caught:
        ledger.accounts()
    assert f"etcd at {url} is unreachable" in caught.value.message
    assert caught.value.fix and "start etcd" in caught.value.fix


def test_restart_loses_and_duplicates_nothing(own_etcd: EtcdServer) -> None:
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


def test_stress_through_a_restart(own_etcd: EtcdServer) -> None:
    def bounce() -> None:
        time.sleep(0.4)
        own_etcd.stop()
        time.sleep(1.0)
        own_etcd.start()

    thread = threading.Thread(target=bounce)
    thread.start()
    result = run_stress(StressConfig(url=f"etcd:{own_etcd.url}", clients=3, ops=900, retry_s=30))
    thread.join()
    assert result["double_bookings"] == 0 and result["lost"] == 0
    assert result["retried"] > 0  # the clients did see the outage and came through it


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
