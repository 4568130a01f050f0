"""The ``Node`` a read ``nvidia-smi topo -m`` matrix describes: its GPUs, NICs and links, the host
name from a shell prompt before the command, and the NICs' RDMA devices from the ``NIC Legend``.
``topology/smi.py`` reads the text into the lines and header held here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import ValidationError

from toposched.errors import TopologyParseError, first_problem
from toposched.names import node_name_problem, word_problem
from toposched.topology.model import GPU, MAX_GPU_INDEX, NIC, Link, LinkKind, NicLink, Node, nominal_link

_PROMPT = re.compile(r"[\w.-]+@([\w.-]+):[^$#]*[$#]")  # matched against one word: "root@host:~#"
_NIC_LEGEND = re.compile(r"^(NIC\d+):\s*(\S+)\s*$", re.ASCII)
NUMA_ID = re.compile(r"^\d{1,4}$", re.ASCII)  # ASCII digits, a real node count


@dataclass(frozen=True)
class SmiLine:
    """One input line: its number and its text, cleaned."""

    number: int  # 1-based line number in the input
    text: str  # ANSI removed, prefix ('#', indentation) removed, trailing whitespace kept


@dataclass(frozen=True)
class SmiHeader:
    """The matrix header: its line, its device columns (GPUs first) and its affinity columns."""

    line: int
    devices: tuple[str, ...]  # GPU columns then NIC columns, as named in the header
    gpus: tuple[str, ...]
    affinity: tuple[str, ...]  # affinity column labels present, in order


def _numa_node(value: str | None) -> int | None:
    """A single NUMA node, or None for N/A, ranges over several nodes and lists."""
    if value is None:
        return None
    if NUMA_ID.match(value):
        return int(value)
    m = re.fullmatch(r"(\d{1,4})-(\d{1,4})", value, re.ASCII)
    if m and m.group(1) == m.group(2):
        return int(m.group(1))
    return None


MAX_NVLINKS = 64
"""More NVLinks between two GPUs than any NVIDIA part has (18 on H100/B200): a cell over it is not real."""


def _kind(cell: str) -> tuple[LinkKind, int]:
    if cell.startswith("NV"):
        digits = cell[2:]
        if len(digits) > 2 or not 1 <= int(digits) <= MAX_NVLINKS:
            raise ValueError(f"link cell {cell[:12]!r} is not a count of 1 to {MAX_NVLINKS} NVLinks")
        return LinkKind.NVLINK, int(digits)
    return LinkKind(cell), 0


def _first_error(exc: ValueError) -> str:
    """A one-line reason from a ``ValueError`` or pydantic's ``ValidationError``."""
    if isinstance(exc, ValidationError):
        problem = first_problem(exc)
        return f"{problem.path}: {problem.msg}" if problem.path else problem.msg
    return str(exc)


def _prompt_host(text: str) -> str | None:
    """The host in a shell prompt before ``nvidia-smi topo`` (``root@dl380ag11:~# nvidia-smi topo -m``)."""
    at = text.find("nvidia-smi")
    if at < 0 or "topo" not in text[at:]:
        return None
    for word in reversed(text[:at].split()):
        if word.endswith(("$", "#")):
            m = _PROMPT.fullmatch(word)
            return m.group(1) if m else None
    return None


def _legend(header: SmiHeader, lines: list[SmiLine], source: str) -> dict[str, str]:
    """``NICn -> device`` from the NIC Legend lines after the header; every device one safe word."""
    legend: dict[str, str] = {}
    for line in lines:
        if line.number <= header.line:
            continue
        m = _NIC_LEGEND.match(line.text.strip())
        if not m:
            continue
        nic, device = m.group(1), m.group(2)
        problem = word_problem(device, f"NIC Legend device of {nic}")
        if problem:
            raise TopologyParseError(problem, source=source, line=line.number, column=nic)
        if legend.get(nic, device) != device:
            raise TopologyParseError(
                f"the NIC Legend names {nic} twice ({legend[nic]}, {device})", source=source, line=line.number
            )
        legend[nic] = device
    return legend


