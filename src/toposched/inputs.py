"""Reading files that come from users: bounded, regular files only, strict text, safe YAML and JSON.

Every parser entry point that takes a path reads it through :func:`read_text` so that
``/dev/zero``, a FIFO or a 10 GB file cannot hang or exhaust the process, and a file that is not
UTF-8 gets one line naming the file instead of a traceback. :func:`load_yaml` and
:func:`load_json` add what the plain loaders lack for hostile input: a duplicate key is an error
(YAML and JSON would silently keep the last one), NaN/Infinity and absurdly long numbers are
refused, and nesting deeper than :data:`MAX_DEPTH` is one clear error, not a RecursionError.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from toposched.errors import InputError, SpecError

MAX_BYTES = 16 * 1024 * 1024
"""Largest input file read (16 MiB: a 4,096-node cluster spec or a long NCCL log fits)."""

MAX_DEPTH = 64
"""Deepest nesting accepted in YAML/JSON documents (real specs and config.json use under 10)."""

MAX_NUMBER_DIGITS = 40
"""Longest integer literal accepted in JSON (Python would otherwise parse 5,000-digit numbers)."""

MAX_EXPANDED = 2_000_000
"""Most values a YAML document may stand for once its aliases are expanded ('billion laughs')."""


def _shown(path: str | Path) -> str:
    """A path as error messages show it: repr, at most 80 characters."""
    text = repr(str(path))
    return text if len(text) <= 80 else text[:77] + "..."


def read_bytes(
    path: str | Path, *, what: str = "file", max_bytes: int = MAX_BYTES, special_fix: str | None = None
) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``; InputError naming the file otherwise.

    ``special_fix`` is the hint given when the path is a device, FIFO or socket (by default: save the
    input to a file first).
    """
    p = Path(path)
    if "\x00" in str(p):
        raise InputError(f"{what} path {_shown(p)} contains a NUL byte", fix="check the path")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise InputError(f"{what} {_shown(p)} does not exist", fix="check the path") from None
    except IsADirectoryError:
        raise InputError(f"{what} {_shown(p)} is a directory, not a file", fix="name a file") from None
    except PermissionError:
        raise InputError(f"{what} {_shown(p)} cannot be read (permission denied)", fix="check its mode") from None
    except OSError as exc:
        raise InputError(f"{what} {_shown(p)} cannot be opened: {exc.strerror}", fix="check the path") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise InputError(f"{what} {_shown(p)} is a directory, not a file", fix="name a file")
        if not stat.S_ISREG(info.st_mode):
            raise InputError(
                f"{what} {_shown(p)} is not a regular file (a device, FIFO or socket)",
                fix=special_fix or "save the input to a regular file first and pass that file",
            )
        if info.st_size > max_bytes:
            raise InputError(
                f"{what} {_shown(p)} is {info.st_size:,} bytes; at most {max_bytes:,} are read",
                fix="pass the relevant part of the file",
            )
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > max_bytes:
                raise InputError(f"{what} {_shown(p)} grew past {max_bytes:,} bytes while being read")
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise InputError(f"{what} {_shown(p)} cannot be read: {exc.strerror}", fix="check the file") from None
    finally:
        os.close(fd)


def decode(data: bytes, *, source: str, what: str = "file") -> str:
    """``data`` as UTF-8 (a BOM is dropped); InputError with the byte offset otherwise."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{what} {_shown(source)} is not UTF-8 text (bad byte at offset {exc.start})",
            fix="save it as UTF-8, e.g. `iconv -f latin1 -t utf-8`",
        ) from None


def read_text(
    path: str | Path, *, what: str = "file", max_bytes: int = MAX_BYTES, special_fix: str | None = None
) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes``."""
    data = read_bytes(path, what=what, max_bytes=max_bytes, special_fix=special_fix)
    return decode(data, source=str(path), what=what)


