"""``build_domain_map`` computes a node's NVLink domains once per node shape and groups NIC paths per GPU
(issue 17's build); the map must be what the plain per-node computation gives, field for field.

``reference_node_domains`` and ``reference_nearest`` are that plain computation (the code before the
shapes were kept), compared on every preset and on random nodes: random NVLink graphs with random lane
counts, GPU indices up to 20 (cliques of ``node/10`` and ``node/2`` sort as text), every NVSwitch flag,
NIC paths in random order.
"""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toposched.topology.domains import (
    DomainKind,
    NVLinkDomain,
    _components,
    _domain_shapes,
    _maximal_cliques,
    build_domain_map,
    gpu_ref,
)
from toposched.topology.model import GPU, Cluster, Link, LinkKind, NicLink, Node
from toposched.topology.presets import load_preset, preset_names

SETTINGS = settings(
    max_examples=int(os.environ.get("TOPOSCHED_HYPOTHESIS_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def reference_node_domains(node: Node) -> list[NVLinkDomain]:
    nv_links = [link for link in node.links if link.kind is LinkKind.NVLINK]
    members = sorted({i for link in nv_links for i in (link.a, link.b)})
    domains = []
    for n, component in enumerate(c for c in _components(members, [(x.a, x.b) for x in nv_links]) if len(c) > 1):
        inside = set(component)
        adjacency: dict[int, set[int]] = {v: set() for v in component}
        lanes = []
        for link in nv_links:
            if link.a in inside:
                adjacency[link.a].add(link.b)
                adjacency[link.b].add(link.a)
                lanes.append(link.nvlinks)
        cliques = sorted(
            (tuple(gpu_ref(node.name, i) for i in sorted(c)) for c in _maximal_cliques(adjacency) if len(c) > 1),
            key=lambda c: (-len(c), c),
        )
        full = len(cliques) == 1 and len(cliques[0]) == len(component)
        if len(component) == 2:
            kind: DomainKind = "bridge" if node.nvswitch is not True else "nvswitch"
        elif full and node.nvswitch is not False:
            kind = "nvswitch" if node.nvswitch or len(component) > 4 else "mesh"
        else:
            kind = "mesh"
        domains.append(
            NVLinkDomain(
                id=f"{node.name}/nv{n}",
                kind=kind,
                nodes=(node.name,),
                gpus=tuple(gpu_ref(node.name, i) for i in component),
                cliques=tuple(cliques),
                min_nvlinks=min(lanes),
            )
        )
    return domains


def reference_nearest(node: Node) -> dict[str, tuple[str, ...]]:
    nearest = {}
    for gpu in node.gpus:
        paths = [nl for nl in node.nic_links if nl.gpu == gpu.index]
        if paths:
            best = min(nl.kind.rank for nl in paths)
            nearest[gpu_ref(node.name, gpu.index)] = tuple(nl.nic for nl in paths if nl.kind.rank == best)
    return nearest


def expected(cluster: Cluster) -> tuple[list[NVLinkDomain], dict[str, tuple[str, ...]]]:
    in_clique = {node for clique in cluster.cliques for node in clique.nodes}
    domains = [d for n in cluster.nodes if n.name not in in_clique for d in reference_node_domains(n)]
    nearest = {ref: nics for n in cluster.nodes for ref, nics in reference_nearest(n).items()}
    return domains, nearest


def test_every_preset_maps_as_the_plain_computation() -> None:
    for name in preset_names():
        cluster = load_preset(name)
        domains, nearest = expected(cluster)
        dmap = build_domain_map(cluster)
        assert [d for d in dmap.domains if d.kind != "mnnvl"] == domains, name
        assert dmap.nearest_nics == nearest, name


NIC_KINDS = [LinkKind.PIX, LinkKind.PXB, LinkKind.PHB, LinkKind.NODE, LinkKind.SYS]


@st.composite
def nodes(draw: st.DrawFn) -> Node:
    indices = sorted(draw(st.sets(st.integers(0, 20), min_size=2, max_size=12)))
    pairs = list(itertools.combinations(indices, 2))
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs))) if pairs else []
    links = tuple(
        Link(a=a, b=b, kind=LinkKind.NVLINK, nvlinks=draw(st.integers(1, 18)), bandwidth_gbps=25.0, latency_us=1.0)
        for a, b in chosen
    )
    nics = [f"NIC{k}" for k in range(draw(st.integers(0, 3)))]
    nic_links = draw(
        st.lists(
            st.builds(
                NicLink, gpu=st.sampled_from(indices), nic=st.sampled_from(nics), kind=st.sampled_from(NIC_KINDS)
            ),
            max_size=3 * len(indices),
        )
        if nics
        else st.just([])
    )
    return Node(
        name=draw(st.sampled_from(["a", "node-7", "gpu-0001"])),
        nvswitch=draw(st.sampled_from([None, True, False])),
        gpus=tuple(GPU(index=i) for i in indices),
        links=links,
        nic_links=tuple(nic_links),
    )


@SETTINGS
@given(nodes())
def test_random_nodes_map_as_the_plain_computation(node: Node) -> None:
    cluster = Cluster(name="c", nodes=(node,))
    domains, nearest = expected(cluster)
    dmap = build_domain_map(cluster)
    assert list(dmap.domains) == domains
    assert dmap.nearest_nics == nearest
    assert dmap.gpu_domain == {
        gpu_ref(node.name, g.index): next((d.id for d in domains if gpu_ref(node.name, g.index) in d.gpus), None)
        for g in node.gpus
    }


def test_nodes_of_one_shape_share_one_computation() -> None:
    _domain_shapes.cache_clear()
    node = load_preset("hgx-h100").nodes[0]
    cluster = Cluster(name="c", nodes=tuple(node.model_copy(update={"name": f"n{i}"}) for i in range(64)))
    dmap = build_domain_map(cluster)
    info = _domain_shapes.cache_info()
    assert (info.misses, info.hits) == (1, 63)
    assert len(dmap.domains) == 64 and {d.gpus[0] for d in dmap.domains} == {f"n{i}/0" for i in range(64)}


def test_the_cluster_digest_is_computed_once_per_cluster_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan`` needs the digest twice (the DomainMap's fingerprint, the plan's cluster summary): the second
    comes from the first; an equal cluster built again gets the same digest, a changed one another."""
    import hashlib

    from toposched.binding.plan_schema import ClusterSummary
    from toposched.topology import domains

    cluster = load_preset("hgx-h100")
    dumps: list[int] = []
    real = Cluster.model_dump_json

    def counting(self: Cluster, **kwargs: object) -> str:
        dumps.append(1)
        return real(self, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Cluster, "model_dump_json", counting)
    monkeypatch.setattr(domains, "_LAST_DIGEST", None)
    dmap = build_domain_map(cluster)
    summary = ClusterSummary.of(cluster)
    assert len(dumps) == 1
    expected = hashlib.sha256(real(cluster).encode()).hexdigest()
    assert summary.sha256 == expected and dmap.cluster_fingerprint == expected[:16]
    again = load_preset("hgx-h100")
    assert again is not cluster and domains.cluster_digest(again) == expected and len(dumps) == 2
    renamed = cluster.model_copy(update={"name": "other"})
    assert domains.cluster_digest(renamed) != expected