def _unnamed_nics_warning(unnamed: list[str], legend: dict[str, str], nic_count: int) -> str:
    """A warning naming the NIC columns whose RDMA device the capture does not give."""
    listed = ", ".join(unnamed)
    if legend:
        why = (
            f"the NIC Legend names {nic_count - len(unnamed)} of {nic_count} NICs and has no entry for {listed} "
            "(is the legend cut?)"
        )
    else:
        why = f"there is no NIC Legend for {listed}"
    return (
        f"{why}: their RDMA device names are unknown, so NCCL_IB_HCA cannot list them; capture the whole "
        "`nvidia-smi topo -m` output, including the 'NIC Legend:' lines"
    )


def build_node(
    header: SmiHeader,
    rows: dict[str, list[str]],
    affinity: dict[str, dict[str, str]],
    lines: list[SmiLine],
    source: str,
    hostname: str | None,
    warnings: list[str],
) -> Node:
    if hostname is None:
        for line in lines:
            if line.number > header.line:
                break
            prompt_host = _prompt_host(line.text)
            if prompt_host is not None:
                problem = node_name_problem(prompt_host)
                if problem:
                    warnings.append(f"line {line.number}: the shell prompt's host is not used: {problem}")
                else:
                    hostname = prompt_host
                break
    legend = _legend(header, lines, source)

    gpu_index: dict[str, int] = {}
    for name in header.gpus:
        if len(name) > 3 + 4 or int(name[3:]) > MAX_GPU_INDEX:
            raise TopologyParseError(f"GPU index {name[:20]!r} is too large (at most {MAX_GPU_INDEX})", source=source)
        index = int(name[3:])
        if index in gpu_index.values():
            raise TopologyParseError(f"{name} names the same GPU as another header column", source=source)
        gpu_index[name] = index
    try:
        gpus = []
        for name in header.gpus:
            values = affinity.get(name, {})
            numa_text = values.get("NUMA Affinity") or None
            cpu_text = values.get("CPU Affinity") or None
            gpus.append(
                GPU(
                    index=gpu_index[name],
                    numa_node=_numa_node(numa_text),
                    numa_affinity=numa_text,
                    cpu_affinity=None if cpu_text in (None, "N/A") else cpu_text,
                )
            )
        nic_names = header.devices[len(header.gpus) :]
        devices = {n: legend.get(n) if n.startswith("NIC") else n for n in nic_names}
        unnamed = [n for n in nic_names if devices[n] is None]
        if unnamed:
            warnings.append(_unnamed_nics_warning(unnamed, legend, len(nic_names)))
        nics = [NIC(name=n, device=devices[n]) for n in nic_names]
        links: list[Link] = []
        nic_links: list[NicLink] = []
        for i, a in enumerate(header.gpus):
            for j, b in enumerate(header.devices):
                cell = rows[a][j]
                if j == i:
                    continue
                kind, lanes = _kind(cell)
                if b in gpu_index:
                    if j > i:
                        bandwidth, latency = nominal_link(kind, lanes)
                        lo, hi = sorted((gpu_index[a], gpu_index[b]))
                        links.append(
                            Link(a=lo, b=hi, kind=kind, nvlinks=lanes, bandwidth_gbps=bandwidth, latency_us=latency)
                        )
                else:
                    nic_links.append(NicLink(gpu=gpu_index[a], nic=b, kind=kind))
    except ValueError as exc:  # a value the model refuses (ValidationError is one), a link count out of range
        raise TopologyParseError(_first_error(exc), source=source) from None
    try:
        return Node(
            name=hostname or "localhost",
            gpus=tuple(gpus),
            nics=tuple(nics),
            links=tuple(links),
            nic_links=tuple(nic_links),
            source=f"nvidia-smi topo -m: {source}",
        )
    except ValidationError as exc:  # the checks above should leave nothing for the model to refuse
        bad = first_problem(exc)
        raise TopologyParseError(f"not a valid node: {bad.path}: {bad.msg}", source=source) from None
