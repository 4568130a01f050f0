"""Reading NCCL INFO logs (``NCCL_DEBUG=INFO``): ranks, nodes, the transport of each connection.

A log is a stream of *records*: ``host:pid:tid [dev] [file.cc:line] NCCL INFO|WARN text``. Real
captures add things around them, and this reader copes with each without guessing:

* prefixes: OpenMPI ``[1,N]<stdout>:`` tags, timestamps, container names, shell prompts;
* blank lines and non-NCCL lines (engine logs, nccl-tests tables): ignored;
* two processes writing into one stream: a record header in the middle of a line means the text
  before it was cut off. That cut record is dropped (counted in ``skipped_records``); the record
  that starts mid-line is complete. A host name glued to the cut text (``send 0.000proxmox``) is
  repaired only when a more frequent host is a suffix of it;
* user remarks appended after a line: the transport token must end at whitespace or the line end,
  so ``via P2P/IPC/read  <- NVLink`` reads as ``P2P/IPC/read``; a token that does not parse as a
  whole (a splice inside it) drops the record rather than half-reading it.

Line formats from NCCL 2.4 (``Ring 00 : 0 -> 1 [receive] via NET/Socket/0``) to 2.30
(``Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read``) are read by one grammar. Transports are
reported by family: ``P2P/IPC``, ``P2P/CUMEM``, ``P2P/direct`` (``direct pointer``), ``P2P/MNNVL``,
``SHM``, ``NET/IB`` (any ``IBext_vN`` plugin name too), ``NET/Socket``, ``NET/<plugin>`` (e.g.
``NET/AWS Libfabric``), ``COLLNET`` and ``NVLS`` (from the NVLS lines, which have no ``via``).

Every step is linear in the log's size: a record header is only looked for where a host name can
start (not inside a longer run of host characters), host repair looks up each host's suffixes by
length instead of comparing every pair of hosts, and connections are split into intra- and
inter-node ones in one pass. ``read_nccl_file`` reads at most ``MAX_LOG_BYTES``; a bigger log is
refused with a hint to keep only the NCCL lines (``grep NCCL job.log``), since a log's size is
mostly engine output while NCCL's records are a small part of it.

``nranks`` is what NCCL printed (``nranks N`` / ``nRanks N``); when a cut log has no such line it
is the length of a full ring listing (``Channel 00/08 : 0 7 6 ...``), and failing that the count of
ranks seen when they are exactly ``0..n-1``; ``nranks_source`` says which. ``nnodes`` is NCCL's
``nNodes`` or ``None``.
"""

from __future__ import annotations

import os
import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toposched.errors import InputError
from toposched.inputs import read_bytes
from toposched.sidecar.nccl_findings import collect_findings
from toposched.sidecar.nccl_report import Connection, NcclReport

MAX_LOG_BYTES = 64 * 1024 * 1024
"""Largest NCCL log file read (64 MiB: ~3 s of reading; NCCL's own lines for thousands of ranks fit)."""