def _walk(value: Any, source: str, *, max_nodes: int | None = None) -> None:
    """Refuse what a loaded document must not hold, in one iterative pass (never recurses).

    Nesting deeper than :data:`MAX_DEPTH`; a container that contains itself (a YAML alias to its own
    ancestor: code walking it would loop forever); a document whose aliases expand to more than
    ``max_nodes`` values ('billion laughs': 81 aliases can stand for 387 million values, which
    whoever walks the data then visits); NaN or infinite numbers (``.inf``/``.nan`` in YAML).
    """
    size: dict[int, int] = {}  # expanded size of each container seen, once it is left
    on_path: set[int] = set()
    stack: list[tuple[Any, int, bool, str]] = [(value, 1, False, "")]
    while stack:
        item, depth, leaving, path = stack.pop()
        if leaving:
            on_path.discard(id(item))
            children = item.values() if isinstance(item, dict) else item
            total = 1 + sum(size.get(id(c), 1) if isinstance(c, (dict, list)) else 1 for c in children)
            if max_nodes is not None and total > max_nodes:
                raise InputError(
                    f"{source}: its aliases expand to more than {max_nodes:,} values", fix="write the values out"
                )
            size[id(item)] = total
            continue
        if isinstance(item, float) and not math.isfinite(item):
            raise SpecError(source, path, f"{item} is not a finite number", fix="give a finite value")
        if not isinstance(item, (dict, list)):
            continue
        if id(item) in on_path:
            raise SpecError(source, path, "an alias refers to a node that contains it (a cycle)", fix="remove it")
        if id(item) in size:
            continue  # shared (a YAML alias): counted by its size
        if depth > MAX_DEPTH:
            raise InputError(f"{source}: nested deeper than {MAX_DEPTH} levels", fix="flatten the document")
        size[id(item)] = 0  # placeholder while inside; replaced on leaving
        on_path.add(id(item))
        stack.append((item, depth, True, path))
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        stack.extend((child, depth + 1, False, f"{path}.{key}" if path else str(key)) for key, child in pairs)


_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: 4-5x faster when present


class _StrictLoader(_Base):  # type: ignore[misc]
    """SafeLoader (libyaml's where available) that refuses duplicate keys."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first at line {seen[key] + 1}; YAML would keep only the last)",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, *, source: str) -> Any:
    """One YAML document, safely: no duplicate keys, cycles or NaN/inf; bounded aliases and depth."""
    if "\x00" in text:
        raise InputError(f"{source}: contains a NUL byte; not a text document", fix="check the file")
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except RecursionError:
        raise InputError(f"{source}: nested deeper than {MAX_DEPTH} levels", fix="flatten the document") from None
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        problem = str(exc).split(";")[0][:120]
        raise InputError(f"{source}: a number is too long to read ({problem})", fix="fix the value") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        if "maximum nesting depth" in problem:  # libyaml's own limit (1,000), far above ours
            raise InputError(f"{source}: nested deeper than {MAX_DEPTH} levels", fix="flatten the document") from None
        raise InputError(f"{source}: {where}not valid YAML: {problem}", fix="fix the YAML syntax") from None
    _walk(data, source, max_nodes=MAX_EXPANDED)
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_NUMBER_DIGITS:
        raise ValueError(f"an integer of {digits} digits")
    return int(text)


def _finite_float(text: str) -> float:
    if len(text) > MAX_NUMBER_DIGITS * 2:
        raise ValueError(f"a number written with {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows to infinity")
    return value


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def load_json(text: str, *, source: str) -> Any:
    """One JSON document, strictly: no NaN/Infinity, no duplicate keys, bounded numbers and depth."""
    try:
        data = json.loads(
            text,
            parse_constant=_no_constant,
            parse_int=_bounded_int,
            parse_float=_finite_float,
            object_pairs_hook=_unique_pairs,
        )
    except RecursionError:
        raise InputError(f"{source}: nested deeper than {MAX_DEPTH} levels", fix="flatten the document") from None
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{source}: line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}", fix="fix the JSON syntax"
        ) from None
    except ValueError as exc:
        raise InputError(f"{source}: not acceptable JSON: {exc}", fix="fix the value") from None
    _walk(data, source)
    return data
