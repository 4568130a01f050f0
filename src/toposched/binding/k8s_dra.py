"""Pinning pods to the planned GPUs: which GPU ids a plan can be trusted with, and DRA claims on them.

A ``nvidia.com/gpu: N`` request cannot say which GPUs: the device plugin picks N without knowing the
plan (its GetPreferredAllocation request carries no pod identity). Dynamic Resource Allocation can:
a ``resource.k8s.io/v1`` ``ResourceClaimTemplate`` with one request per rank, each of device class
``gpu.nvidia.com`` (the NVIDIA DRA driver) and a CEL selector on one attribute the driver publishes
(reference/engines.md 6.2):

* ``device.attributes["gpu.nvidia.com"].uuid`` when the plan's topology came from NVML, whose UUIDs
  are real (``GPU-`` and the 8-4-4-4-12 lower-case hex form NVML prints);
* else ``device.attributes["resource.kubernetes.io"].pciBusID``, the standard attribute, in its form
  ``0000:18:00.0`` (4-digit domain, lower case), converted from NVML's ``00000000:18:00.0``.

Bus ids repeat on identical nodes, so pods keep their hostname node affinity. When every GPU of a pod
sits behind PCIe switches only (``PIX``/``PXB`` between each pair), the claim also asks for one
``resource.kubernetes.io/pcieRoot``.

Presets are not machines: their bus ids and UUIDs are made up (``Node.source`` starts with
``preset:``, UUIDs with ``GPU-preset-``), and ``nvidia-smi topo -m`` captures list neither. Such
GPUs cannot be pinned: they are reported with the reason, never put in a selector.

Every string inside a CEL expression is a bus id or UUID that matched a strict pattern first
(:data:`DRA_BUS_ID`, :data:`GPU_UUID`), so no text from a plan can change an expression.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from toposched.errors import InputError
from toposched.topology.model import Cluster, LinkKind, Node

Obj = dict[str, Any]
GpuRequest = Literal["auto", "dra", "device-plugin"]
GPU_REQUESTS: tuple[GpuRequest, ...] = ("auto", "dra", "device-plugin")

DEVICE_CLASS = "gpu.nvidia.com"
CLAIM = "gpus"
"""The name of the claim in ``spec.resourceClaims`` and the container's ``resources.claims``."""
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
BUS_ATTRIBUTE = 'device.attributes["resource.kubernetes.io"].pciBusID'
UUID_ATTRIBUTE = 'device.attributes["gpu.nvidia.com"].uuid'

DRA_BUS_ID = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]")
"""The ``pciBusID`` attribute's form: domain:bus:device.function, 4-digit domain, device <= 1f."""
GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
"""A GPU UUID as NVML prints it (MIG UUIDs and made-up ones do not match)."""
_BUS_ID = re.compile(r"(?:([0-9A-Fa-f]{1,8}):)?([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])")

DEFAULT_DRA_DRIVER = "25.12.0"
"""The NVIDIA DRA driver release the claims are written for (``--dra-driver-version``)."""
STANDARD_PCI_SINCE = (25, 12, 0)
"""Since v25.12.0 the driver publishes ``resource.kubernetes.io/pciBusID`` (and ``pcieRoot``); through v25.8.1
it published a driver-local ``pcieBusID`` instead (and ``index``/``minor``, removed in 2025-09), whose form
reference/ does not record, so bus-id claims are not written for those releases (k8s/README.md, summary 2)."""
OLDEST_CHECKED = "25.3.2"
"""The oldest release whose attributes reference/ records; ``uuid`` is published by it and every later one."""
ANNOTATION_DRIVER = "toposched.io/nvidia-dra-driver-min-version"
"""On each claim template: the oldest NVIDIA DRA driver release whose published attributes its selectors use."""
_VERSION = re.compile(r"v?([0-9]{1,4})\.([0-9]{1,4})(?:\.([0-9]{1,4}))?")

PRESET_SOURCE = "preset:"
PRESET_UUID = "GPU-preset-"
FIX_PINNING = (
    "plan from --live, or from a cluster spec whose nodes use `probe:` (a saved `toposched topo show --live --json`)"
)


