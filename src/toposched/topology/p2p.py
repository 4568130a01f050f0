"""Reader for ``nvidia-smi topo -p2p r|w|rw`` text: which GPU pairs can talk peer to peer.

On a node whose GPUs meet over PCIe only, NCCL and the engines' custom all-reduce move data GPU to
GPU only where the driver allows peer-to-peer (P2P) access; elsewhere every byte goes through host
memory, several times slower (``perf/links.py``: ``pcie4`` against ``pcie4-nop2p``). ``topo -m``
does not say whether P2P is allowed; ``nvidia-smi topo -p2p r`` (read), ``w`` (write) or ``rw``
does, per ordered GPU pair (tab-separated in raw output)::

            GPU0    GPU1
     GPU0   X       GNS
     GPU1   GNS     X

    Legend:
      X    = Self
      OK   = Status Ok
      CNS  = Chipset not supported
      ...

Real captures (tests/data/fixtures/p2p/) have tabs or runs of spaces, trailing tabs, ANSI SGR codes
around the header and a legend with or without ``DR``. The legend is not needed: the statuses are
NVML's ``nvmlGpuP2PStatus_t`` (reference/engines.md), listed in ``P2PStatus``.

The reader refuses to guess: the header must name distinct ``GPUn`` columns, a row must follow for
every one of them in header order with exactly one cell per column, ``X`` exactly on the diagonal,
and every other cell a known status. Anything else is a ``TopologyParseError`` naming the source,
the line and the column; ``nvidia-smi topo -m`` text given by mistake is recognised and named.
Every step is linear in the input; more than ``MAX_GPUS`` columns is refused.

Limit: the capture does not say which ``-p2p`` mode made it. ``n`` (over NVLink) and ``a`` (atomics)
print the same matrix with other meanings (``n`` says NS for every pair of a PCIe-only node, whose
PCIe P2P may well be on), so only ``r``, ``w`` or ``rw`` captures should be given.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from toposched.errors import InputError, TopologyParseError
from toposched.inputs import read_text
from toposched.topology.model import Node

MAX_GPUS = 512
"""Most GPU columns read (a real node has 16 at most today)."""

MAX_P2P_BYTES = 1024 * 1024
"""Largest capture read (an 8-GPU one is under 1 kB)."""

CAPTURE_FIX = "capture it on the node with `nvidia-smi topo -p2p r > p2p.txt`"

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_GPU = re.compile(r"GPU(\d{1,4})", re.ASCII)  # ASCII digits; more than 4 is not a real index
_TOPO_M_WORDS = re.compile(r"\b(?:CPU|NUMA|Affinity|NIC\d+|mlx\d+_\d+|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)\b", re.ASCII)


class P2PStatus(StrEnum):
    """One cell of the matrix: NVML's ``nvmlGpuP2PStatus_t`` as ``nvidia-smi`` abbreviates it."""

    OK = "OK"
    CNS = "CNS"  # chipset not supported
    GNS = "GNS"  # GPU not supported (e.g. GeForce cards on recent drivers)
    TNS = "TNS"  # topology not supported (e.g. across CPU sockets)
    NS = "NS"  # not supported
    DR = "DR"  # disabled by a driver registry key
    U = "U"  # unknown

    @property
    def usable(self) -> bool | None:
        """True for OK, None for unknown, False for every kind of 'not supported' or 'disabled'."""
        if self is P2PStatus.OK:
            return True
        return None if self is P2PStatus.U else False


@dataclass(frozen=True)
class P2PMatrix:
    """What one capture says: the status of every ordered pair (row GPU, column GPU)."""

    gpus: tuple[int, ...]
    status: Mapping[tuple[int, int], P2PStatus]
    source: str = "<input>"

    def pair(self, a: int, b: int) -> bool | None:
        """Peer-to-peer between ``a`` and ``b`` both ways: False when either direction is refused,
        True when both are OK, None otherwise (unknown)."""
        both = (self.status[(a, b)].usable, self.status[(b, a)].usable)
        if False in both:
            return False
        return True if both == (True, True) else None

    def refused(self) -> list[tuple[int, int]]:
        """Unordered pairs ``a < b`` whose P2P is refused in either direction."""
        return [(a, b) for a in self.gpus for b in self.gpus if a < b and self.pair(a, b) is False]


