"""KV-cache transfer time of a disaggregated deployment: a prompt's KV bytes over the links between
where they were computed (a prefill instance) and where they are read (a decode instance or a store).

A transfer is a set of **flows**, one per pair of *lanes*: a lane is one rank of an instance (its GPU
and the RDMA NIC it moves KV through, ``Placement.kv_nics``) or one RDMA NIC of a KV-cache store
(host memory, no GPU). When both sides have as many lanes, lane ``i`` sends to lane ``i`` (the same
TP rank holds the same KV heads); otherwise every sending lane sends each receiving lane an equal
part of what it needs (a TP re-shard). What a lane receives per token is given by the caller:
a decode rank its KV shard (``rank_kv_bytes_per_token``: the memory model's KV heads per rank,
replicated when TP exceeds the KV heads, in the placement's KV dtype), a store the model's whole KV
(``kv_bytes_per_token``) spread over its NICs.

Each flow loads **resources**, each with a bandwidth (GB/s, one direction):

==================  ==========================================  =========================================
where               resources                                   bandwidth (``perf/links.py``)
==================  ==========================================  =========================================
same node, GPUs     sender GPU tx, receiver GPU rx              ``p2p_bandwidth_gbps`` of the GPU's native
                                                                link (NVLink 4: 396 GB/s; PCIe-only boxes:
                                                                their PCIe link)
same node, store    the GPU's PCIe link to host memory          ``p2p_bandwidth_gbps`` of the box's PCIe
                                                                generation (Gen5: 55.4 GB/s, H200 measured)
other node          sender NIC tx, receiver NIC rx              ``p2p_bandwidth_gbps`` of the fabric's
                                                                link (NDR: 36 GB/s, Vidur's cross-node
                                                                send/recv)
other rack          + sender rack uplink, receiver rack         the rack's NICs x their bandwidth /
                    downlink                                    ``oversubscription``
==================  ==========================================  =========================================

The transfer takes ``latency + max over resources (bytes on it / its bandwidth)``: the most loaded
resource decides (ranks that share a NIC add up on it). Latency: the link's ``p2p_alpha_us`` (10 µs
in a node, 17 µs between nodes: Vidur's 2 KiB send/recv), plus ``spine_latency_us`` across racks.

**Assumptions** (the topology does not say): the fabric is a two-tier leaf/spine tree with one leaf
switch per rack; ``oversubscription`` is the rack's NIC bandwidth over its uplink bandwidth, 1.0
(non-blocking, the usual rail-optimised AI fabric) unless the caller gives another; crossing racks
adds the fabric's latency (``Fabric.latency_us``, 5 µs by default) for the leaf-spine-leaf detour.
Nodes without a rack label share one leaf. GPUDirect RDMA is assumed (GPU to NIC through the PCIe
switch, not host memory); the GPU-to-NIC PCIe hop is faster than the NIC and is not a resource.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from toposched.errors import InputError
from toposched.perf.hardware import GpuSpec
from toposched.perf.links import LinkSpec, get_link
from toposched.workload.dtypes import KvDtype, kv_element_bytes
from toposched.workload.memory import kv_heads_per_rank
from toposched.workload.spec import ModelSpec

Scope = Literal["same-node", "same-rack", "cross-rack"]
SCOPES: tuple[Scope, ...] = ("same-node", "same-rack", "cross-rack")
"""Transfer scopes, nearest first."""


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: KvDtype | None = None) -> int:
    """KV bytes one prompt token costs for the whole model (all layers, all KV heads) in ``kv_dtype``."""
    return spec.kv_bytes_per_token(kv_element_bytes(kv_dtype or spec.kv_dtype, spec.activation_dtype))


def rank_kv_bytes_per_token(spec: ModelSpec, tp: int, layers: int, kv_dtype: KvDtype | None = None) -> float:
    """KV bytes per token one rank of a TP group holds for ``layers`` layers (its pipeline stage's):
    ``kv_heads_per_rank`` KV heads (replicated when ``tp`` exceeds the KV heads; MLA's latent whole)."""
    elem = kv_element_bytes(kv_dtype or spec.kv_dtype, spec.activation_dtype)
    return float(kv_heads_per_rank(spec, tp) * spec.kv_state_dims * elem * layers)


@dataclass(frozen=True)
class KvLane:
    """One end of KV flows: a rank's GPU and its RDMA NIC, or (``gpu`` None) a store's NIC and host memory."""

    node: str
    rack: str | None
    nic: str
    gpu: int | None = None


@dataclass(frozen=True)
class KvLinks:
    """The links KV crosses, from ``perf/links.py``, and the fabric assumptions (module docstring)."""

    gpu: LinkSpec
    """Between two GPUs of one node (the box's native link)."""
    host: LinkSpec
    """Between a GPU and its node's host memory (the box's PCIe generation)."""
    net: LinkSpec
    """Between nodes, per NIC (the fabric's link)."""
    rack_uplink_gbps: dict[str, float] = field(default_factory=dict)
    """Per rack, GB/s of its uplink to the spine (each direction); a rack not listed: unlimited."""
    spine_latency_us: float = 5.0
    """Added across racks (leaf-spine-leaf)."""


def host_link_name(gpu: GpuSpec) -> str:
    """The link-table key of a GPU's PCIe link to host memory (as ``solver/place.py`` picks a PCIe link:
    the native link on PCIe-only boxes, Gen4 for A100, Gen5 for later SXM GPUs)."""
    if gpu.native_link.startswith("pcie"):
        return gpu.native_link
    return "pcie4" if gpu.name.startswith("A100") else "pcie5"


def kv_links(
    gpu: GpuSpec,
    net_link: str,
    rack_nics: dict[str, int] | None = None,
    *,
    oversubscription: float = 1.0,
    spine_latency_us: float = 5.0,
) -> KvLinks:
    """The links of a cluster of ``gpu`` boxes joined by ``net_link`` (``Fabric.perf_link``).

    ``rack_nics``: RDMA NICs per rack; a rack's uplink carries their bandwidth / ``oversubscription``.
    """
    if not 1.0 <= oversubscription <= 64.0:
        raise InputError(f"oversubscription must be from 1 to 64, got {oversubscription:g}", fix="1 is non-blocking")
    net = get_link(net_link)
    uplinks = {rack: n * net.p2p_bandwidth_gbps / oversubscription for rack, n in (rack_nics or {}).items()}
    return KvLinks(
        gpu=get_link(gpu.native_link),
        host=get_link(host_link_name(gpu)),
        net=net,
        rack_uplink_gbps=uplinks,
        spine_latency_us=spine_latency_us,
    )


Resource = tuple[str, str]
"""(kind, where): ``gpu-tx``/``gpu-rx`` node/gpu, ``pcie`` node/gpu, ``nic-tx``/``nic-rx`` node/nic,
``uplink``/``downlink`` rack."""


@dataclass(frozen=True)
class KvRoute:
    """The resources one KV transfer loads, bytes per prompt token on each, and its fixed latency."""

    scope: Scope
    latency_us: float
    loads: dict[Resource, float]
    """Bytes per prompt token each resource carries."""
    bandwidth_gbps: dict[Resource, float]
    bytes_per_token: float
    """What the whole transfer moves per prompt token."""

    def busy_ms(self, tokens: int) -> dict[Resource, float]:
        """Milliseconds each resource is busy for a prompt of ``tokens`` tokens."""
        return {r: b * tokens / (self.bandwidth_gbps[r] * 1e6) for r, b in self.loads.items()}

    def ms(self, tokens: int) -> float:
        """Transfer time of a prompt of ``tokens`` tokens on idle links: latency + the busiest resource."""
        if tokens <= 0:
            return 0.0
        return self.latency_us / 1000.0 + max(self.busy_ms(tokens).values(), default=0.0)


def _flows(src: Sequence[KvLane], dst: Sequence[KvLane], need: Sequence[float]) -> list[tuple[KvLane, KvLane, float]]:
    if len(src) == len(dst):
        return [(s, d, n) for s, d, n in zip(src, dst, need, strict=True)]
    return [(s, d, n / len(src)) for d, n in zip(dst, need, strict=True) for s in src]


def kv_route(src: Sequence[KvLane], dst: Sequence[KvLane], need: Sequence[float], links: KvLinks) -> KvRoute:
    """The route of KV from lanes ``src`` to lanes ``dst``, lane ``j`` of ``dst`` receiving ``need[j]``
    bytes per prompt token (see the module docstring for the rules)."""
    if not src or not dst or len(need) != len(dst):
        raise InputError(
            f"a KV route needs lanes on both sides and one need per receiving lane ({len(need)}/{len(dst)})"
        )
    loads: dict[Resource, float] = {}
    bandwidth: dict[Resource, float] = {}
    worst = 0
    latency = 0.0

    def load(resource: Resource, nbytes: float, gbps: float) -> None:
        loads[resource] = loads.get(resource, 0.0) + nbytes
        bandwidth[resource] = gbps

    for s, d, nbytes in _flows(src, dst, need):
        if s.node == d.node:
            if s.gpu is not None and d.gpu is not None:
                if s.gpu != d.gpu:
                    load(("gpu-tx", f"{s.node}/{s.gpu}"), nbytes, links.gpu.p2p_bandwidth_gbps)
                    load(("gpu-rx", f"{d.node}/{d.gpu}"), nbytes, links.gpu.p2p_bandwidth_gbps)
                latency = max(latency, links.gpu.p2p_alpha_us)
            else:  # GPU <-> host memory of the same node (a store's segment)
                gpu = s.gpu if s.gpu is not None else d.gpu
                if gpu is not None:
                    load(("pcie", f"{s.node}/{gpu}"), nbytes, links.host.p2p_bandwidth_gbps)
                latency = max(latency, links.host.p2p_alpha_us)
            continue
        load(("nic-tx", f"{s.node}/{s.nic}"), nbytes, links.net.p2p_bandwidth_gbps)
        load(("nic-rx", f"{d.node}/{d.nic}"), nbytes, links.net.p2p_bandwidth_gbps)
        cross = s.rack is not None and d.rack is not None and s.rack != d.rack
        latency = max(latency, links.net.p2p_alpha_us + (links.spine_latency_us if cross else 0.0))
        worst = max(worst, 2 if cross else 1)
        if cross:
            for kind, rack in (("uplink", s.rack), ("downlink", d.rack)):
                assert rack is not None
                gbps = links.rack_uplink_gbps.get(rack)
                if gbps is not None:
                    load((kind, rack), nbytes, gbps)
    return KvRoute(SCOPES[worst], latency, loads, bandwidth, float(sum(need)))


def kv_transfer_ms(route: KvRoute, tokens: int) -> float:
    """Milliseconds to move the KV of a ``tokens``-token prompt along ``route`` on idle links."""
    return route.ms(tokens)


__all__ = [
    "SCOPES",
    "KvLane",
    "KvLinks",
    "KvRoute",
    "Resource",
    "Scope",
    "host_link_name",
    "kv_bytes_per_token",
    "kv_links",
    "kv_route",
    "kv_transfer_ms",
    "rank_kv_bytes_per_token",
]
