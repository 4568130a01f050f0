"""Topology after a fault: the snapshot a DomainMap rebuild sees once a GPU has lost its NVLinks.

The simulator injects ``nvlink-down`` failures with it; a live deployment gets the same picture from
``nvidia-smi topo -m`` / NVML after the fault (the links show as PCIe hops), so the solver treats
both alike: the GPU leaves its NVLink domain and can still serve alone.
"""

from __future__ import annotations

from toposched.errors import InputError
from toposched.topology.model import Cluster, Health, LinkKind, nominal_link


def without_nvlink(cluster: Cluster, ref: str) -> Cluster:
    """``cluster`` with GPU ``ref`` (``node/index``) cut off NVLink: each of its NVLinks becomes the
    PCIe path its peers would take (NODE inside its NUMA node, SYS across), and it is marked degraded."""
    node_name, _, index_text = ref.rpartition("/")
    try:
        node = cluster.node(node_name)
        index = int(index_text)
        node.gpu(index)
    except (KeyError, ValueError):
        raise InputError(f"GPU {ref!r} is not in the cluster", fix="name a GPU as node/index") from None
    numa = {g.index: g.numa_node for g in node.gpus}
    links = []
    for link in node.links:
        if index in (link.a, link.b) and link.kind is LinkKind.NVLINK:
            same = numa[link.a] is not None and numa[link.a] == numa[link.b]
            kind = LinkKind.NODE if same else LinkKind.SYS
            bandwidth, latency = nominal_link(kind)
            link = link.model_copy(
                update={"kind": kind, "nvlinks": 0, "bandwidth_gbps": bandwidth, "latency_us": latency}
            )
        links.append(link)
    gpus = tuple(g.model_copy(update={"health": Health.DEGRADED}) if g.index == index else g for g in node.gpus)
    changed = node.model_copy(update={"links": tuple(links), "gpus": gpus})
    return cluster.model_copy(update={"nodes": tuple(changed if n.name == node_name else n for n in cluster.nodes)})
