"""The sidecar's three checks (seed 000 section 7, layer 5), as functions over an NVML-like ``lib``.

``lib`` has pynvml's function names: the real ``pynvml`` module on a GPU node, or
``sidecar.fake_scenarios.ScriptedNvml`` in tests, so both run this same code. The caller has called
``lib.nvmlInit()``. NVML errors are translated by ``topology.nvml`` (the one place for that).

(a) ``check_topology`` -> ``TOPOLOGY_DRIFT``: every assigned GPU still reaches each placement peer on
    its node over as many NVLink lanes as the plan's topology had (link state and remote end per
    link; on NVSwitch boards the lanes that end at a switch), and its GPU fabric clique (GB200
    multi-node NVLink) is still the one seen at the first check.
(b) ``check_traffic`` -> ``PCIE_BUDGET_WARNING``: PCIe TX/RX (``nvmlDeviceGetPcieThroughput``, KB/s)
    and NVLink data TX/RX summed over the active links (field values
    ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX``, one ``(fieldId, scopeId=link)`` pair per link;
    cumulative KiB, so a rate needs the previous sample) against the GPU's budget, warning at 90%.
(c) ``check_hbm`` -> ``HBM_DRIFT``: memory used (``nvmlDeviceGetMemoryInfo``) against the ledger's
    reservation, through ``ledger.reconcile`` with a 10% tolerance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pynvml

from toposched.ledger.base import Reservation
from toposched.ledger.reconcile import reconcile
from toposched.solver.request import Placement
from toposched.topology.domains import gpu_ref
from toposched.topology.model import Cluster, LinkKind, nvlink_lane_gbps
from toposched.topology.nvml import (
    FEATURE_ENABLED,
    MAX_LINKS,
    NVLINK_DEVICE_TYPE_SWITCH,
    NvmlSession,
    gpu_fabric,
    nvml_bus_id,
)

AlertKind = Literal["TOPOLOGY_DRIFT", "PCIE_BUDGET_WARNING", "HBM_DRIFT"]
ALERT_KINDS: tuple[AlertKind, ...] = ("TOPOLOGY_DRIFT", "PCIE_BUDGET_WARNING", "HBM_DRIFT")
DEFAULT_PCIE_BUDGET_GBPS = 16.0  # half a PCIe Gen4 x16 link, when the plan predicts no cross-domain traffic
GB = 1e9


@dataclass(frozen=True)
class Alert:
    """One condition found by one check on one GPU."""

    kind: AlertKind
    gpu: str  # "node/index"
    subject: str  # what was checked: "nvlink->3", "fabric", "pcie", "nvlink", "hbm"
    observed: float
    expected: float
    message: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.gpu, self.subject)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "gpu": self.gpu,
            "subject": self.subject,
            "observed": self.observed,
            "expected": self.expected,
            "message": self.message,
        }


@dataclass(frozen=True)
class GpuExpectation:
    """What the plan says about one assigned GPU on this node."""

    index: int
    ref: str
    peers: Mapping[int, int]  # placement peer on this node -> NVLink lanes the plan's topology had
    reserved_bytes: int
    pcie_budget_gbps: float
    nvlink_budget_gbps: float  # per direction; 0 when the GPU has no NVLink in the plan


@dataclass(frozen=True)
class Expectations:
    placement_id: str
    node: str
    nvswitch: bool
    gpus: tuple[GpuExpectation, ...]
    warn_fraction: float = 0.9
    hbm_tolerance: float = 0.10

    def reservation(self) -> Reservation:
        return Reservation(
            id=self.placement_id, gpus={g.ref: g.reserved_bytes for g in self.gpus}, owner="toposched", created_at=0
        )


def expectations_from_plan(
    placement: Placement,
    cluster: Cluster,
    *,
    node: str | None = None,
    reserved: Mapping[str, int] | None = None,
    pcie_budget_gbps: float | None = None,
) -> Expectations:
    """Expectations for the GPUs of ``placement`` on ``node`` (default: its first node).

    ``reserved`` overrides the plan's per-GPU HBM with what the ledger holds. The PCIe budget per
    GPU is the placement's predicted cross-domain traffic shared over its GPUs, or
    ``DEFAULT_PCIE_BUDGET_GBPS`` when it predicts none; the NVLink budget is the GPU's nominal
    NVLink bandwidth (lanes x lane speed) in the plan's topology.
    """
    name = node or placement.ranks[0].node
    the_node = cluster.node(name)
    local = [r.gpu for r in placement.ranks if r.node == name]
    if not local:
        raise ValueError(f"placement {placement.id} has no GPU on node {name}")
    cross = placement.cross_domain_gbps / len(placement.ranks) if placement.cross_domain_gbps > 0 else 0.0
    budget = pcie_budget_gbps if pcie_budget_gbps is not None else (cross or DEFAULT_PCIE_BUDGET_GBPS)
    gpus = []
    for index in local:
        peers: dict[int, int] = {}
        for other in local:
            link = the_node.link(index, other) if other != index else None
            if link is not None and link.kind is LinkKind.NVLINK:
                peers[other] = link.nvlinks
        lanes = max((x.nvlinks for x in the_node.links if index in (x.a, x.b)), default=0)
        ref = gpu_ref(name, index)
        gpus.append(
            GpuExpectation(
                index=index,
                ref=ref,
                peers=peers,
                reserved_bytes=(reserved or {}).get(ref, placement.hbm_per_gpu.total),
                pcie_budget_gbps=budget,
                nvlink_budget_gbps=lanes * nvlink_lane_gbps(the_node.gpu(index).model),
            )
        )
    return Expectations(placement.id, name, bool(the_node.nvswitch), tuple(gpus))


# ------------------------------------------------------------------------------------------ topology


@dataclass(frozen=True)
class TopologyResult:
    alerts: tuple[Alert, ...]
    lanes: Mapping[int, Mapping[str, int]]  # GPU -> {"switch": n} or {"<peer index>": n}
    fabric: Mapping[int, str | None]


def _fabric(s: NvmlSession, handle: Any) -> str | None:
    fabric = gpu_fabric(s, handle)
    return None if fabric is None else f"{fabric[0]}/{fabric[1]}"


def check_topology(
    lib: Any, exp: Expectations, *, fabric_baseline: Mapping[int, str | None] | None = None
) -> TopologyResult:
    """(a) NVLink lanes to each placement peer and the fabric clique, against the plan."""
    s = NvmlSession(lib)
    count = s.call("device count", lib.nvmlDeviceGetCount)
    handles = [s.call("handle", lib.nvmlDeviceGetHandleByIndex, i, gpu=i) for i in range(count)]
    index_of_bus = {
        nvml_bus_id(s.call("PCI info", lib.nvmlDeviceGetPciInfo, h, gpu=i).busId): i for i, h in enumerate(handles)
    }
    alerts: list[Alert] = []
    lanes_seen: dict[int, dict[str, int]] = {}
    fabric_seen: dict[int, str | None] = {}
    for g in exp.gpus:
        if g.index >= count:
            alerts.append(Alert("TOPOLOGY_DRIFT", g.ref, "gpu", 0, 1, f"GPU {g.ref} is gone: NVML sees {count} GPUs"))
            continue
        handle = handles[g.index]
        switch = 0
        direct: dict[int, int] = {}
        down: list[int] = []
        for link in range(MAX_LINKS):
            state = s.optional(lib.nvmlDeviceGetNvLinkState, handle, link)
            if state is None:
                break
            if state != FEATURE_ENABLED:
                down.append(link)
                continue
            if s.optional(lib.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link) == NVLINK_DEVICE_TYPE_SWITCH:
                switch += 1
                continue
            remote = s.call("NVLink remote PCI info", lib.nvmlDeviceGetNvLinkRemotePciInfo, handle, link, gpu=g.index)
            peer = index_of_bus.get(nvml_bus_id(remote.busId))
            if peer is not None:
                direct[peer] = direct.get(peer, 0) + 1
        lanes_seen[g.index] = {"switch": switch} if exp.nvswitch else {str(p): n for p, n in sorted(direct.items())}
        for peer, want in sorted(g.peers.items()):
            have = switch if exp.nvswitch else direct.get(peer, 0)
            if have < want:
                what = "lost NVLink to" if have == 0 else f"has {have} of {want} NVLink lanes to"
                alerts.append(
                    Alert(
                        "TOPOLOGY_DRIFT",
                        g.ref,
                        f"nvlink->{peer}",
                        have,
                        want,
                        f"GPU {g.ref} {what} GPU {peer} (planned NV{want}); links down: {down or 'none'}",
                    )
                )
        fabric_seen[g.index] = _fabric(s, handle)
        if fabric_baseline is not None and g.index in fabric_baseline:
            before, now = fabric_baseline[g.index], fabric_seen[g.index]
            if before is not None and now != before:
                alerts.append(
                    Alert(
                        "TOPOLOGY_DRIFT", g.ref, "fabric", 0, 1, f"GPU {g.ref} left fabric clique {before} (now {now})"
                    )
                )
    return TopologyResult(tuple(alerts), lanes_seen, fabric_seen)


# ------------------------------------------------------------------------------------------- traffic


@dataclass(frozen=True)
class NvlinkSample:
    """Cumulative NVLink data counters (KiB) summed over active links, and NVML's timestamp (us)."""

    tx_kib: int
    rx_kib: int
    timestamp_us: int


