"""Reader for ``nvidia-smi topo -m`` text, as captured from real machines.

Real captures vary a lot (see tests/data/fixtures/README.md): raw tab-separated output or pasted
copies with runs of spaces; ANSI SGR codes around the header; indentation, ``#`` prefixes and a
shell-prompt line; ``X`` centred or left-aligned; glued cells (``NIC7NIC8``, ``SYSSYS``); NIC
columns as ``NICn`` with a NIC Legend or as ``mlx5_N``; CPU / NUMA / GPU-NUMA columns present or
not; NUMA as a number, a range, a list or ``N/A``; old drivers' ``SOC`` for ``SYS``.

The reader recovers what is complete and refuses to guess: when a GPU row is cut short, the
whole read fails with a ``TopologyParseError`` naming the line and column; when only NIC rows are
cut (every GPU row is whole), the GPU picture is complete and the read succeeds with a warning.

How affinity cells are mapped: the text after the link cells is split on tabs or spaces and empty
cells are dropped (raw output pads with empty tab cells). With as many values as affinity columns
they map in order. With fewer, only ``CPU Affinity`` may be missing (it is empty on some
containerised GB200 nodes; the NUMA columns print ``N/A`` rather than nothing), so values are
right-aligned and a warning says so. A GPU row that is the input's last line, with no newline after
it, is treated as cut when rows are still expected after it or when it lacks affinity values.

NIC names: a ``NICn`` column takes its RDMA device from the ``NIC Legend`` (``NIC0: mlx5_0``). A
NIC with no legend entry (no legend, or a legend cut short) keeps ``device=None`` and a warning
names those columns: their device names are unknown, so nothing downstream may list a subset of
the node's HCAs as if it were all of them. Device names must be one safe word
(``toposched.names.word_problem``); anything else, and any NUL byte, is a ``TopologyParseError``.

Hostile input is bounded: every step is linear in the input, and a header naming more than
``MAX_DEVICES`` columns is refused (real machines have a few dozen GPUs and NICs at most).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from toposched.errors import TopologyParseError
from toposched.names import node_name_problem, word_problem
from toposched.topology.model import Node
from toposched.topology.smi_node import NUMA_ID, SmiHeader, SmiLine, build_node

MAX_DEVICES = 512
"""Most header columns (GPUs + NICs) read; a real ``nvidia-smi topo -m`` shows a few dozen."""

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_CELL = re.compile(r"[ \t]*(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)", re.ASCII)
_P2P_CELL = re.compile(r"^(OK|CNS|GNS|TNS|NS|DR|U)$")
_AFFINITY_LABELS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_DEVICE_TOKEN = re.compile(r"GPU\d+|NIC\d+|mlx\d+_(?:bond_)?\d+|[A-Za-z][\w.:-]*", re.ASCII)
_GLUED = re.compile(r"(?:GPU\d+|NIC\d+|mlx\d+_(?:bond_)?\d+)", re.ASCII)
_CPULIST = re.compile(r"^\d{1,6}(?:-\d{1,6})?(?:,\d{1,6}(?:-\d{1,6})?)*$", re.ASCII)


@dataclass(frozen=True)
class SmiTopology:
    """What one ``nvidia-smi topo -m`` capture says, and what the reader had to work around."""

    node: Node
    warnings: tuple[str, ...] = ()


def _clean(raw: str) -> str:
    text = _ANSI.sub("", raw).replace("\r", "")
    stripped = text.lstrip()
    if stripped.startswith("#"):
        stripped = stripped[1:]
    return stripped.lstrip(" \t")


def _split_header(text: str) -> list[str]:
    for i, label in enumerate(_AFFINITY_LABELS):
        text = text.replace(label, f" \x00{i} ")
    tokens: list[str] = []
    for token in text.split():
        if token.startswith("\x00"):
            tokens.append(_AFFINITY_LABELS[int(token[1:])])
            continue
        parts = _GLUED.findall(token)
        if parts and "".join(parts) == token:
            tokens.extend(parts)
        else:
            tokens.append(token)
    return tokens


def _find_header(lines: list[SmiLine], source: str) -> SmiHeader:
    for line in lines:
        if not line.text.startswith("GPU0"):
            continue
        tokens = _split_header(line.text)
        if len(tokens) < 2 or tokens[1] in ("X",) or _CELL.fullmatch(tokens[1]) or _P2P_CELL.match(tokens[1]):
            continue  # a matrix row, not the header
        devices: list[str] = []
        affinity: list[str] = []
        for token in tokens:
            if token in _AFFINITY_LABELS:
                affinity.append(token)
            elif affinity:
                raise TopologyParseError(
                    f"unexpected column {token!r} after the affinity columns",
                    source=source,
                    line=line.number,
                    column=token,
                )
            elif _DEVICE_TOKEN.fullmatch(token):
                devices.append(token)
            else:
                raise TopologyParseError(
                    f"cannot read header column {token!r}", source=source, line=line.number, column=token
                )
        gpus = tuple(d for d in devices if re.fullmatch(r"GPU\d+", d, re.ASCII))
        if devices[: len(gpus)] != list(gpus):
            raise TopologyParseError(
                "GPU columns must come before NIC columns in the header", source=source, line=line.number
            )
        if len(set(devices)) != len(devices):
            raise TopologyParseError("a column name appears twice in the header", source=source, line=line.number)
        if len(devices) > MAX_DEVICES:
            raise TopologyParseError(
                f"the header names {len(devices)} GPU and NIC columns (at most {MAX_DEVICES} are read)",
                source=source,
                line=line.number,
            )
        for name in devices[len(gpus) :]:
            problem = word_problem(name, "NIC column")
            if problem:
                raise TopologyParseError(problem, source=source, line=line.number, column=name[:40])
        return SmiHeader(line.number, tuple(devices), gpus, tuple(affinity))
    raise TopologyParseError(_not_a_matrix_reason(lines), source=source, fix="pass the output of `nvidia-smi topo -m`")


def _not_a_matrix_reason(lines: list[SmiLine]) -> str:
    text = "\n".join(line.text for line in lines)
    if not text.strip():
        return "the input is empty; expected the output of `nvidia-smi topo -m`"
    if "ROCm" in text or "rocm-smi" in text:
        return "this is rocm-smi output, not `nvidia-smi topo -m`"
    if "Status Ok" in text or re.search(r"\bGNS\b|\bCNS\b", text):
        return "this is `nvidia-smi topo -p2p` output (pass it as --p2p FILE); toposched needs `nvidia-smi topo -m`"
    return "no `nvidia-smi topo -m` header (a line starting 'GPU0 GPU1 ...' or 'GPU0 CPU Affinity') found"


def _cells(text: str, count: int) -> tuple[list[str], str]:
    """Read up to ``count`` link cells from the start of ``text``; return them and the rest."""
    cells: list[str] = []
    pos = 0
    while len(cells) < count:
        m = _CELL.match(text, pos)
        if not m:
            break
        cells.append("SYS" if m.group(1) == "SOC" else m.group(1))
        pos = m.end()
    return cells, text[pos:]


def _row_label(text: str) -> str:
    m = re.match(r"(GPU\d+|NIC\d+|mlx\d+_(?:bond_)?\d+|[A-Za-z][\w.:-]*)", text, re.ASCII)
    return m.group(1) if m else ""


def parse_topo_matrix(text: str, *, source: str = "<input>", hostname: str | None = None) -> SmiTopology:
    """Read ``nvidia-smi topo -m`` output into a ``Node``; raise ``TopologyParseError`` on bad input."""
    if "ROCm System Management Interface" in text or "rocm-smi" in text:
        raise TopologyParseError("this is rocm-smi output, not `nvidia-smi topo -m`", source=source)
    if "\x00" in text:
        raise TopologyParseError(
            "contains a NUL byte; not the text output of `nvidia-smi topo -m`",
            source=source,
            line=text.count("\n", 0, text.index("\x00")) + 1,
            fix="capture it again with `nvidia-smi topo -m > topo.txt`",
        )
    if hostname is not None and node_name_problem(hostname):
        raise TopologyParseError(f"hostname: {node_name_problem(hostname)}", source=source)
    raw_lines = text.split("\n")
    lines = [SmiLine(i + 1, _clean(raw)) for i, raw in enumerate(raw_lines)]
    header = _find_header(lines, source)
    warnings: list[str] = []
    n_dev = len(header.devices)
    n_gpu = len(header.gpus)
    rows: dict[str, list[str]] = {}
    affinity: dict[str, dict[str, str]] = {}
    expected = list(header.devices)
    body = [line for line in lines if line.number > header.line]
    # A row that is the input's last line with no newline after it may have been cut anywhere.
    cut_line = len(raw_lines) if raw_lines[-1].strip() else None

    for line in body:
        if not expected:
            break
        name = expected[0]
        label = _row_label(line.text)
        if label != name:
            if name in header.gpus:
                got = f"{line.text.strip()[:40]!r}" if line.text.strip() else "a blank line"
                raise TopologyParseError(
                    f"expected the row of {name} but found {got}; the matrix is truncated or damaged "
                    f"({len(rows)} of {n_gpu} GPU rows read)",
                    source=source,
                    line=line.number,
                )
            warnings.append(
                f"line {line.number}: NIC rows stop before {name}; GPU rows are complete, so only "
                "NIC-to-NIC paths are unknown"
            )
            break
        cells, rest = _cells(line.text[len(label) :], n_dev)
        if len(cells) < n_dev:
            column = header.devices[len(cells)]
            snippet = rest.strip()[:20]
            if _P2P_CELL.match(snippet.split()[0] if snippet else ""):
                raise TopologyParseError(
                    "this is `nvidia-smi topo -p2p` output (cells such as OK/GNS; pass it as --p2p FILE); "
                    "toposched needs `nvidia-smi topo -m` here",
                    source=source,
                    line=line.number,
                    column=column,
                )
            if name in header.gpus:
                raise TopologyParseError(
                    f"row {name} has {len(cells)} of {n_dev} link cells"
                    + (f"; {snippet!r} is not a link value" if snippet else "")
                    + " (truncated or damaged input)",
                    source=source,
                    line=line.number,
                    column=column,
                )
            warnings.append(
                f"line {line.number}: row {name} is cut at column {column}; GPU rows are complete, "
                "so only NIC-to-NIC paths are unknown"
            )
            break
        if name in header.gpus:
            if line.number == cut_line and len(expected) > 1:
                raise TopologyParseError(
                    f"row {name} ends the input with no newline while the rows of {expected[1]} and later are "
                    "still expected; the row may be cut (truncated input)",
                    source=source,
                    line=line.number,
                )
            affinity[name] = _read_affinity(header, name, rest, line, line.number == cut_line, source, warnings)
        elif rest.strip():
            raise TopologyParseError(
                f"row {name} has text after its {n_dev} link cells: {rest.strip()[:20]!r}",
                source=source,
                line=line.number,
            )
        rows[name] = cells
        expected.pop(0)
    else:
        if any(g in expected for g in header.gpus):
            missing = [g for g in header.gpus if g in expected]
            rows_text = missing[0] if len(missing) == 1 else f"{missing[0]}..{missing[-1]} ({len(missing)} rows)"
            raise TopologyParseError(
                f"the input ends before the row of {rows_text}; the matrix is truncated",
                source=source,
                line=len(raw_lines),
            )
        if expected:
            warnings.append(f"the input ends before the rows of {', '.join(expected)}; NIC-to-NIC paths unknown")

    _check_matrix(header, rows, source)
    node = build_node(header, rows, affinity, lines, source, hostname, warnings)
    return SmiTopology(node=node, warnings=tuple(warnings))


def _read_affinity(
    header: SmiHeader, name: str, rest: str, line: SmiLine, is_last: bool, source: str, warnings: list[str]
) -> dict[str, str]:
    values = rest.split()
    columns = header.affinity
    if len(values) > len(columns):
        raise TopologyParseError(
            f"row {name} has {len(values)} affinity values for {len(columns)} affinity columns",
            source=source,
            line=line.number,
        )
    if len(values) < len(columns):
        if is_last:
            raise TopologyParseError(
                f"row {name} ends the input with {len(values)} of {len(columns)} affinity values (truncated input)",
                source=source,
                line=line.number,
                column=columns[len(values)],
            )
        if columns[0] != "CPU Affinity" or len(columns) - len(values) > 1:
            raise TopologyParseError(
                f"row {name} has {len(values)} of {len(columns)} affinity values",
                source=source,
                line=line.number,
            )
        warnings.append(f"line {line.number}: row {name} has no CPU Affinity value (read as empty)")
        values = ["", *values]
    result = dict(zip(columns, values, strict=True))
    for column, value in result.items():
        ok = value in ("", "N/A") or (NUMA_ID.match(value) if column == "GPU NUMA ID" else _CPULIST.match(value))
        if not ok:
            raise TopologyParseError(
                f"row {name}: {value[:40]!r}{'...' if len(value) > 40 else ''} is not a valid {column} value",
                source=source,
                line=line.number,
                column=column,
            )
    return result


def _check_matrix(header: SmiHeader, rows: dict[str, list[str]], source: str) -> None:
    index = {d: i for i, d in enumerate(header.devices)}
    for name, cells in rows.items():
        i = index[name]
        if cells[i] != "X":
            raise TopologyParseError(
                f"row {name} has {cells[i]!r} on the diagonal where 'X' belongs", source=source, column=name
            )
        for j, cell in enumerate(cells):
            if j != i and cell == "X":
                raise TopologyParseError(
                    f"row {name} has 'X' off the diagonal", source=source, column=header.devices[j]
                )
            other = header.devices[j]
            if other in rows and rows[other][i] != cell:
                raise TopologyParseError(
                    f"the matrix is not symmetric: {name}->{other} is {cell} but {other}->{name} is {rows[other][i]}",
                    source=source,
                    column=other,
                )