@dataclass(frozen=True)
class _Line:
    number: int
    tokens: list[str]


def _tokens(raw: str) -> list[str]:
    return _ANSI.sub("", raw).replace("\r", "").split()


def parse_p2p_matrix(text: str, *, source: str = "<input>") -> P2PMatrix:
    """Read ``nvidia-smi topo -p2p r|w|rw`` output; raise ``TopologyParseError`` on bad input."""
    if "\x00" in text:
        raise TopologyParseError(
            "contains a NUL byte; not the text output of `nvidia-smi topo -p2p`",
            source=source,
            line=text.count("\n", 0, text.index("\x00")) + 1,
            fix=CAPTURE_FIX,
        )
    lines = [_Line(i + 1, _tokens(raw)) for i, raw in enumerate(text.split("\n"))]
    start, gpus = _header(lines, source)
    status: dict[tuple[int, int], P2PStatus] = {}
    body = iter(lines[start:])
    for done, row_gpu in enumerate(gpus):
        line = next(body, None)
        expected = f"GPU{row_gpu}"
        if line is None or not line.tokens:
            where = len(lines) if line is None else line.number
            raise TopologyParseError(
                f"expected the row of {expected} but the matrix ends ({done} of {len(gpus)} rows read); "
                "the capture is truncated",
                source=source,
                line=where,
                fix=CAPTURE_FIX,
            )
        _row(line, expected, row_gpu, gpus, status, source)
    for line in body:  # after the rows: a blank line and the legend; another GPU row is an error
        if line.tokens and _GPU.fullmatch(line.tokens[0]):
            raise TopologyParseError(
                f"row {line.tokens[0]} comes after the last row (the header has {len(gpus)} GPU columns); "
                "the matrix is not square",
                source=source,
                line=line.number,
            )
        if line.tokens:
            break
    return P2PMatrix(tuple(gpus), status, source)


def _header(lines: list[_Line], source: str) -> tuple[int, list[int]]:
    """(index of the first row line, GPU indices of the header's columns)."""
    for pos, line in enumerate(lines):
        if not line.tokens or not _GPU.fullmatch(line.tokens[0]):
            if line.tokens and _TOPO_M_WORDS.search(" ".join(line.tokens)) and "Legend:" not in line.tokens:
                raise TopologyParseError(
                    "this is `nvidia-smi topo -m` output; the P2P input needs `nvidia-smi topo -p2p r`",
                    source=source,
                    line=line.number,
                    fix=CAPTURE_FIX,
                )
            continue
        joined = " ".join(line.tokens)
        if _TOPO_M_WORDS.search(joined):
            raise TopologyParseError(
                "this is `nvidia-smi topo -m` output; the P2P input needs `nvidia-smi topo -p2p r`",
                source=source,
                line=line.number,
                fix=CAPTURE_FIX,
            )
        if len(line.tokens) > 1 and not _GPU.fullmatch(line.tokens[1]):
            raise TopologyParseError(
                f"expected the header (GPU0 GPU1 ...) but found a row ({joined[:40]!r})",
                source=source,
                line=line.number,
                fix=CAPTURE_FIX,
            )
        if len(line.tokens) > MAX_GPUS:
            raise TopologyParseError(
                f"the header names {len(line.tokens)} columns (at most {MAX_GPUS} are read)",
                source=source,
                line=line.number,
            )
        gpus: list[int] = []
        for token in line.tokens:
            m = _GPU.fullmatch(token)
            if m is None:
                raise TopologyParseError(
                    f"header column {token[:40]!r} is not a GPU (GPU0, GPU1, ...)",
                    source=source,
                    line=line.number,
                    column=token[:40],
                )
            index = int(m.group(1))
            if index in gpus:
                raise TopologyParseError(
                    f"GPU{index} appears twice in the header", source=source, line=line.number, column=token
                )
            gpus.append(index)
        return pos + 1, gpus
    empty = not any(line.tokens for line in lines)
    raise TopologyParseError(
        "the input is empty" if empty else "no `nvidia-smi topo -p2p` header (a line 'GPU0 GPU1 ...') found",
        source=source,
        fix=CAPTURE_FIX,
    )


