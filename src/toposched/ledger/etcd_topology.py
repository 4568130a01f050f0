"""DomainMap versions in etcd, for scheduler replicas: the same methods as ``topology.store.TopologyStore``.

Keys, under ``/NAMESPACE/topology/``: ``v/000000000001`` ... one per version (JSON: time, schema, source,
cluster, DomainMap) and ``latest`` (the newest version number). ``save`` writes version N+1 and moves
``latest`` in one transaction guarded by ``latest``'s revision, so two replicas refreshing at once get
two distinct versions, never one overwritten. A replica starting cold calls ``latest()`` instead of
probing; ``watch()`` yields every newer version as another replica saves it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from toposched.errors import StateError
from toposched.ledger.etcd import split_url
from toposched.ledger.etcd_client import EtcdClient, KeyValue, mod_equals, put_op
from toposched.topology.domains import DomainMap, build_domain_map
from toposched.topology.model import SCHEMA_VERSION, Cluster
from toposched.topology.sources import SourceRef
from toposched.topology.store import StoredTopology

MAX_ATTEMPTS = 50


class EtcdTopologyStore:
    """DomainMap versions in etcd (``http://HOST:PORT[/NAMESPACE]``). The constructor does no I/O."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        endpoint, namespace = split_url(url)
        self.client = EtcdClient(endpoint, timeout_s=timeout_s)
        self.prefix = f"/{namespace}/topology/"

    def _version_key(self, version: int) -> str:
        return f"{self.prefix}v/{version:012d}"

    def _decode(self, kv: KeyValue) -> StoredTopology:
        version = int(kv.key.rsplit("/", 1)[1])
        data: dict[str, Any] = json.loads(kv.value)
        if data.get("schema_version") != SCHEMA_VERSION:
            raise StateError(
                f"etcd {self.client.endpoint}: DomainMap version {version} has schema {data.get('schema_version')}; "
                f"this toposched reads {SCHEMA_VERSION}",
                fix="run `toposched topo refresh` to store a current version",
            )
        try:
            return StoredTopology(
                version=version,
                created_at=float(data["created_at"]),
                source=SourceRef.model_validate(data["source"]),
                cluster=Cluster.model_validate(data["cluster"]),
                domain_map=DomainMap.model_validate(data["domain_map"]),
            )
        except (ValidationError, KeyError) as exc:
            raise StateError(
                f"etcd {self.client.endpoint}: stored DomainMap version {version} is damaged ({exc})",
                fix="run `toposched topo refresh` to store a new version",
            ) from exc

    def save(self, cluster: Cluster, source: SourceRef, *, now: float | None = None) -> StoredTopology:
        """Store a new version (the newest + 1); returns it with its version number."""
        domain_map = build_domain_map(cluster)
        created = time.time() if now is None else now
        body = {
            "created_at": created,
            "schema_version": SCHEMA_VERSION,
            "source": source.model_dump(mode="json"),
            "cluster": cluster.model_dump(mode="json"),
            "domain_map": domain_map.model_dump(mode="json"),
        }
        value = json.dumps(body)
        for _attempt in range(MAX_ATTEMPTS):
            kvs, _rev = self.client.range(f"{self.prefix}latest")
            current, revision = (int(kvs[0].value), kvs[0].mod_revision) if kvs else (0, 0)
            version = current + 1
            success = [put_op(self._version_key(version), value), put_op(f"{self.prefix}latest", str(version))]
            if self.client.txn([mod_equals(f"{self.prefix}latest", revision)], success)[0]:
                return StoredTopology(version, created, source, cluster, domain_map)
        raise StateError(f"etcd {self.client.endpoint}: lost {MAX_ATTEMPTS} races saving a DomainMap")

    def latest(self) -> StoredTopology | None:
        """The newest stored version, or None when nothing was stored yet."""
        kvs, _rev = self.client.range(f"{self.prefix}latest")
        if not kvs:
            return None
        found, _rev = self.client.range(self._version_key(int(kvs[0].value)))
        return self._decode(found[0]) if found else None

    def versions(self) -> list[tuple[int, float, str]]:
        """(version, created_at, source) of every stored version, oldest first."""
        kvs, _rev = self.client.range(f"{self.prefix}v/", prefix=True)
        out = []
        for kv in kvs:
            data = json.loads(kv.value)
            source = SourceRef.model_validate(data["source"]).describe()
            out.append((int(kv.key.rsplit("/", 1)[1]), float(data["created_at"]), source))
        return sorted(out)

    def watch(self, *, since: int = 0) -> Iterator[StoredTopology]:
        """Every version newer than ``since``: those stored already, then each one as it is saved.

        Runs until the caller stops iterating; raises ``StateError`` when etcd goes away (call it
        again with the last version seen).
        """
        kvs, revision = self.client.range(f"{self.prefix}v/", prefix=True)
        for kv in sorted(kvs, key=lambda kv: kv.key):
            stored = self._decode(kv)
            if stored.version > since:
                since = stored.version
                yield stored
        for event in self.client.watch(f"{self.prefix}v/", prefix=True, start_revision=revision + 1):
            if event.kind == "PUT":
                stored = self._decode(event.kv)
                if stored.version > since:
                    since = stored.version
                    yield stored

    def close(self) -> None:
        self.client.close()