def _bus_parts(bus_id: str) -> tuple[int, int, int, int]:
    match = _BUS_ID.fullmatch(bus_id.strip())
    if not match:
        raise InputError(f"PCI bus id {bus_id[:40]!r} is not DOMAIN:BUS:DEVICE.FUNCTION (e.g. 00000000:18:00.0)")
    domain, bus, device, function = match.groups()
    return int(domain or "0", 16), int(bus, 16), int(device, 16), int(function)


def normalise_bus_id(bus_id: str) -> str:
    """PCI bus id as ``nvidia-smi --query-gpu=pci.bus_id`` prints it: ``00000000:18:00.0``."""
    domain, bus, device, function = _bus_parts(bus_id)
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function}"


def dra_bus_id(bus_id: str) -> str:
    """The ``resource.kubernetes.io/pciBusID`` form of a bus id: ``00000000:18:00.0`` -> ``0000:18:00.0``."""
    domain, bus, device, function = _bus_parts(bus_id)
    if domain > 0xFFFF or device > 0x1F:
        raise InputError(f"PCI bus id {bus_id!r} has no 4-digit-domain form (domain {domain:x}, device {device:x})")
    value = f"{domain:04x}:{bus:02x}:{device:02x}.{function}"
    if not DRA_BUS_ID.fullmatch(value):  # the parts above cannot make anything else
        raise InputError(f"PCI bus id {bus_id!r} did not convert to DOMAIN:BUS:DEVICE.FUNCTION")
    return value


def invented_ids(node: Node) -> bool:
    """True when the node comes from a preset: its bus ids and UUIDs were made up, not read."""
    return node.source.startswith(PRESET_SOURCE) or any((g.uuid or "").startswith(PRESET_UUID) for g in node.gpus)


@dataclass(frozen=True)
class GpuIds:
    """What names the GPUs of one pod on one node, in rank order; ``None`` where the plan cannot say."""

    node: str
    gpus: tuple[int, ...]
    uuids: tuple[str, ...] | None
    """Real UUIDs (NVML topologies only); the entrypoint and DRA prefer them."""
    bus_ids: tuple[str, ...] | None
    """NVML-form bus ids (``00000000:18:00.0``), what the entrypoint matches."""
    dra_bus_ids: tuple[str, ...] | None
    """``pciBusID`` form (``0000:18:00.0``), for DRA selectors."""
    problem: str | None
    """Why DRA cannot select these GPUs (None when it can)."""

    @property
    def pinned(self) -> bool:
        """The entrypoint can find these GPUs among those the container sees."""
        return self.uuids is not None or self.bus_ids is not None


def repeated_uuids(cluster: Cluster) -> frozenset[str]:
    """UUIDs that several GPUs of the cluster carry (one saved probe used for many spec nodes): not theirs."""
    counts = Counter(g.uuid for n in cluster.nodes for g in n.gpus if g.uuid)
    return frozenset(u for u, count in counts.items() if count > 1)


def gpu_ids(node: Node, gpus: Sequence[int], repeated: Collection[str] = frozenset()) -> GpuIds:
    """The ids of ``gpus`` on ``node`` that a pod can be pinned by, or the reason there are none.

    UUIDs count only from NVML (``source == "nvml"``), in NVML's form, and not in ``repeated``
    (:func:`repeated_uuids`); bus ids count unless the node comes from a preset.
    """
    chosen = [node.gpu(g) for g in gpus]
    if invented_ids(node):
        return GpuIds(
            node.name, tuple(gpus), None, None, None, "made from a preset, whose PCI bus ids and UUIDs are invented"
        )
    uuids = tuple(g.uuid or "" for g in chosen)
    real = node.source == "nvml" and all(GPU_UUID.fullmatch(u) and u not in repeated for u in uuids)
    real_uuids = uuids if real else None
    bus_ids: tuple[str, ...] | None = None
    dra_ids: tuple[str, ...] | None = None
    problem: str | None = None
    if all(g.pci_bus_id for g in chosen):
        bus_ids = tuple(normalise_bus_id(g.pci_bus_id or "") for g in chosen)
        try:
            dra_ids = tuple(dra_bus_id(b) for b in bus_ids)
        except InputError as exc:
            problem = exc.message
    elif real_uuids is None:
        problem = "the plan knows neither the PCI bus ids nor the UUIDs of its GPUs (nvidia-smi topo -m lists neither)"
    return GpuIds(node.name, tuple(gpus), real_uuids, bus_ids, dra_ids, None if real_uuids else problem)


