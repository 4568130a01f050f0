"""DomainMap versions in etcd: cold start reads the newest; other replicas get new versions by watch."""

from __future__ import annotations

import threading

from toposched.ledger.etcd_topology import EtcdTopologyStore
from toposched.topology.presets import load_preset
from toposched.topology.sources import SourceRef
from toposched.topology.store import StoredTopology


def test_versions_latest_and_watch(etcd_url: str) -> None:
    first, second = EtcdTopologyStore(etcd_url), EtcdTopologyStore(etcd_url)
    assert first.latest() is None and first.versions() == []
    cluster = load_preset("hgx-h100")
    v1 = first.save(cluster, SourceRef(kind="preset", ref="hgx-h100"), now=100.0)
    cold = second.latest()  # a replica starting cold loads it instead of probing
    assert cold is not None and cold.version == v1.version == 1
    assert cold.cluster == cluster and cold.domain_map == v1.domain_map and cold.created_at == 100.0
    seen: list[StoredTopology] = []

    def follow() -> None:
        for stored in second.watch(since=1):
            seen.append(stored)
            return

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    v2 = first.save(cluster, SourceRef(kind="preset", ref="hgx-h100"), now=200.0)
    thread.join(5)
    assert [s.version for s in seen] == [v2.version] == [2]
    assert second.versions() == [(1, 100.0, "preset:hgx-h100"), (2, 200.0, "preset:hgx-h100")]
    latest = second.latest()
    assert latest is not None and latest.version == 2
