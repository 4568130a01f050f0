"""What reading an NCCL log gives: each channel connection, the findings, and the report
(``verify nccl``'s JSON form). ``sidecar/nccl.py`` reads the log; ``sidecar/nccl_findings.py`` draws
the findings."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

Severity = Literal["warning", "info"]


@dataclass(frozen=True)
class Connection:
    """One ``via`` line: a channel connection between two ranks (or a CollNet endpoint)."""

    kind: str  # Channel / Ring / CollNet
    channel: int
    src: int
    dst: int | None
    direction: str | None  # send / receive / None (P2P and SHM lines are printed by the sender)
    transport: str  # as printed, e.g. "NET/IBext_v8/5(2)/GDRDMA"
    family: str  # e.g. "NET/IB"
    gdrdma: bool
    host: str | None  # the host of the process that printed the line

    @property
    def logger_rank(self) -> int:
        """The rank whose process printed the line."""
        return self.dst if self.direction == "receive" and self.dst is not None else self.src


_CONNECTION_FIELDS = tuple(f.name for f in fields(Connection))  # asdict() is 10x slower on 100k connections


@dataclass(frozen=True)
class Finding:
    code: str
    severity: Severity
    message: str


@dataclass(frozen=True)
class NcclReport:
    source: str
    nccl_version: str | None
    nranks: int | None
    nranks_source: str | None
    nnodes: int | None
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    transports: tuple[str, ...]
    gdrdma: bool
    nvls: bool
    connections: tuple[Connection, ...]
    communicators: tuple[dict[str, Any], ...]
    findings: tuple[Finding, ...]
    records: int
    skipped_records: int

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form of ``verify nccl --json``."""
        return {
            "source": self.source,
            "nccl_version": self.nccl_version,
            "nranks": self.nranks,
            "nranks_source": self.nranks_source,
            "nnodes": self.nnodes,
            "ranks": list(self.ranks),
            "hosts": list(self.hosts),
            "transports": list(self.transports),
            "gdrdma": self.gdrdma,
            "nvls": self.nvls,
            "findings": [asdict(f) for f in self.findings],
            "connections": [{name: getattr(c, name) for name in _CONNECTION_FIELDS} for c in self.connections],
            "communicators": list(self.communicators),
            "records": self.records,
            "skipped_records": self.skipped_records,
        }

    def finding_codes(self) -> set[str]:
        return {f.code for f in self.findings}