def under_one_pcie_root(node: Node, gpus: Sequence[int]) -> bool:
    """Every pair of ``gpus`` is joined through PCIe switches only (``PIX``/``PXB``): one PCIe root."""
    if len(gpus) < 2:
        return False
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            link = node.link(a, b)
            if link is None or link.kind not in (LinkKind.PIX, LinkKind.PXB):
                return False
    return True


def _literal(value: str, pattern: re.Pattern[str]) -> str:
    """A CEL string literal of a value that matched ``pattern`` (so it needs no escaping)."""
    if not pattern.fullmatch(value):
        raise InputError(f"{value[:60]!r} is not a checked GPU id; it cannot go into a CEL selector")
    return f'"{value}"'


def parse_driver_version(text: str) -> tuple[int, int, int]:
    """``25.12.0`` / ``v25.8.1`` / ``25.12`` -> (25, 12, 0); InputError for anything else."""
    match = _VERSION.fullmatch(text.strip())
    if not match:
        raise InputError(
            f"--dra-driver-version {text[:40]!r} is not a release number",
            fix="give the NVIDIA DRA driver's release as `helm list` shows it, e.g. 25.12.0 or v25.8.1",
        )
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def dra_problem(pod: GpuIds, driver: tuple[int, int, int]) -> str | None:
    """Why DRA cannot select this pod's GPUs on a cluster running driver release ``driver`` (None when it can)."""
    if pod.problem:
        return pod.problem
    if pod.uuids is None and driver < STANDARD_PCI_SINCE:
        return (
            f"the NVIDIA DRA driver before v25.12.0 (this cluster: v{'.'.join(map(str, driver))}) publishes no "
            "resource.kubernetes.io/pciBusID, and these GPUs have no NVML UUIDs to select them by"
        )
    return None


def _selector(attribute: str, pattern: re.Pattern[str], values: Sequence[str]) -> str:
    literals = [_literal(v, pattern) for v in dict.fromkeys(values)]
    if len(literals) == 1:
        return f"{attribute} == {literals[0]}"
    return f"{attribute} in [{', '.join(literals)}]"


def claim_template(
    name: str,
    metadata: Mapping[str, Any],
    pods: Sequence[GpuIds],
    *,
    pcie_root: bool,
    driver: tuple[int, int, int] = STANDARD_PCI_SINCE,
) -> Obj:
    """A ``ResourceClaimTemplate`` for pods that may run on any of ``pods``' nodes (one request per rank).

    Request ``gpu-i`` takes the GPU of local rank ``i``: by UUID when every node's UUIDs are real,
    else by ``pciBusID``. When the nodes differ at ``i``, the selector accepts each node's value
    (``in [...]``); UUIDs are unique per GPU, so that stays exact (see :func:`claim_warning`).
    ``driver``: the cluster's NVIDIA DRA driver release; the template's ``ANNOTATION_DRIVER`` annotation
    names the oldest release its selectors work with.
    """
    for p in pods:
        problem = dra_problem(p, driver)
        if problem:
            raise InputError(f"node {p.node}: DRA cannot select its GPUs: {problem}", fix=FIX_PINNING)
    count = len(pods[0].gpus)
    if any(len(p.gpus) != count for p in pods):
        raise InputError(f"claim {name}: the pods of one template must use the same number of GPUs")
    if all(p.uuids for p in pods):
        attribute, pattern, columns = UUID_ATTRIBUTE, GPU_UUID, [p.uuids or () for p in pods]
        oldest = OLDEST_CHECKED
    else:
        attribute, pattern, columns = BUS_ATTRIBUTE, DRA_BUS_ID, [p.dra_bus_ids or () for p in pods]
        oldest = ".".join(map(str, STANDARD_PCI_SINCE))
    requests = [
        {
            "name": f"gpu-{i}",
            "exactly": {
                "deviceClassName": DEVICE_CLASS,
                "selectors": [{"cel": {"expression": _selector(attribute, pattern, [c[i] for c in columns])}}],
            },
        }
        for i in range(count)
    ]
    devices: Obj = {"requests": requests}
    if pcie_root and driver >= STANDARD_PCI_SINCE:  # pcieRoot is one of the standard attributes of v25.12.0
        devices["constraints"] = [{"matchAttribute": PCIE_ROOT}]
        oldest = ".".join(map(str, STANDARD_PCI_SINCE))
    annotations = {**metadata.get("annotations", {}), ANNOTATION_DRIVER: oldest}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {**metadata, "name": name, "annotations": annotations},
        "spec": {"spec": {"devices": devices}},
    }