@dataclass(frozen=True)
class TrafficResult:
    alerts: tuple[Alert, ...]
    pcie_gbps: Mapping[int, float]
    nvlink_gbps: Mapping[int, float | None]  # None on the first sample (no rate yet) or without NVLink
    samples: Mapping[int, NvlinkSample] = field(default_factory=dict)


def _nvlink_sample(s: NvmlSession, handle: Any) -> NvlinkSample | None:
    links = []
    for link in range(MAX_LINKS):
        state = s.optional(s.lib.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            break
        if state == FEATURE_ENABLED:
            links.append(link)
    if not links:
        return None
    ids = [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, link) for link in links]
    ids += [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, link) for link in links]
    values = s.optional(s.lib.nvmlDeviceGetFieldValues, handle, ids)
    if values is None:
        return None
    tx = rx = stamp = 0
    for v in values:
        if int(v.nvmlReturn) != 0:
            continue
        if int(v.fieldId) == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
            tx += int(v.value.ullVal)
        else:
            rx += int(v.value.ullVal)
        stamp = max(stamp, int(v.timestamp))
    return NvlinkSample(tx, rx, stamp)


def check_traffic(lib: Any, exp: Expectations, *, previous: Mapping[int, NvlinkSample] | None = None) -> TrafficResult:
    """(b) PCIe and NVLink throughput per GPU against its budget; warns at ``warn_fraction``."""
    s = NvmlSession(lib)
    alerts: list[Alert] = []
    pcie: dict[int, float] = {}
    nvlink: dict[int, float | None] = {}
    samples: dict[int, NvlinkSample] = {}
    for g in exp.gpus:
        handle = s.call("handle", lib.nvmlDeviceGetHandleByIndex, g.index, gpu=g.index)
        tx = s.call("PCIe throughput", lib.nvmlDeviceGetPcieThroughput, handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = s.call("PCIe throughput", lib.nvmlDeviceGetPcieThroughput, handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        pcie[g.index] = max(int(tx), int(rx)) * 1e3 / GB  # KB/s -> GB/s
        limit = g.pcie_budget_gbps * exp.warn_fraction
        if pcie[g.index] >= limit:
            alerts.append(
                Alert(
                    "PCIE_BUDGET_WARNING",
                    g.ref,
                    "pcie",
                    round(pcie[g.index], 3),
                    g.pcie_budget_gbps,
                    f"GPU {g.ref} PCIe at {pcie[g.index]:.2f} GB/s, over {exp.warn_fraction:.0%} of its "
                    f"{g.pcie_budget_gbps:.2f} GB/s budget",
                )
            )
        sample = _nvlink_sample(s, handle)
        nvlink[g.index] = None
        if sample is None:
            continue
        samples[g.index] = sample
        before = (previous or {}).get(g.index)
        if before is None or sample.timestamp_us <= before.timestamp_us:
            continue
        seconds = (sample.timestamp_us - before.timestamp_us) / 1e6
        rate = max(sample.tx_kib - before.tx_kib, sample.rx_kib - before.rx_kib, 0) * 1024 / seconds / GB
        nvlink[g.index] = rate
        if g.nvlink_budget_gbps > 0 and rate >= g.nvlink_budget_gbps * exp.warn_fraction:
            alerts.append(
                Alert(
                    "PCIE_BUDGET_WARNING",
                    g.ref,
                    "nvlink",
                    round(rate, 3),
                    g.nvlink_budget_gbps,
                    f"GPU {g.ref} NVLink at {rate:.1f} GB/s, over {exp.warn_fraction:.0%} of its "
                    f"{g.nvlink_budget_gbps:.0f} GB/s",
                )
            )
    return TrafficResult(tuple(alerts), pcie, nvlink, samples)


# ----------------------------------------------------------------------------------------------- HBM


@dataclass(frozen=True)
class HbmResult:
    alerts: tuple[Alert, ...]
    used: Mapping[int, int]


def check_hbm(lib: Any, exp: Expectations) -> HbmResult:
    """(c) HBM in use per GPU against the ledger's reservation, within ``hbm_tolerance``."""
    s = NvmlSession(lib)
    used: dict[int, int] = {}
    for g in exp.gpus:
        handle = s.call("handle", lib.nvmlDeviceGetHandleByIndex, g.index, gpu=g.index)
        used[g.index] = int(s.call("memory info", lib.nvmlDeviceGetMemoryInfo, handle, gpu=g.index).used)
    observed = {g.ref: used[g.index] for g in exp.gpus}
    by_ref = {g.ref: g for g in exp.gpus}
    alerts = []
    for diff in reconcile([exp.reservation()], observed, tolerance=exp.hbm_tolerance):
        if diff.ref not in by_ref:
            continue
        alerts.append(
            Alert(
                "HBM_DRIFT",
                diff.ref,
                "hbm",
                float(diff.observed_bytes or 0),
                float(diff.reserved_bytes),
                f"HBM {diff.describe()} (tolerance {exp.hbm_tolerance:.0%})",
            )
        )
    return HbmResult(tuple(alerts), used)
