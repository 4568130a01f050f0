"""Both DomainMap store backends behave as one ``DomainMapStore``: the same calls, the same answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from toposched.ledger.etcd_topology import EtcdTopologyStore
from toposched.topology.presets import load_preset
from toposched.topology.sources import SourceRef
from toposched.topology.store import DomainMapStore, TopologyStore


@pytest.fixture(params=["sqlite", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DomainMapStore]:
    # typed as the Protocol: mypy checks that each backend's signatures match it
    made: DomainMapStore
    if request.param == "sqlite":
        made = TopologyStore(tmp_path / "state.sqlite3")
    else:
        made = EtcdTopologyStore(request.getfixturevalue("etcd_url"))
    try:
        yield made
    finally:
        made.close()


def test_an_empty_store_has_no_version(store: DomainMapStore) -> None:
    assert store.latest() is None
    assert store.latest_version() is None
    assert store.versions() == []


def test_saves_number_versions_and_the_newest_reads_back(store: DomainMapStore) -> None:
    first = store.save(load_preset("hgx-h100"), SourceRef(kind="preset", ref="hgx-h100"), now=1000.0)
    second = store.save(load_preset("dgx1-v100"), SourceRef(kind="preset", ref="dgx1-v100"), now=2000.0)
    assert (first.version, second.version) == (1, 2)
    assert store.latest_version() == 2
    latest = store.latest()
    assert latest is not None
    assert (latest.version, latest.created_at) == (2, 2000.0)
    assert latest.cluster == load_preset("dgx1-v100")
    assert latest.domain_map == second.domain_map
    assert latest.source.describe() == "preset:dgx1-v100"
    assert store.versions() == [(1, 1000.0, "preset:hgx-h100"), (2, 2000.0, "preset:dgx1-v100")]