def claim_warning(placement: str, pods: Sequence[GpuIds]) -> str | None:
    """A warning when a bus-id claim shared by several nodes cannot tell their planned GPUs apart."""
    if len(pods) < 2 or all(p.uuids for p in pods):
        return None
    if len({p.dra_bus_ids for p in pods}) == 1:
        return None
    return (
        f"placement {placement}: the worker pods' planned PCI bus ids differ between "
        f"{nodes_text([p.node for p in pods])}; their one "
        "claim accepts each node's bus id per rank, so a worker may get GPUs planned for another node and stop "
        "at start (plan on a live NVML topology: real UUIDs make the claim exact)"
    )


def pod_claim(spec: Obj, container: Obj, template: str) -> None:
    """Point a pod spec and its container at the claim made from ``template``."""
    spec["resourceClaims"] = [{"name": CLAIM, "resourceClaimTemplateName": template}]
    container.setdefault("resources", {})["claims"] = [{"name": CLAIM}]


def nodes_text(nodes: Sequence[str]) -> str:
    """``node a`` / ``nodes a, b, c and 4 more``."""
    shown = ", ".join(nodes[:3]) + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")
    return f"node{'s' if len(nodes) > 1 else ''} {shown}"


def choose_gpu_request(
    asked: GpuRequest, pods: Sequence[GpuIds], driver: tuple[int, int, int] = STANDARD_PCI_SINCE
) -> tuple[Literal["dra", "device-plugin"], list[str]]:
    """``dra`` or ``device-plugin`` for these pods, and the warnings to show.

    ``auto`` takes DRA when every pod's GPUs can be selected by id on the cluster's DRA driver release
    ``driver``, else the device plugin with a warning that names the nodes and why. ``dra`` on GPUs that
    cannot be pinned is refused.
    """
    problems: dict[str, dict[str, None]] = {}  # problem -> its nodes, in order, once each
    for p in pods:
        problem = dra_problem(p, driver)
        if problem:
            problems.setdefault(problem, {})[p.node] = None
    if asked == "dra" and problems:
        problem, nodes = next(iter(problems.items()))
        raise InputError(
            f"--gpu-request dra cannot pin the GPUs of {nodes_text(list(nodes))}: {problem}; "
            "GPU pinning needs a captured or live topology",
            fix=f"{FIX_PINNING}, or pass --gpu-request device-plugin",
        )
    if asked == "dra" or (asked == "auto" and not problems):
        return "dra", []
    warnings = []
    unpinned = {p.node for p in pods if not p.pinned}
    for problem, nodes in problems.items():
        tail = (
            "those pods ask the device plugin for nvidia.com/gpu and run on whichever GPUs it gives"
            if unpinned.intersection(nodes)
            else "those pods select their GPUs by bus id at start"
        )
        warnings.append(
            f"GPU pinning needs a captured or live topology: {nodes_text(list(nodes))}: {problem}; {tail}; "
            f"to pin them, {FIX_PINNING}"
        )
    return "device-plugin", warnings
