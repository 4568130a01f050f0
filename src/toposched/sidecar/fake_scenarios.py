"""A scripted fake NVML for the sidecar: drift that happens while the loop runs.

``ScriptedNvml`` extends ``topology.nvml_fake.FakeNvml`` with the calls the checks make that the
discovery fake lacks, under pynvml's names and signatures:

* ``nvmlDeviceGetPcieThroughput(handle, counter)`` -> KB/s (``NVML_PCIE_UTIL_TX_BYTES``/``RX_BYTES``);
* ``nvmlDeviceGetFieldValues(handle, fieldIds)`` where each entry is a field id or a
  ``(fieldId, scopeId)`` pair, as in pynvml; ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX`` per link
  (``scopeId`` = link id) are cumulative KiB counters; a bare id reads link 0, like the real call;
* ``nvmlDeviceGetMemoryInfo(handle)`` with the scripted ``used`` bytes.

Time moves only when ``advance(cycle)`` is called (the loop's ``before_cycle`` hook): each cycle
applies the scenario's script for that cycle, then adds ``rate x interval`` to the NVLink counters.

Scenarios (``SCENARIOS``), each acting on the placement's GPUs on the node:

    steady        nothing changes: no alert, ever
    link-down     from cycle 2 the placement's second GPU loses all its NVLinks (both ends)
    traffic-ramp  PCIe of the first GPU ramps to 50/80/95/110% of its budget over cycles 0-3;
                  NVLink of the last GPU to 30/60/92/97% of its NVLink bandwidth
    hbm-leak      HBM used on the first GPU grows to 100/105/112/120% of its reservation
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pynvml

from toposched.sidecar.checks import GB, Expectations
from toposched.topology.model import Node
from toposched.topology.nvml_fake import FakeGpu, FakeNvml

_THROUGHPUT_FIELDS = (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)
_RAMP = (0.5, 0.8, 0.95, 1.1)
_NVLINK_RAMP = (0.3, 0.6, 0.92, 0.97)
_LEAK = (1.0, 1.05, 1.12, 1.2)
BASELINE = 0.1  # idle traffic, as a fraction of each budget


class ScriptedNvml(FakeNvml):
    """``FakeNvml`` plus traffic counters, memory in use and a per-cycle script."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        ancestors: dict[tuple[int, int], int] | None = None,
        interval_s: float = 10.0,
        script: Callable[[ScriptedNvml, int], None] | None = None,
    ) -> None:
        super().__init__(gpus, ancestors=ancestors)
        self.interval_s = interval_s
        self.script = script
        self.cycle = -1
        self.used = [0] * len(gpus)
        self.pcie_kbps = [(0, 0)] * len(gpus)  # (tx, rx) KB/s
        self.nvlink_gbps = [0.0] * len(gpus)  # data rate per direction, shared over active links
        self.counters = [[(0, 0)] * len(g.links) for g in gpus]  # per link (tx, rx) KiB
        self.calls: list[str] = []

    @classmethod
    def for_node(cls, node: Node, **kw: Any) -> ScriptedNvml:
        model = node.gpus[0].model or "NVIDIA H100 80GB HBM3"
        gib = node.gpus[0].hbm_gib or 80.0
        base = FakeNvml.from_node(node, model=model, memory_gib=gib, nvswitch=bool(node.nvswitch))
        return cls(base.gpus, ancestors=base.ancestors, **kw)

    # ------------------------------------------------------------------------------------- script

    def advance(self, cycle: int) -> None:
        """Move to ``cycle``: run the script, then let one interval of traffic flow."""
        self.cycle = cycle
        if self.script is not None:
            self.script(self, cycle)
        for i, gpu in enumerate(self.gpus):
            up = [n for n, link in enumerate(gpu.links) if link.up]
            if not up:
                continue
            per_link_kib = int(self.nvlink_gbps[i] * GB * self.interval_s / 1024 / len(up))
            for n in up:
                tx, rx = self.counters[i][n]
                self.counters[i][n] = (tx + per_link_kib, rx + per_link_kib)

    def link_down(self, gpu: int) -> None:
        """Take every NVLink of ``gpu`` down, at both ends."""
        bus = self.gpus[gpu].bus_id
        for link in self.gpus[gpu].links:
            link.up = False
        for other in self.gpus:
            for link in other.links:
                if link.remote_bus == bus:
                    link.up = False

    # ---------------------------------------------------------------------------------- pynvml API

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        total = self._gpu(handle).memory_bytes
        used = self.used[handle]
        return SimpleNamespace(total=total, free=max(total - used, 0), used=used)

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> int:
        self._gpu(handle)
        self.calls.append("pcie")
        if counter not in (pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.pcie_kbps[handle][counter]

    def nvmlDeviceGetFieldValues(self, handle: int, fieldIds: list[Any]) -> list[Any]:
        self._gpu(handle)
        out = []
        for entry in fieldIds:
            try:
                field_id, scope = entry
            except TypeError:
                field_id, scope = entry, 0
            self.calls.append(f"field {field_id}/{scope}")
            ret, value = pynvml.NVML_SUCCESS, 0
            links = self.counters[handle]
            if field_id not in _THROUGHPUT_FIELDS:
                ret = pynvml.NVML_ERROR_NOT_SUPPORTED
            elif not 0 <= scope < len(links):
                ret = pynvml.NVML_ERROR_INVALID_ARGUMENT
            else:
                value = links[scope][0 if field_id == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX else 1]
            out.append(
                SimpleNamespace(
                    fieldId=field_id,
                    scopeId=scope,
                    timestamp=int(max(self.cycle, 0) * self.interval_s * 1e6),
                    latencyUsec=0,
                    valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                    nvmlReturn=ret,
                    value=SimpleNamespace(ullVal=value),
                )
            )
        return out


# ---------------------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    script: Callable[[Expectations], Callable[[ScriptedNvml, int], None]]


def _baseline(fake: ScriptedNvml, exp: Expectations) -> None:
    for g in exp.gpus:
        fake.used[g.index] = g.reserved_bytes
        idle = int(g.pcie_budget_gbps * BASELINE * GB / 1e3)
        fake.pcie_kbps[g.index] = (idle, idle)
        fake.nvlink_gbps[g.index] = g.nvlink_budget_gbps * BASELINE


def _step(values: tuple[float, ...], cycle: int) -> float:
    return values[min(cycle, len(values) - 1)]


def _steady(exp: Expectations) -> Callable[[ScriptedNvml, int], None]:
    def script(fake: ScriptedNvml, cycle: int) -> None:
        if cycle == 0:
            _baseline(fake, exp)

    return script


def _link_down(exp: Expectations) -> Callable[[ScriptedNvml, int], None]:
    target = exp.gpus[min(1, len(exp.gpus) - 1)].index

    def script(fake: ScriptedNvml, cycle: int) -> None:
        if cycle == 0:
            _baseline(fake, exp)
        if cycle == 2:
            fake.link_down(target)

    return script


def _traffic_ramp(exp: Expectations) -> Callable[[ScriptedNvml, int], None]:
    first, last = exp.gpus[0], exp.gpus[-1]

    def script(fake: ScriptedNvml, cycle: int) -> None:
        if cycle == 0:
            _baseline(fake, exp)
        kbps = int(first.pcie_budget_gbps * _step(_RAMP, cycle) * GB / 1e3)
        fake.pcie_kbps[first.index] = (kbps, kbps // 2)
        fake.nvlink_gbps[last.index] = last.nvlink_budget_gbps * _step(_NVLINK_RAMP, cycle)

    return script


def _hbm_leak(exp: Expectations) -> Callable[[ScriptedNvml, int], None]:
    first = exp.gpus[0]

    def script(fake: ScriptedNvml, cycle: int) -> None:
        if cycle == 0:
            _baseline(fake, exp)
        fake.used[first.index] = int(first.reserved_bytes * _step(_LEAK, cycle))

    return script


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("steady", "nothing changes", _steady),
        Scenario("link-down", "the second GPU loses its NVLinks at cycle 2", _link_down),
        Scenario("traffic-ramp", "PCIe and NVLink traffic ramp past 90% of budget at cycle 2", _traffic_ramp),
        Scenario("hbm-leak", "HBM in use grows past the reservation + 10% at cycle 2", _hbm_leak),
    )
}


def build_scenario(name: str, node: Node, exp: Expectations, *, interval_s: float = 10.0) -> ScriptedNvml:
    """A scripted fake of ``node`` running scenario ``name`` against the placement ``exp``."""
    from toposched.errors import UnknownNameError

    scenario = SCENARIOS.get(name)
    if scenario is None:
        raise UnknownNameError("drift scenario", name, SCENARIOS)
    return ScriptedNvml.for_node(node, interval_s=interval_s, script=scenario.script(exp))