def _row(
    line: _Line,
    expected: str,
    row_gpu: int,
    gpus: list[int],
    status: dict[tuple[int, int], P2PStatus],
    source: str,
) -> None:
    label, cells = line.tokens[0], line.tokens[1:]
    if label != expected:
        seen = _GPU.fullmatch(label) and int(label[3:]) in gpus
        problem = (
            f"expected the row of {expected} but found {label[:40]!r}"
            + (" again (a GPU row given twice or out of order)" if seen else "")
            + ("" if seen or _GPU.fullmatch(label) else "; the matrix is truncated or damaged")
        )
        raise TopologyParseError(problem, source=source, line=line.number)
    if len(cells) != len(gpus):
        raise TopologyParseError(
            f"row {expected} has {len(cells)} cells for {len(gpus)} GPU columns; the matrix is not square",
            source=source,
            line=line.number,
        )
    for col_gpu, cell in zip(gpus, cells, strict=True):
        column = f"GPU{col_gpu}"
        if col_gpu == row_gpu:
            if cell != "X":
                raise TopologyParseError(
                    f"the diagonal cell is {cell[:20]!r}, expected 'X'", source=source, line=line.number, column=column
                )
            continue
        try:
            status[(row_gpu, col_gpu)] = P2PStatus(cell)
        except ValueError:
            known = ", ".join(s.value for s in P2PStatus)
            hint = " (a `topo -m` path: pass `nvidia-smi topo -p2p r` output)" if _TOPO_M_WORDS.fullmatch(cell) else ""
            raise TopologyParseError(
                f"{cell[:20]!r} is not a P2P status (known: {known}){hint}",
                source=source,
                line=line.number,
                column=column,
            ) from None


def read_p2p_file(path: str | Path) -> P2PMatrix:
    """Read and parse a saved ``nvidia-smi topo -p2p r`` capture (a regular UTF-8 file, 1 MiB at most)."""
    shown = str(path)
    if "\x00" in shown:
        raise InputError(f"P2P capture {shown[:200]!r}: a path cannot contain a NUL byte", fix="check the path")
    text = read_text(path, what="P2P capture", max_bytes=MAX_P2P_BYTES, special_fix=f"save it first: {CAPTURE_FIX}")
    return parse_p2p_matrix(text, source=shown)


def _span(indices: Iterable[int]) -> str:
    values = sorted(indices)
    return ",".join(map(str, values)) if len(values) <= 8 else f"{values[0]}..{values[-1]} ({len(values)} GPUs)"


def apply_p2p(node: Node, matrix: P2PMatrix) -> Node:
    """``node`` with every GPU pair's ``p2p`` set from the capture; the capture must list exactly the
    node's GPUs (else ``InputError`` naming both)."""
    have, given = {g.index for g in node.gpus}, set(matrix.gpus)
    if have != given:
        raise InputError(
            f"{matrix.source}: the P2P capture lists GPUs {_span(given)} but node {node.name} has GPUs {_span(have)}",
            fix="capture `nvidia-smi topo -m` and `nvidia-smi topo -p2p r` on the same node",
        )
    links = tuple(link.model_copy(update={"p2p": matrix.pair(link.a, link.b)}) for link in node.links)
    return node.model_copy(update={"links": links})


def set_p2p(node: Node, p2p: bool | None) -> Node:
    """``node`` with the same P2P availability on every GPU pair (a cluster spec's ``p2p: on|off``)."""
    return node.model_copy(update={"links": tuple(link.model_copy(update={"p2p": p2p}) for link in node.links)})
