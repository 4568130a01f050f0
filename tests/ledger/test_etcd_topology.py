"""DomainMap versions in etcd: cold start reads the newest; other replicas get new versions by watch."""

from __future__ import annotations

import json
import threading

import pytest

from toposched.errors import StateError
from toposched.ledger.etcd_client import ETCD_MAX_REQUEST_BYTES, delete_op, put_op
from toposched.ledger.etcd_topology import EtcdTopologyStore
from toposched.topology.domains import build_domain_map
from toposched.topology.model import SCHEMA_VERSION
from toposched.topology.presets import hgx_h100_cluster, load_preset
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


def test_a_cluster_over_etcds_request_limit_is_stored(etcd_url: str) -> None:
    cluster = hgx_h100_cluster(256)  # 2,048 GPUs (4,096 works the same, and takes twice as long to build)
    assert len(cluster.model_dump_json()) > ETCD_MAX_REQUEST_BYTES  # too large for one value
    store = EtcdTopologyStore(etcd_url)
    saved = store.save(cluster, SourceRef(kind="preset", ref="big"), now=1.0)
    cold = EtcdTopologyStore(etcd_url).latest()
    assert cold is not None and cold.version == saved.version == 1
    assert cold.cluster == cluster and cold.domain_map == saved.domain_map


def test_parts_are_checked_and_old_versions_still_read(etcd_url: str) -> None:
    store = EtcdTopologyStore(etcd_url, part_bytes=256)  # several parts even for one node
    cluster = load_preset("hgx-h100")
    store.save(cluster, SourceRef(kind="preset", ref="hgx-h100"), now=1.0)
    manifest = json.loads(store.client.range(f"{store.prefix}v/000000000001")[0][0].value)
    parts, _rev = store.client.range(f"{store.prefix}blob/{manifest['blob']}/", prefix=True)
    assert manifest["parts"] == len(parts) > 2
    latest = store.latest()
    assert latest is not None and latest.cluster == cluster
    store.client.txn([], [delete_op(parts[1].key)])
    with pytest.raises(StateError, match="version 1 is damaged"):
        store.latest()

    # a version stored whole in v/N, as before parts existed
    old = {
        "created_at": 5.0,
        "schema_version": SCHEMA_VERSION,
        "source": SourceRef(kind="preset", ref="hgx-h100").model_dump(mode="json"),
        "cluster": cluster.model_dump(mode="json"),
        "domain_map": build_domain_map(cluster).model_dump(mode="json"),
    }
    store.client.txn(
        [], [put_op(f"{store.prefix}v/000000000002", json.dumps(old)), put_op(f"{store.prefix}latest", "2")]
    )
    latest = store.latest()
    assert latest is not None and latest.version == 2 and latest.cluster == cluster and latest.created_at == 5.0
    assert [v for v, _at, _src in store.versions()] == [1, 2]
