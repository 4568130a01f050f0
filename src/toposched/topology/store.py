"""Where DomainMap versions are kept: one interface (``DomainMapStore``), two backends.

Each ``save`` writes a new version (monotonic integer) with the time, the source it was probed
from, the cluster snapshot and the DomainMap; older versions stay for audit. ``latest`` reads the
newest one, ``latest_version`` only its number (cheap enough to poll), ``versions`` lists them all.

Backends, chosen by the state URL (``--state``):

* ``sqlite:PATH`` -- ``TopologyStore`` below, in the embedded state file next to the ledger, opened
  through ``toposched.sqlite_file`` (WAL mode, so several processes on one host read while one
  writes). One transaction per save.
* ``etcd:URL`` -- ``ledger.etcd_topology.EtcdTopologyStore``, for scheduler replicas; it lives with
  the etcd client and adds ``watch()``.

Errors from either backend are ``StateError`` naming the file or endpoint.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from toposched import sqlite_file
from toposched.errors import StateError
from toposched.topology.domains import DomainMap, build_domain_map
from toposched.topology.model import SCHEMA_VERSION, Cluster
from toposched.topology.sources import SourceRef

_SCHEMA = """
CREATE TABLE IF NOT EXISTS domain_maps (
    version INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at REAL NOT NULL,
    schema_version INTEGER NOT NULL,
    source TEXT NOT NULL,
    cluster_json TEXT NOT NULL,
    domain_map_json TEXT NOT NULL
)
"""


@dataclass(frozen=True)
class StoredTopology:
    """One stored version: its number, when and from what it was saved, the cluster and its DomainMap."""

    version: int
    created_at: float
    source: SourceRef
    cluster: Cluster
    domain_map: DomainMap

    def age_s(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.created_at


class DomainMapStore(Protocol):
    """What the CLI and the service need of a DomainMap store; ``TopologyStore`` (SQLite) and
    ``EtcdTopologyStore`` (etcd) implement it, and tests/ledger/test_domain_map_store.py runs the
    same checks on both."""

    def save(self, cluster: Cluster, source: SourceRef, *, now: float | None = None) -> StoredTopology:
        """Store a new version (the newest + 1); returns it with its version number."""
        ...

    def latest(self) -> StoredTopology | None:
        """The newest stored version, or None when nothing was stored yet."""
        ...

    def latest_version(self) -> int | None:
        """The newest version number without reading the version itself, or None when empty."""
        ...

    def versions(self) -> list[tuple[int, float, str]]:
        """(version, created_at, source) of every stored version, oldest first."""
        ...

    def close(self) -> None:
        """Release connections (a no-op where every call opens its own)."""
        ...


class TopologyStore:
    """DomainMap versions in a SQLite file. The constructor does no I/O; each call opens the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """One transaction on the file (the table is created on first use)."""
        sqlite_file.prepare(self.path, what="state file")
        try:
            conn = sqlite_file.connect(self.path)
        except sqlite3.Error as exc:
            raise StateError(f"cannot open the state file {self.path}: {exc}") from exc
        try:
            sqlite_file.use_wal(conn)
            conn.execute("BEGIN")
            conn.execute(_SCHEMA)
            yield conn
            conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise StateError(
                f"the state file {self.path} is not usable: {exc}",
                fix="move it aside; `toposched topo refresh` writes a new one",
            ) from exc
        finally:
            conn.close()

    def save(self, cluster: Cluster, source: SourceRef, *, now: float | None = None) -> StoredTopology:
        """Store a new version; returns it with its version number."""
        domain_map = build_domain_map(cluster)
        created = time.time() if now is None else now
        with self._connect() as conn:
            cur = conn.execute(
                "INSERT INTO domain_maps (created_at, schema_version, source, cluster_json, domain_map_json) "
                "VALUES (?, ?, ?, ?, ?)",
                (
                    created,
                    SCHEMA_VERSION,
                    source.model_dump_json(),
                    cluster.model_dump_json(),
                    domain_map.model_dump_json(),
                ),
            )
            version = int(cur.lastrowid or 0)
        return StoredTopology(version, created, source, cluster, domain_map)

    def latest_version(self) -> int | None:
        """The newest stored version number (one indexed read, no parsing), or None when empty."""
        if not self.path.exists():
            return None
        with self._connect() as conn:
            row = conn.execute("SELECT MAX(version) FROM domain_maps").fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def latest(self) -> StoredTopology | None:
        """The newest stored version, or None when nothing was stored yet."""
        if not self.path.exists():
            return None
        with self._connect() as conn:
            row = conn.execute(
                "SELECT version, created_at, schema_version, source, cluster_json, domain_map_json "
                "FROM domain_maps ORDER BY version DESC LIMIT 1"
            ).fetchone()
        if row is None:
            return None
        version, created, schema, source, cluster_json, dm_json = row
        if schema != SCHEMA_VERSION:
            raise StateError(
                f"{self.path}: DomainMap version {version} has schema {schema}; this toposched reads {SCHEMA_VERSION}",
                fix="run `toposched topo refresh` to store a current version",
            )
        try:
            return StoredTopology(
                version=version,
                created_at=created,
                source=SourceRef.model_validate_json(source),
                cluster=Cluster.model_validate_json(cluster_json),
                domain_map=DomainMap.model_validate_json(dm_json),
            )
        except ValidationError as exc:
            raise StateError(
                f"{self.path}: stored DomainMap version {version} is damaged ({exc.error_count()} errors)",
                fix="run `toposched topo refresh` to store a new version",
            ) from exc

    def versions(self) -> list[tuple[int, float, str]]:
        """(version, created_at, source) of every stored version, oldest first."""
        if not self.path.exists():
            return []
        with self._connect() as conn:
            rows = conn.execute("SELECT version, created_at, source FROM domain_maps ORDER BY version").fetchall()
        return [(int(v), float(t), SourceRef.model_validate_json(s).describe()) for v, t, s in rows]

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own connection."""
