"""A fake NVML with pynvml's function names and error classes, for machines without a GPU.

``probe_node(FakeNvml(...))`` runs exactly the code that ``probe_node(pynvml)`` runs on a GPU node.
Fakes are built from captured outputs: a parsed ``nvidia-smi topo -m`` node (``from_node``) or
``nvidia-smi nvlink -s`` plus ``nvidia-smi nvlink -R`` text (``from_nvlink_text``). Errors are
pynvml's own exception classes, so the translation in ``nvml.py`` is exercised too.
"""

from __future__ import annotations

import re
import uuid as uuids
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from toposched.errors import InputError
from toposched.topology.model import LinkKind, Node
from toposched.topology.nvml import FEATURE_ENABLED, NVLINK_DEVICE_TYPE_GPU, NVLINK_DEVICE_TYPE_SWITCH

MAX_CPU = 65535
"""Highest CPU number a fake GPU's affinity may name (Linux allows at most 8,192 today)."""

_NVLINK_GPU = re.compile(r"GPU (\d+):")
_NVLINK_HEAD = re.compile(r"GPU \d+: (.+?) \(UUID: (GPU-[0-9a-f-]+)\)")  # matched where the GPU is named
_NVLINK_LINK = re.compile(r"Link \d+: (.+)$")
_NVLINK_REMOTE = re.compile(r"Remote Device ([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.\d)")

_LEVEL = {
    LinkKind.PIX: 10,
    LinkKind.PXB: 20,
    LinkKind.PHB: 30,
    LinkKind.NODE: 40,
    LinkKind.SYS: 50,
}


@dataclass
class FakeLink:
    up: bool
    remote_bus: str
    remote_type: int = NVLINK_DEVICE_TYPE_GPU


@dataclass
class FakeGpu:
    name: str
    uuid: str
    bus_id: str
    memory_bytes: int
    numa_node: int | None = None
    cpus: tuple[int, ...] = ()
    links: list[FakeLink] = field(default_factory=list)
    fabric: tuple[str, int] | None = None  # (cluster UUID as text, cliqueId)


def _error(code: int) -> Exception:
    error: Exception = pynvml.NVMLError(code)
    return error  # pynvml maps the code to its subclass, e.g. NVMLError_NotSupported


