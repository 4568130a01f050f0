"""Topology sources: where a ``Cluster`` snapshot comes from.

One registry of named sources (``smi``, ``preset``, ``cluster``, ``live``); each turns a reference
(a file path, a preset name, nothing for live) into a ``Cluster`` plus warnings. A ``SourceRef`` is
stored with every DomainMap version, so ``toposched topo refresh`` can probe the same source again.

A one-node source may come with an ``nvidia-smi topo -p2p r`` capture (``SourceRef.p2p``, the CLI's
``--p2p FILE``): its per-pair peer-to-peer status is put on the node's links (``topology/p2p.py``),
which decides the all-reduce table of a TP group on a PCIe-only node. A cluster spec gives it per
node instead (``p2p:`` / ``p2p_file:``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from toposched.errors import InputError
from toposched.inputs import read_text
from toposched.registry import Registry
from toposched.topology.model import Cluster
from toposched.topology.nvml import probe_live
from toposched.topology.p2p import apply_p2p, read_p2p_file
from toposched.topology.presets import load_preset
from toposched.topology.smi import parse_topo_matrix
from toposched.topology.spec import load_cluster_spec

SourceKind = Literal["smi", "preset", "cluster", "live"]

MAX_SMI_BYTES = 4 * 1024 * 1024
"""Largest ``nvidia-smi topo -m`` capture read (a real one is a few kB; a 16-GPU, 10-NIC one ~5 kB)."""


class SourceRef(BaseModel):
    """Which source, and its argument (a path or preset name; empty for live)."""

    model_config = ConfigDict(frozen=True)

    kind: SourceKind
    ref: str = ""
    p2p: str = ""
    """Path of an ``nvidia-smi topo -p2p r`` capture for the source's one node; empty for none."""

    def describe(self) -> str:
        base = f"{self.kind}:{self.ref}" if self.ref else self.kind
        return f"{base} + p2p:{self.p2p}" if self.p2p else base


@dataclass(frozen=True)
class Loaded:
    cluster: Cluster
    source: SourceRef
    warnings: tuple[str, ...] = ()


def _smi(ref: str) -> Loaded:
    if "\x00" in ref:  # os.open would raise ValueError
        raise InputError(f"topology file {ref[:200]!r}: a path cannot contain a NUL byte", fix="check the path")
    path = Path(ref)
    text = read_text(
        ref, what="topology file", max_bytes=MAX_SMI_BYTES, special_fix="save it first: `nvidia-smi topo -m > topo.txt`"
    )
    # the node is labelled with the path the source reference keeps (resolved), so loading the stored
    # reference again (`topo refresh`) gives the same snapshot even when the path went through a symlink
    resolved = str(path.resolve())
    result = parse_topo_matrix(text, source=resolved, hostname=None)
    name = path.stem if result.node.name == "localhost" else result.node.name
    cluster = Cluster(name=name, nodes=(result.node,))
    return Loaded(cluster, SourceRef(kind="smi", ref=resolved), result.warnings)


def _preset(ref: str) -> Loaded:
    return Loaded(load_preset(ref), SourceRef(kind="preset", ref=ref.lower()))


def _cluster(ref: str) -> Loaded:
    warnings: list[str] = []  # e.g. a node's smi capture with a cut NIC legend
    cluster = load_cluster_spec(ref, warnings=warnings)
    return Loaded(cluster, SourceRef(kind="cluster", ref=str(Path(ref).resolve())), tuple(warnings))


def _live(ref: str) -> Loaded:
    probe = probe_live(hostname=ref or None)
    return Loaded(Cluster(name=probe.node.name, nodes=(probe.node,)), SourceRef(kind="live", ref=ref), probe.warnings)


_SOURCES: Registry[Callable[[str], Loaded]] = Registry("topology source")


def register_source(kind: str, load: Callable[[str], Loaded]) -> None:
    _SOURCES.register(kind, load)


for _kind, _load in (("smi", _smi), ("preset", _preset), ("cluster", _cluster), ("live", _live)):
    register_source(_kind, _load)


def load_source(ref: SourceRef) -> Loaded:
    """Load a cluster snapshot from a source reference (with its P2P capture, if it names one)."""
    loaded = _SOURCES.get(ref.kind)(ref.ref)
    return with_p2p(loaded, ref.p2p) if ref.p2p else loaded


def with_p2p(loaded: Loaded, path: str) -> Loaded:
    """``loaded`` with the P2P capture at ``path`` applied to its one node (``InputError`` for a
    cluster of several nodes: a cluster spec names a capture per node)."""
    if len(loaded.cluster.nodes) != 1:
        raise InputError(
            f"a P2P capture describes one node, but {loaded.source.describe()} has {len(loaded.cluster.nodes)}",
            fix="give it per node in a cluster spec (p2p_file: FILE, or p2p: on|off)",
        )
    matrix = read_p2p_file(path)
    node = apply_p2p(loaded.cluster.nodes[0], matrix)
    cluster = loaded.cluster.model_copy(update={"nodes": (node,)})
    resolved = str(Path(path).resolve())
    return Loaded(cluster, loaded.source.model_copy(update={"p2p": resolved}), loaded.warnings)
