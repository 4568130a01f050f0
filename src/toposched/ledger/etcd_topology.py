"""DomainMap versions in etcd, for scheduler replicas: the etcd backend of ``topology.store.DomainMapStore``.

Keys, under ``/NAMESPACE/topology/``:

    v/000000000001     one per version: a small manifest (time, schema, source, and where the body is)
    blob/UUID/0000     the body (cluster and DomainMap, JSON compressed with zlib) in parts of 512 KiB
    latest             the newest version number

A 4,096-GPU cluster is about 4.5 MB of JSON, over etcd's default request limit (1.5 MiB); compressed it
is about 100 kB, and the parts keep any size within the limit. ``save`` writes the parts first, each
part in its own transaction, under a fresh UUID no one else writes; then version N+1 and ``latest``
in one transaction guarded by ``latest``'s revision, so two replicas refreshing at once get two
distinct versions, never one overwritten, and a reader never sees a version before all its parts
exist. (A save that dies between the two leaves parts no version names; they are never read.) A
replica starting cold calls ``latest()`` instead of probing; ``watch()`` yields every newer version
as another replica saves it. Versions written before parts existed (the whole body in ``v/N``) are
still read.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from toposched.errors import StateError
from toposched.ledger.etcd_client import EtcdClient, KeyValue, delete_op, mod_equals, put_op
from toposched.ledger.etcd_keys import split_url
from toposched.topology.domains import DomainMap, build_domain_map
from toposched.topology.model import SCHEMA_VERSION, Cluster
from toposched.topology.sources import SourceRef
from toposched.topology.store import StoredTopology

MAX_ATTEMPTS = 50
PART_BYTES = 512 * 1024  # one part per transaction: well inside etcd's 1.5 MiB request limit
MAX_BODY_BYTES = 1024**3  # what a stored body may inflate to (a guard against a damaged value)


class EtcdTopologyStore:
    """DomainMap versions in etcd (``http://HOST:PORT[/NAMESPACE]``): a ``DomainMapStore`` plus ``watch``.
    The constructor does no I/O."""

    def __init__(self, url: str, *, timeout_s: float = 5.0, part_bytes: int = PART_BYTES) -> None:
        endpoint, namespace = split_url(url)
        self.client = EtcdClient(endpoint, timeout_s=timeout_s)
        self.prefix = f"/{namespace}/topology/"
        self.part_bytes = part_bytes

    def _version_key(self, version: int) -> str:
        return f"{self.prefix}v/{version:012d}"

    def _blob(self, blob: str) -> str:
        return f"{self.prefix}blob/{blob}/"

    def _damaged(self, version: int, problem: str) -> StateError:
        return StateError(
            f"etcd {self.client.endpoint}: stored DomainMap version {version} is damaged ({problem})",
            fix="run `toposched topo refresh` to store a new version",
        )

    def _manifest(self, kv: KeyValue) -> tuple[int, dict[str, Any]]:
        version = int(kv.key.rsplit("/", 1)[1])
        try:
            data = json.loads(kv.value)
        except ValueError as exc:
            raise self._damaged(version, f"not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise self._damaged(version, "not a JSON object")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise StateError(
                f"etcd {self.client.endpoint}: DomainMap version {version} has schema {data.get('schema_version')}; "
                f"this toposched reads {SCHEMA_VERSION}",
                fix="run `toposched topo refresh` to store a current version",
            )
        return version, data

    def _body(self, version: int, manifest: dict[str, Any]) -> dict[str, Any]:
        """The cluster and DomainMap of a version: inline (older versions) or from its parts."""
        if "blob" not in manifest:
            return manifest
        kvs, _rev = self.client.range(self._blob(str(manifest["blob"])), prefix=True)
        packed = b"".join(kv.value for kv in sorted(kvs, key=lambda kv: kv.key))
        if len(kvs) != manifest.get("parts") or hashlib.sha256(packed).hexdigest() != manifest.get("sha256"):
            raise self._damaged(version, f"{len(kvs)} of {manifest.get('parts')} parts, or a checksum mismatch")
        inflate = zlib.decompressobj()
        try:
            raw = inflate.decompress(packed, MAX_BODY_BYTES)
            body = json.loads(raw)
        except (zlib.error, ValueError) as exc:
            raise self._damaged(version, str(exc)) from exc
        if inflate.unconsumed_tail or not isinstance(body, dict):
            raise self._damaged(version, f"the body is not a JSON object under {MAX_BODY_BYTES} bytes")
        return body

    def _decode(self, kv: KeyValue) -> StoredTopology:
        version, manifest = self._manifest(kv)
        body = self._body(version, manifest)
        try:
            return StoredTopology(
                version=version,
                created_at=float(manifest["created_at"]),
                source=SourceRef.model_validate(manifest["source"]),
                cluster=Cluster.model_validate(body["cluster"]),
                domain_map=DomainMap.model_validate(body["domain_map"]),
            )
        except (ValidationError, KeyError, TypeError, ValueError) as exc:
            raise self._damaged(version, str(exc)) from exc

    def save(self, cluster: Cluster, source: SourceRef, *, now: float | None = None) -> StoredTopology:
        """Store a new version (the newest + 1); returns it with its version number."""
        domain_map = build_domain_map(cluster)
        created = time.time() if now is None else now
        body = {"cluster": cluster.model_dump(mode="json"), "domain_map": domain_map.model_dump(mode="json")}
        packed = zlib.compress(json.dumps(body).encode(), 6)
        blob = uuid.uuid4().hex
        parts = [packed[i : i + self.part_bytes] for i in range(0, len(packed), self.part_bytes)]
        for n, part in enumerate(parts):  # every part before the version that names them
            self.client.txn([], [put_op(f"{self._blob(blob)}{n:04d}", part)])
        manifest = {
            "created_at": created,
            "schema_version": SCHEMA_VERSION,
            "source": source.model_dump(mode="json"),
            "blob": blob,
            "parts": len(parts),
            "sha256": hashlib.sha256(packed).hexdigest(),
        }
        for _attempt in range(MAX_ATTEMPTS):
            kvs, _rev = self.client.range(f"{self.prefix}latest")
            current, revision = (int(kvs[0].value), kvs[0].mod_revision) if kvs else (0, 0)
            version = current + 1
            success = [
                put_op(self._version_key(version), json.dumps(manifest)),
                put_op(f"{self.prefix}latest", str(version)),
            ]
            if self.client.txn([mod_equals(f"{self.prefix}latest", revision)], success)[0]:
                return StoredTopology(version, created, source, cluster, domain_map)
        self.client.txn([], [delete_op(self._blob(blob), prefix=True)])
        raise StateError(f"etcd {self.client.endpoint}: lost {MAX_ATTEMPTS} races saving a DomainMap")

    def latest_version(self) -> int | None:
        """The newest stored version number (one small read, no blob), or None when empty."""
        kvs, _rev = self.client.range(f"{self.prefix}latest")
        return int(kvs[0].value) if kvs else None

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
            version, manifest = self._manifest(kv)
            try:
                source = SourceRef.model_validate(manifest["source"]).describe()
                out.append((version, float(manifest["created_at"]), source))
            except (ValidationError, KeyError, TypeError, ValueError) as exc:
                raise self._damaged(version, str(exc)) from exc
        return sorted(out)

    def watch(self, *, since: int = 0) -> Iterator[StoredTopology]:
        """Every version newer than ``since``: those stored already, then each one as it is saved.

        Runs until the caller stops iterating; raises ``StateError`` when etcd goes away (call it
        again with the last version seen).
        """
        kvs, revision = self.client.range(f"{self.prefix}v/", prefix=True)
        for kv in sorted(kvs, key=lambda kv: kv.key):
            if int(kv.key.rsplit("/", 1)[1]) > since:
                stored = self._decode(kv)
                since = stored.version
                yield stored
        for event in self.client.watch(f"{self.prefix}v/", prefix=True, start_revision=revision + 1):
            if event.kind == "PUT" and int(event.kv.key.rsplit("/", 1)[1]) > since:
                stored = self._decode(event.kv)
                since = stored.version
                yield stored

    def close(self) -> None:
        """Close the client's keep-alive connections."""
        self.client.close()