class FakeNvml:
    """The subset of pynvml that ``probe_node`` calls."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        ancestors: dict[tuple[int, int], int] | None = None,
        driver: bool = True,
        p2p: dict[tuple[int, int], int] | None = None,
    ) -> None:
        self.gpus = gpus
        self.ancestors = ancestors or {}
        self.p2p = p2p
        """NVML P2P read status per pair (both ways alike); None: the driver lacks the call (NotSupported)."""
        self.driver = driver
        self.initialised = False

    def nvmlInit(self) -> None:
        if not self.driver:
            raise _error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def _gpu(self, handle: int) -> FakeGpu:
        if not self.initialised:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        return self.gpus[handle]

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialised:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        return SimpleNamespace(busId=self._gpu(handle).bus_id.encode())

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        total = self._gpu(handle).memory_bytes
        return SimpleNamespace(total=total, free=total, used=0)

    def nvmlDeviceGetNumaNodeId(self, handle: int) -> int:
        numa = self._gpu(handle).numa_node
        if numa is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return numa

    def nvmlDeviceGetCpuAffinity(self, handle: int, words: int) -> list[int]:
        masks = [0] * words
        for cpu in self._gpu(handle).cpus:
            if cpu < 64 * words:  # like NVML: CPUs past the words asked for are not reported
                masks[cpu // 64] |= 1 << (cpu % 64)
        return masks

    def nvmlDeviceGetGpuFabricInfo(self, handle: int, info: Any) -> int:
        """As nvidia-ml-py's: fills the ``c_nvmlGpuFabricInfo_t`` passed by reference, returns NVML_SUCCESS."""
        fabric = self._gpu(handle).fabric
        if fabric is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        target = info._obj  # ctypes.byref(struct)
        target.clusterUuid[:] = list(uuids.UUID(fabric[0]).bytes)
        target.cliqueId, target.state, target.status = fabric[1], 3, 0
        return int(pynvml.NVML_SUCCESS)

    def _link(self, handle: int, link: int) -> FakeLink:
        links = self._gpu(handle).links
        if link >= len(links):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return links[link]

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        return FEATURE_ENABLED if self._link(handle, link).up else 0

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: int, link: int) -> int:
        return self._link(handle, link).remote_type

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: int, link: int) -> Any:
        fake = self._link(handle, link)
        if not fake.up:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(busId=fake.remote_bus.encode())

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        self._gpu(a), self._gpu(b)
        return self.ancestors.get((min(a, b), max(a, b)), 50)

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        self._gpu(a), self._gpu(b)
        if self.p2p is None or index != 0:  # NVML_P2P_CAPS_INDEX_READ (a tuple "0," in pynvml, a typo there)
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(self.p2p.get((min(a, b), max(a, b)), pynvml.NVML_P2P_STATUS_UNKNOWN))

    @classmethod
    def from_node(
        cls,
        node: Node,
        *,
        model: str = "NVIDIA H100 80GB HBM3",
        memory_gib: float = 80.0,
        nvswitch: bool = True,
        fabric: tuple[str, int] | None = None,
    ) -> FakeNvml:
        """Emulate what NVML reports on the machine a topo matrix was captured from."""
        bus = {g.index: f"00000000:{0x18 + 0x10 * n:02X}:00.0" for n, g in enumerate(node.gpus)}
        position = {g.index: n for n, g in enumerate(node.gpus)}
        gpus = [
            FakeGpu(
                name=model,
                uuid=f"GPU-fake-{node.name}-{g.index}",
                bus_id=bus[g.index],
                memory_bytes=int(memory_gib * 2**30),
                numa_node=g.numa_node,
                cpus=_cpus(g.cpu_affinity),
                fabric=fabric,
            )
            for g in node.gpus
        ]
        ancestors: dict[tuple[int, int], int] = {}
        p2p: dict[tuple[int, int], int] = {}
        for link in node.links:
            pa, pb = position[link.a], position[link.b]
            if link.p2p is not None:  # what `topo -p2p r` said: OK, or refused (shown as chipset not supported)
                p2p[(min(pa, pb), max(pa, pb))] = (
                    pynvml.NVML_P2P_STATUS_OK if link.p2p else pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED
                )
            if link.kind is LinkKind.NVLINK:
                if nvswitch:
                    continue
                for _ in range(link.nvlinks):
                    gpus[pa].links.append(FakeLink(True, bus[link.b]))
                    gpus[pb].links.append(FakeLink(True, bus[link.a]))
            else:
                ancestors[(min(pa, pb), max(pa, pb))] = _LEVEL[link.kind]
        if nvswitch:
            for g in node.gpus:
                lanes = max((x.nvlinks for x in node.links if g.index in (x.a, x.b)), default=0)
                gpus[position[g.index]].links.extend(
                    FakeLink(True, "00000000:FF:00.0", NVLINK_DEVICE_TYPE_SWITCH) for _ in range(lanes)
                )
        return cls(gpus, ancestors=ancestors, p2p=p2p or None)

    @classmethod
    def from_nvlink_text(cls, status: str, remote: str, *, memory_gib: float = 80.0) -> FakeNvml:
        """Build from ``nvidia-smi nvlink -s`` (link up/down) and ``nvidia-smi nvlink -R`` (remote ends).

        ``-R`` lists active links in order; their numbering is the same as the ``-s`` active links.
        A GPU's own bus id is what its peers name as their remote end. Text the two outputs do not
        agree on (fewer remote ends than active links) is an ``InputError``, never a guess.
        """
        heads: list[tuple[int, str, str]] = []
        up: dict[int, list[bool]] = {}
        current = -1
        for line in status.splitlines():
            m = _NVLINK_GPU.search(line)
            if m:
                current = int(m.group(1))
                up[current] = []
                head = _NVLINK_HEAD.match(line, m.start())
                if head:
                    heads.append((current, head.group(1), head.group(2)))
                continue
            m = _NVLINK_LINK.search(line)
            if m and current >= 0:
                up[current].append("inactive" not in m.group(1))
        remotes: dict[int, list[str]] = {}
        current = -1
        for line in remote.splitlines():
            m = _NVLINK_GPU.search(line)
            if m:
                current = int(m.group(1))
                remotes[current] = []
                continue
            m = _NVLINK_REMOTE.search(line)
            if m and current >= 0:
                remotes[current].append(m.group(1).upper())
        own_bus = {}
        for gpu in remotes:
            for other, other_buses in remotes.items():
                if other != gpu and other_buses:
                    own_bus[gpu] = other_buses[0]
        gpus = []
        for i, name, uuid in heads:
            active = sum(up.get(i, []))
            ends = remotes.get(i, [])
            if len(ends) < active:
                raise InputError(
                    f"nvidia-smi nvlink -R lists {len(ends)} remote ends for GPU {i}, but nvlink -s shows "
                    f"{active} active links",
                    fix="capture both outputs on the same machine at the same time",
                )
            remote_iter = iter(ends)
            links = [FakeLink(True, next(remote_iter)) if is_up else FakeLink(False, "") for is_up in up.get(i, [])]
            gpus.append(
                FakeGpu(
                    name=name,
                    uuid=uuid,
                    bus_id=own_bus.get(i, f"00000000:{0x18 + 0x10 * i:02X}:00.0"),
                    memory_bytes=int(memory_gib * 2**30),
                    links=links,
                )
            )
        return cls(gpus)


def _cpus(cpulist: str | None) -> tuple[int, ...]:
    """The CPUs of a list such as ``0-51,104-155``; InputError past ``MAX_CPU`` or on bad text."""
    if not cpulist:
        return ()
    cpus: list[int] = []
    for part in cpulist.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or not (hi or lo).isdigit():
            raise InputError(f"CPU list {cpulist[:60]!r}: {part[:20]!r} is not a CPU number or range")
        first, last = int(lo), int(hi or lo)
        if last > MAX_CPU or first > last:
            raise InputError(f"CPU list {cpulist[:60]!r}: range {part[:40]} is not within 0-{MAX_CPU}")
        cpus.extend(range(first, last + 1))
    return tuple(cpus)
