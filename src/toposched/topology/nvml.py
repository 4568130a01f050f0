"""Live discovery through NVML (``nvidia-ml-py``, imported as ``pynvml``).

``probe_node(lib)`` reads one machine through an object with pynvml's function names. In
production ``lib`` is the real ``pynvml`` module; tests pass ``FakeNvml`` (``nvml_fake.py``), built
from captured outputs, so the code below is the same code that runs on a GPU machine.

What is read, per GPU: name, UUID, PCI bus id, total memory, NUMA node, CPU affinity, and for each
NVLink that is up, what sits at the other end. A link whose remote device is an NVSwitch means the
GPU reaches every other GPU on the same switch fabric: GPUs whose active links all end at switches
form one all-to-all domain. (Treating switch-attached links as "no peer", as NVIDIA's
go-gpuallocator does, loses every NVLink of an HGX board.) Links whose remote end is another GPU
are counted per peer, giving ``NV#`` lane counts like ``nvidia-smi topo -m``. PCIe pairs get the
common-ancestor level (``PIX``/``PXB``/``PHB``/``NODE``/``SYS``). The GPU fabric clique id
(GB200 multi-node NVLink) is reported so cluster specs can group nodes into cliques.

All NVML errors are translated here: no library or driver -> ``NoDriverError``; anything else on
the way -> ``DiscoveryError`` naming the call and the GPU.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from toposched.errors import DiscoveryError, InputError, NoDriverError
from toposched.names import node_name_problem
from toposched.topology.model import GPU, Health, Link, LinkKind, Node, nominal_link

T = TypeVar("T")

# NVML constants (nvml.h; identical values in pynvml), kept here so this module imports without
# the library present.
NVLINK_DEVICE_TYPE_GPU = 0
NVLINK_DEVICE_TYPE_SWITCH = 2
FEATURE_ENABLED = 1
MAX_LINKS = 18  # NVLink 4/5 GPUs expose 18 links (H100, B200); older ones fewer
_ANCESTOR_KIND = {
    0: LinkKind.PIX,  # NVML_TOPOLOGY_INTERNAL: same board (multi-GPU boards)
    10: LinkKind.PIX,  # NVML_TOPOLOGY_SINGLE
    20: LinkKind.PXB,  # NVML_TOPOLOGY_MULTIPLE
    30: LinkKind.PHB,  # NVML_TOPOLOGY_HOSTBRIDGE
    40: LinkKind.NODE,  # NVML_TOPOLOGY_NODE (== NVML_TOPOLOGY_CPU)
    50: LinkKind.SYS,  # NVML_TOPOLOGY_SYSTEM
}
_NO_DRIVER = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission")
_MISSING = (
    "NVMLError_NotSupported",
    "NVMLError_InvalidArgument",
    "NVMLError_FunctionNotFound",
    "NVMLError_NotFound",
)


@dataclass(frozen=True)
class NvmlProbe:
    """A probed node plus what NVML says about multi-node NVLink."""

    node: Node
    fabric_clique: str | None  # "clusterUuid/cliqueId" when the GPUs are in a multi-node NVLink fabric
    warnings: tuple[str, ...] = ()


def nvml_text(value: Any) -> str:
    """An NVML string as ``str``: pynvml returns ``bytes`` or ``str`` depending on its version."""
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_bus_id(value: Any) -> str:
    """A PCI bus id in NVML's 8-digit-domain upper-case form (``00000000:18:00.0``), whatever the
    pynvml version or the domain width, so ids from ``nvmlDeviceGetPciInfo`` and from a link's
    remote end compare equal."""
    bus = nvml_text(value).upper()
    if bus.count(":") == 1:
        bus = "00000000:" + bus
    domain, rest = bus.split(":", 1)
    return f"{int(domain, 16):08X}:{rest}"


def _cpulist(masks: list[int], word_bits: int = 64) -> str:
    cpus = [w * word_bits + b for w, mask in enumerate(masks) for b in range(word_bits) if mask >> b & 1]
    ranges: list[str] = []
    for cpu in cpus:
        if ranges and "-" in ranges[-1] and int(ranges[-1].split("-")[1]) == cpu - 1:
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{cpu}"
        elif ranges and "-" not in ranges[-1] and int(ranges[-1]) == cpu - 1:
            ranges[-1] = f"{ranges[-1]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


class NvmlSession:
    """NVML calls through ``lib`` (``pynvml`` or ``FakeNvml``) with errors translated in one place.

    Used by discovery here and by the sidecar's live checks, so both report a missing driver and a
    failed call the same way.
    """

    def __init__(self, lib: Any) -> None:
        self.lib = lib

    def call(self, what: str, fn: Callable[..., T], *args: Any, gpu: int | None = None) -> T:
        """``fn(*args)``; no driver -> ``NoDriverError``, any other failure -> ``DiscoveryError`` naming
        ``what`` and the GPU."""
        try:
            return fn(*args)
        except Exception as exc:
            name = type(exc).__name__
            if name in _NO_DRIVER:
                raise NoDriverError(
                    f"NVML is not usable on this machine ({exc}); no NVIDIA driver is loaded",
                    fix="run on a GPU node, or use --smi FILE / --preset NAME / --cluster FILE",
                ) from exc
            where = f" for GPU {gpu}" if gpu is not None else ""
            raise DiscoveryError(f"NVML {what}{where} failed: {exc}") from exc

    def optional(self, fn: Callable[..., T], *args: Any) -> T | None:
        """``fn(*args)``, or None when this GPU or driver does not support the call."""
        try:
            return fn(*args)
        except Exception as exc:
            if type(exc).__name__ in _MISSING:
                return None
            raise


FABRIC_STATE_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED: the GPU's fabric registration is done


def gpu_fabric(s: NvmlSession, handle: Any) -> tuple[str, int] | None:
    """(cluster UUID, clique id) of a GPU on a multi-node NVLink fabric whose registration completed; None
    when it is not on one, or the driver has no ``nvmlDeviceGetGpuFabricInfo``. nvidia-ml-py's call fills a
    ``c_nvmlGpuFabricInfo_t`` passed by reference (and returns only a status); its ``clusterUuid`` is 16
    raw bytes, written here as a UUID, as GPU feature discovery writes ``nvidia.com/gpu.clique``."""
    import ctypes
    import uuid

    import pynvml

    info = pynvml.c_nvmlGpuFabricInfo_t()
    if s.optional(s.lib.nvmlDeviceGetGpuFabricInfo, handle, ctypes.byref(info)) is None:
        return None
    if int(info.state) != FABRIC_STATE_COMPLETED:
        return None
    return str(uuid.UUID(bytes=bytes(info.clusterUuid))), int(info.cliqueId)


P2P_READ = 0  # NVML_P2P_CAPS_INDEX_READ (pynvml); what `nvidia-smi topo -p2p r` shows
P2P_OK, P2P_UNKNOWN = 0, 6  # NVML_P2P_STATUS_OK, NVML_P2P_STATUS_UNKNOWN; 1-5 are the refusals (CNS, GNS, TNS, DR, NS)


def _p2p(s: NvmlSession, a: Any, b: Any) -> bool | None:
    """Peer-to-peer reads both ways between two GPUs outside NVLink, as ``nvidia-smi topo -p2p r`` shows it:
    True when NVML says OK both ways, False when it refuses either way, None when it does not know (or the
    driver has no ``nvmlDeviceGetP2PStatus``)."""
    fn = getattr(s.lib, "nvmlDeviceGetP2PStatus", None)
    if fn is None:
        return None
    ways = [s.optional(fn, a, b, P2P_READ), s.optional(fn, b, a, P2P_READ)]
    if any(w is not None and int(w) not in (P2P_OK, P2P_UNKNOWN) for w in ways):
        return False
    return True if all(w is not None and int(w) == P2P_OK for w in ways) else None


def probe_node(lib: Any, *, hostname: str | None = None) -> NvmlProbe:
    """Read this machine's GPUs and links through ``lib`` (``pynvml`` or a fake with its names)."""
    s = NvmlSession(lib)
    s.call("init", lib.nvmlInit)
    try:
        name = hostname or socket.gethostname()
        problem = node_name_problem(name)
        if problem:
            raise InputError(
                f"this machine's {problem}",
                fix="give the machine a hostname such as 'gpu-node-01', or describe it in a cluster spec",
            )
        return _probe(s, name)
    finally:
        s.optional(lib.nvmlShutdown)