MAX_HOST = 253
"""Longest host name a record may be repaired to (RFC 1123); longer "hosts" are spliced junk."""

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# The lookbehind lets a host start only where a run of host characters starts: without it every
# position inside a long run is tried and each try scans to the run's end (quadratic).
# Numbers are bounded to 9 digits (20 for thread ids) so int() never meets Python's 4,300-digit limit.
_HEADER = re.compile(
    r"(?<![A-Za-z0-9_.\-])(?P<host>[A-Za-z0-9_.\-]+):(?P<pid>\d{1,10}):(?P<tid>\d{1,20}) \[(?P<dev>-?\d{1,6})\] "
    r"(?:(?P<src>[\w./\-]+:\d+) )?NCCL (?P<level>INFO|WARN|TRACE|ABORT)\b ?"
)
_BARE_VERSION = re.compile(r"^\s*(?:\[\d+,\d+\]<std(?:out|err)>:)?\s*NCCL version (?P<v>\d+\.\d+\.\d+)")
_VERSION = re.compile(r"^NCCL version (?P<v>\d+\.\d+\.\d+)")
_CONNECTION = re.compile(
    r"^\s*(?P<kind>Channel|Ring|CollNet|NVLS|Tree) (?P<ch>\d{1,9})(?:/(?P<sub>\d{1,9}))? : "
    r"(?P<a>\d{1,9})(?:\[(?P<abus>[0-9a-fA-Fx]+)\])?"
    r"(?: -> (?P<b>\d{1,9})(?:\[(?P<bbus>[0-9a-fA-Fx]+)\])?)?"
    r"(?: \[(?P<dir>send|receive)\])? via (?P<transport>.*)$"
)
_TRANSPORT = re.compile(
    r"(?:"
    r"P2P/(?P<p2p>direct pointer|indirect/\d+\[\w+\]|[A-Za-z]+)(?P<p2pread>/read)?(?:/CE)?"
    r"|SHM(?:/[A-Za-z]+/[A-Za-z]+)?"
    r"|NET/(?P<net>[^/\s][^/]*?)/(?P<dev>\d{1,9})(?:\(\d+\))?(?P<gdr>/GDRDMA)?(?:/Shared)?"
    r"|COLLNET/(?P<coll>[^/\s]+)/\d+(?:\(\d+\))?(?P<cgdr>/GDRDMA)?(?:/Shared)?"
    r"|NVLS"
    r")(?=\s|$)"
)
_RING = re.compile(r"^\s*(?:Channel|Ring) \d+(?:/\d+)? :(?P<ranks>(?: +\d{1,9})+) *$")
_NRANKS = re.compile(r"\bn[Rr]anks (\d{1,9})\b")
_NNODES = re.compile(r"\bnNodes (\d{1,9})\b")
_RANK = re.compile(r"\brank (\d{1,9}) n[Rr]anks (\d{1,9})\b")
_COMM_ID = re.compile(r"\bcommId (0x[0-9a-fA-F]+)")
_NVLS_CHANNELS = re.compile(r"\b(\d{1,9}) nvls channels\b")
_P2P_DISABLED = re.compile(r"NCCL_P2P_DISABLE set by environment to [1-9]")
_MNNVL_ON = re.compile(r"\bMNNVL 1\b")
_IB_NAME = re.compile(r"^IB(?:ext(?:_v\d+)?)?$")
# GPUs sold on NVSwitch (HGX/DGX) boards with NVLink SHARP (Hopper and later).
_NVSWITCH_GPU = re.compile(r"\b(H100 80GB HBM3|H100-SXM|H800|H200|H20\b|B200|B100|B300|GB200|GB300)", re.I)


@dataclass
class _Record:
    host: str
    dev: int
    level: str
    body: str


@dataclass
class _Scan:
    records: list[_Record] = field(default_factory=list)
    skipped: int = 0
    version: str | None = None


def family_of(transport: str) -> tuple[str, bool] | None:
    """(family, uses GPUDirect RDMA) of a transport token, or None when it is not a whole token."""
    m = _TRANSPORT.match(transport)
    if m is None:
        return None
    if m.group("p2p") is not None:
        kind = m.group("p2p")
        if kind == "direct pointer":
            kind = "direct"
        elif kind.startswith("indirect"):
            kind = "indirect"
        return f"P2P/{kind}", False
    if transport.startswith("SHM"):
        return "SHM", False
    if m.group("net") is not None:
        name = m.group("net")
        return f"NET/{'IB' if _IB_NAME.match(name) else name}", m.group("gdr") is not None
    if m.group("coll") is not None:
        return "COLLNET", m.group("cgdr") is not None
    return "NVLS", False


def _scan(text: str) -> _Scan:
    scan = _Scan()
    for raw in text.splitlines():
        line = _ANSI.sub("", raw).replace("\x00", "")
        heads = list(_HEADER.finditer(line))
        if not heads:
            m = _BARE_VERSION.match(line)
            if m and scan.version is None:
                scan.version = m.group("v")
            continue
        for i, head in enumerate(heads):
            if i + 1 < len(heads):  # another record starts inside this one: it was cut off
                scan.skipped += 1
                continue
            body = line[head.end() :].rstrip()
            scan.records.append(_Record(head.group("host"), int(head.group("dev")), head.group("level"), body))
    return scan