def _probe(s: NvmlSession, hostname: str) -> NvmlProbe:
    lib = s.lib
    count = s.call("device count", lib.nvmlDeviceGetCount)
    handles = [s.call("handle", lib.nvmlDeviceGetHandleByIndex, i, gpu=i) for i in range(count)]
    buses = [nvml_bus_id(s.call("PCI info", lib.nvmlDeviceGetPciInfo, h, gpu=i).busId) for i, h in enumerate(handles)]
    index_of_bus = {bus: i for i, bus in enumerate(buses)}
    gpus: list[GPU] = []
    warnings: list[str] = []
    cliques: set[str] = set()
    # NVML fills as many 64-bit words as asked and drops CPUs past them: ask for every CPU here.
    cpu_words = max(4, -(-(os.cpu_count() or 1) // 64))
    peers: dict[tuple[int, int], int] = {}
    switch_lanes: dict[int, int] = {}
    for i, h in enumerate(handles):
        name = nvml_text(s.call("name", lib.nvmlDeviceGetName, h, gpu=i))
        memory = s.call("memory info", lib.nvmlDeviceGetMemoryInfo, h, gpu=i)
        numa = s.optional(lib.nvmlDeviceGetNumaNodeId, h)
        masks = s.optional(lib.nvmlDeviceGetCpuAffinity, h, cpu_words)
        fabric = gpu_fabric(s, h)
        if fabric is not None and fabric[1] != 0:
            cliques.add(f"{fabric[0]}/{fabric[1]}")
        up = 0
        for link in range(MAX_LINKS):
            state = s.optional(lib.nvmlDeviceGetNvLinkState, h, link)
            if state is None:
                break
            if state != FEATURE_ENABLED:
                continue
            up += 1
            remote_type = s.optional(lib.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
            remote = s.call("NVLink remote PCI info", lib.nvmlDeviceGetNvLinkRemotePciInfo, h, link, gpu=i)
            if remote_type == NVLINK_DEVICE_TYPE_SWITCH:
                switch_lanes[i] = switch_lanes.get(i, 0) + 1
                continue
            peer = index_of_bus.get(nvml_bus_id(remote.busId))
            if peer is None:
                warnings.append(f"GPU {i} NVLink {link} ends at {nvml_bus_id(remote.busId)}, which is not a GPU here")
            elif peer != i:
                peers[(i, peer)] = peers.get((i, peer), 0) + 1
        gpus.append(
            GPU(
                index=i,
                uuid=nvml_text(s.call("UUID", lib.nvmlDeviceGetUUID, h, gpu=i)),
                pci_bus_id=buses[i],
                model=name,
                hbm_gib=round(int(memory.total) / 2**30, 2),
                numa_node=None if numa is None or int(numa) < 0 else int(numa),
                cpu_affinity=_cpulist([int(m) for m in masks]) if masks else None,
                health=Health.OK,
            )
        )
    links: list[Link] = []
    for a in range(count):
        for b in range(a + 1, count):
            model = gpus[a].model
            if a in switch_lanes and b in switch_lanes:
                # Both GPUs hang off the NVSwitch fabric: they reach each other at their own lane count.
                lanes = min(switch_lanes[a], switch_lanes[b])
                kind = LinkKind.NVLINK
            elif (a, b) in peers or (b, a) in peers:
                # A direct link is seen from both ends; count the lanes from the side that sees more.
                lanes = max(peers.get((a, b), 0), peers.get((b, a), 0))
                kind = LinkKind.NVLINK
            else:
                level = s.call(
                    "common ancestor",
                    s.lib.nvmlDeviceGetTopologyCommonAncestor,
                    handles[a],
                    handles[b],
                    gpu=a,
                )
                lanes, kind = 0, _ANCESTOR_KIND.get(int(level), LinkKind.SYS)
            bandwidth, latency = nominal_link(kind, lanes, model)
            p2p = None if kind is LinkKind.NVLINK else _p2p(s, handles[a], handles[b])
            links.append(
                Link(a=a, b=b, kind=kind, nvlinks=lanes, bandwidth_gbps=bandwidth, latency_us=latency, p2p=p2p)
            )
    full = max(switch_lanes.values(), default=0)
    for i, lanes_up in switch_lanes.items():
        if lanes_up < full:
            gpus[i] = gpus[i].model_copy(update={"health": Health.DEGRADED})
            warnings.append(f"GPU {i} has {lanes_up} of {full} NVLinks up to the NVSwitch fabric")
    if len(cliques) > 1:
        warnings.append(f"GPUs report {len(cliques)} different fabric cliques: {sorted(cliques)}")
    node = Node(
        name=hostname,
        gpus=tuple(gpus),
        links=tuple(links),
        nvswitch=bool(switch_lanes) or None,
        source="nvml",
    )
    return NvmlProbe(node=node, fabric_clique=min(cliques) if cliques else None, warnings=tuple(warnings))


def probe_live(*, hostname: str | None = None) -> NvmlProbe:
    """Probe this machine with the real ``pynvml``; ``NoDriverError`` when there is no driver."""
    try:
        import pynvml
    except ImportError as exc:  # the dependency is declared, so this is a broken install
        raise NoDriverError("the nvidia-ml-py package is not installed", fix="pip install nvidia-ml-py") from exc
    return probe_node(pynvml, hostname=hostname)