def _repair_hosts(records: list[_Record]) -> None:
    """Give a record whose host swallowed spliced text (``0.000proxmox``) the frequent host it ends with.

    Of the hosts seen more often than a host ``h`` that are proper suffixes of ``h``, the longest
    wins. Only the lengths of hosts seen at least twice (and at most ``MAX_HOST`` long) are tried
    as suffix lengths, so the work is linear in the number of hosts, not quadratic.
    """
    counts = Counter(r.host for r in records)
    lengths = sorted({len(h) for h, c in counts.items() if c > 1 and len(h) <= MAX_HOST}, reverse=True)
    fixed: dict[str, str] = {}
    for host, n in counts.items():
        for length in lengths:
            if length >= len(host):
                continue
            suffix = host[-length:]
            if counts.get(suffix, 0) > n:
                fixed[host] = suffix
                break
    if fixed:
        for r in records:
            r.host = fixed.get(r.host, r.host)


def read_nccl_log(text: str, *, source: str = "<log>", nvswitch: bool | None = None) -> NcclReport:
    """Analyse NCCL INFO output; ``InputError`` when the text holds no NCCL record at all.

    ``nvswitch`` says whether the GPUs sit on an NVSwitch board (for the NVLS finding); ``None``
    lets the GPU model names in the log decide.
    """
    if not text.strip():
        raise InputError(f"{source}: empty file, not an NCCL log (capture the job's output with NCCL_DEBUG=INFO)")
    if "\x00" in text[:4096] or text.count("\ufffd") > max(16, len(text) // 100):
        raise InputError(f"{source}: binary data, not an NCCL log (pass the text written with NCCL_DEBUG=INFO)")
    scan = _scan(text)
    if not scan.records:
        raise InputError(
            f"{source}: no NCCL INFO/WARN records (lines like 'host:pid:tid [0] NCCL INFO ...'); not an NCCL log"
        )
    _repair_hosts(scan.records)
    return _analyse(scan, source, nvswitch, text)


def read_nccl_file(path: str | Path, *, nvswitch: bool | None = None) -> NcclReport:
    """Analyse an NCCL log file of at most ``MAX_LOG_BYTES`` (a regular file; bad UTF-8 is replaced).

    Logs interleave processes, so a multi-byte character can be cut: undecodable bytes become
    U+FFFD rather than failing the read (a log that is mostly undecodable is refused as binary).
    """
    try:
        info: os.stat_result | None = os.stat(path)
    except (OSError, ValueError):
        info = None  # read_bytes below reports what is wrong with the path
    if info is not None and stat.S_ISREG(info.st_mode) and info.st_size > MAX_LOG_BYTES:
        raise InputError(
            f"NCCL log {str(path)!r} is {info.st_size:,} bytes; at most {MAX_LOG_BYTES:,} are read",
            fix=f"keep only NCCL's lines, e.g. `grep NCCL {path} > nccl.log`, and pass that file",
        )
    data = read_bytes(
        path,
        what="NCCL log",
        max_bytes=MAX_LOG_BYTES,
        special_fix="save the log first: `NCCL_DEBUG=INFO ... 2> nccl.log`",
    )
    return read_nccl_log(data.decode("utf-8", errors="replace"), source=str(path), nvswitch=nvswitch)


def _analyse(scan: _Scan, source: str, nvswitch: bool | None, text: str) -> NcclReport:
    connections: list[Connection] = []
    skipped = scan.skipped
    version = scan.version
    nranks_reported: list[int] = []
    nnodes_reported: list[int] = []
    ring_sizes: list[int] = []
    rank_hosts: dict[int, set[str]] = {}
    comms: dict[str, dict[str, Any]] = {}
    nvls_available = nvls_unavailable = False
    nvls_channels: list[int] = []
    env_p2p_disabled = collnet_failed = mnnvl_on = False
    for r in scan.records:
        body = r.body
        m = _VERSION.match(body)
        if m and version is None:
            version = m.group("v")
        conn = _CONNECTION.match(body)
        if conn is not None:
            parsed = family_of(conn.group("transport"))
            token = _TRANSPORT.match(conn.group("transport"))
            if parsed is None or token is None:
                skipped += 1  # a splice or damage inside the transport token
                continue
            c = Connection(
                kind=conn.group("kind"),
                channel=int(conn.group("ch")),
                src=int(conn.group("a")),
                dst=int(conn.group("b")) if conn.group("b") is not None else None,
                direction=conn.group("dir"),
                transport=token.group(0),
                family=parsed[0],
                gdrdma=parsed[1],
                host=r.host,
            )
            connections.append(c)
            rank_hosts.setdefault(c.logger_rank, set()).add(r.host)
            continue
        ring = _RING.match(body)
        if ring is not None:
            ring_sizes.append(len(set(ring.group("ranks").split())))
            continue
        nranks_reported.extend(int(x) for x in _NRANKS.findall(body))
        nnodes_reported.extend(int(x) for x in _NNODES.findall(body))
        rank = _RANK.search(body)
        if rank is not None:
            rank_hosts.setdefault(int(rank.group(1)), set()).add(r.host)
            comm_id = _COMM_ID.search(body)
            if comm_id is not None:
                entry = comms.setdefault(comm_id.group(1), {"comm_id": comm_id.group(1), "nranks": 0, "ranks": set()})
                entry["nranks"] = int(rank.group(2))
                entry["ranks"].add(int(rank.group(1)))
        if "NVLS multicast support is available" in body or "Connected NVLS" in body:
            nvls_available = True
        if "NVLS multicast support is not available" in body:
            nvls_unavailable = True
        nvls_channels.extend(int(x) for x in _NVLS_CHANNELS.findall(body))
        if _P2P_DISABLED.search(body):
            env_p2p_disabled = True
        if "Cannot initialize CollNet" in body:
            collnet_failed = True
        if _MNNVL_ON.search(body):
            mnnvl_on = True

    hosts = tuple(sorted({r.host for r in scan.records}))
    ranks = sorted({c.src for c in connections} | {c.dst for c in connections if c.dst is not None} | set(rank_hosts))
    nranks: int | None
    if nranks_reported:
        nranks, nranks_source = max(nranks_reported), "reported"
    elif ring_sizes:
        nranks, nranks_source = max(ring_sizes), "ring"
    elif ranks and ranks == list(range(len(ranks))):
        nranks, nranks_source = len(ranks), "connections"
    else:
        nranks, nranks_source = None, None
    nnodes = max(nnodes_reported) if nnodes_reported else None
    nvls = any(n > 0 for n in nvls_channels) or (nvls_available and not nvls_channels)
    families = {c.family for c in connections}
    if nvls:
        families.add("NVLS")
    host_of = {rank: next(iter(h)) for rank, h in rank_hosts.items() if len(h) == 1}
    if nvswitch is None:
        nvswitch = bool(_NVSWITCH_GPU.search(text)) and "PCIe" not in text
    findings = collect_findings(
        connections=connections,
        host_of=host_of,
        hosts=hosts,
        nranks=nranks,
        nnodes=nnodes,
        env_p2p_disabled=env_p2p_disabled,
        collnet_failed=collnet_failed,
        nvls=nvls,
        nvls_unavailable=nvls_unavailable or (bool(nvls_channels) and not nvls),
        nvswitch=nvswitch,
        mnnvl=mnnvl_on or "P2P/MNNVL" in families,
        skipped=skipped,
    )
    communicators = tuple(
        {"comm_id": c["comm_id"], "nranks": c["nranks"], "ranks_seen": sorted(c["ranks"])} for c in comms.values()
    )
    return NcclReport(
        source=source,
        nccl_version=version,
        nranks=nranks,
        nranks_source=nranks_source,
        nnodes=nnodes,
        ranks=tuple(ranks),
        hosts=hosts,
        transports=tuple(sorted(families)),
        gdrdma=any(c.gdrdma for c in connections),
        nvls=nvls,
        connections=tuple(connections),
        communicators=communicators,
        findings=tuple(findings),
        records=len(scan.records),
        skipped_records=skipped,
    )
