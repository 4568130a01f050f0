"""Hypothesis strategies that damage real inputs.

Two kinds of damage, both drawn by hypothesis so a run is reproducible from its seed:

* **bytes**: truncate, delete / duplicate / swap / repeat lines, flip or insert bytes (NUL, ANSI
  escapes, non-UTF-8, CR), replace a number with a hostile one (0, -1, NaN, 1e309, 5,000 digits, a
  word), replace a word with a hostile name (newline, ``$(...)``, backticks, ``../``, 10 kB), insert
  a very long line, splice in part of another seed;
* **structure** (JSON / YAML documents): replace, delete, duplicate or wrap any node, add unknown
  or duplicate keys, nest thousands of levels deep, then write the document back as JSON or YAML
  (including what ``json.dumps`` would never write: duplicate keys, ``NaN``, huge literals, YAML
  tags and aliases).

``MARK`` in a hostile value stands for a marker file: targets that execute what toposched writes
replace it with a real path and check the file never appears.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from hypothesis import strategies as st

MARK = "@@MARK@@"
"""Placeholder for the marker file an injected command would create."""

INJECTIONS: tuple[str, ...] = (
    f"x\ntouch {MARK}\n",
    f"x\rtouch {MARK}",
    f"$(touch {MARK})",
    f"`touch {MARK}`",
    f"'; touch {MARK}; '",
    f'"; touch {MARK}; "',
    f"x;touch {MARK}",
    f"x|touch {MARK}",
    f"x&&touch {MARK}",
    f"x\n:>{MARK}",
    f"${{IFS}}touch${{IFS}}{MARK}",
    f"a\ninjected: true\nb: {MARK}",
    f"x\n---\ninjected: {MARK}",
    f"x # {MARK}",
)
"""Values that run a command (or add YAML) if written unquoted into a script, comment or YAML."""

HOSTILE_NAMES: tuple[str, ...] = (
    *INJECTIONS,
    "a\nb",
    "../../escape",
    "../x",
    "/abs/path",
    "/dev/zero",
    "..",
    "/proc/self/status",
    "a:b",
    "a/b",
    "a b",
    "a\tb",
    "\x00",
    "a\x00b",
    "-rf",
    "--help",
    "n" * 10_000,
    "é",
    "\u202e",
    "\ufeff",
    "*",
    "~",
    "{i:>900000000}",
    "{i}",
    "{0}",
    "{i!r}",
    "%s%n",
    "&anchor",
    "!!python/object/apply:os.system",
    "null",
    "",
    " ",
    "\x1b[4mGPU0\x1b[0m",
)
"""Names and words that break quoting, paths, format strings or parsers."""

HOSTILE_NUMBER_TEXT: tuple[bytes, ...] = (
    b"0",
    b"-1",
    b"-0",
    b"1e309",
    b"-1e309",
    b"NaN",
    b"Infinity",
    b".inf",
    b"1e-320",
    b"9" * 5000,
    b"4294967297",
    b"18446744073709551617",
    b"1.5",
    b"0x10",
    b"1_000",
    b"abc",
    b"",
    b"null",
)
"""What a number in a text file is replaced with."""

HOSTILE_NUMBERS: tuple[Any, ...] = (
    0,
    -1,
    1,
    2**31,
    2**63,
    2**64 + 1,
    -(10**50),
    10**400,
    0.5,
    -0.0,
    1e-320,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
)
"""Numbers a structured mutation puts where a value was."""

INSERTS: tuple[bytes, ...] = (
    b"\x00",
    b"\x1b[4m",
    b"\x1b[0m",
    b"\xff\xfe",
    b"\xc3\x28",
    b"\x80",
    b"\r",
    b"\r\n",
    b"\t",
    b"\n\n",
    b"\xef\xbb\xbf",
    b"\\",
    b'"',
    b"'",
    b"#",
    b":",
    b"{",
    b"[",
    b"&a ",
    b"*a",
    b"!!",
)
"""Bytes inserted at a random position."""

_NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_WORD = re.compile(rb"[A-Za-z_][A-Za-z0-9_.\-/]*")


@dataclass(frozen=True)
class Raw:
    """Text written verbatim into a JSON/YAML document (what a serialiser would never produce)."""

    text: str


@dataclass(frozen=True)
class Pairs:
    """A mapping written with its keys in order, duplicates included."""

    items: tuple[tuple[str, Any], ...]


RAW_VALUES: tuple[Raw, ...] = (
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("1e309"),
    Raw("9" * 5000),
    Raw("-" + "9" * 45),
    Raw("[" * 100_000 + "]" * 100_000),
    Raw('{"a":' * 5_000 + "1" + "}" * 5_000),
    Raw("[" * 200 + "]" * 200),
)
"""Literal text: non-JSON numbers, huge literals, deep nesting."""

YAML_RAW: tuple[Raw, ...] = (
    Raw(".inf"),
    Raw("-.inf"),
    Raw(".nan"),
    Raw(f"!!python/object/apply:os.system ['touch {MARK}']"),
    Raw("!!binary aGVsbG8="),
    Raw("!!set {a, b}"),
    Raw("!!timestamp 2001-12-14"),
    Raw("*undefined_alias"),
    Raw("&a [1, 2]"),
    Raw("0o17"),
    Raw("0x1F"),
    Raw("1_000"),
    Raw("yes"),
    Raw("~"),
)
"""YAML-only literal text (tags, aliases, YAML 1.1 oddities)."""

YAML_BOMB = (
    'a: &a ["x","x","x","x","x","x","x","x","x","x"]\n'
    + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))
).encode()
"""Billion laughs: nine levels of ten aliases each."""


def json_values() -> st.SearchStrategy[Any]:
    """Any JSON-like value, small (hypothesis' own generator: unicode, big ints, odd floats)."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
    )
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=10,
    )


def hostile_values(*, yaml_too: bool = False) -> st.SearchStrategy[Any]:
    """A value put in place of a document node."""
    raws = RAW_VALUES + (YAML_RAW if yaml_too else ())
    return st.one_of(
        st.sampled_from(HOSTILE_NUMBERS),
        st.sampled_from(HOSTILE_NAMES),
        st.sampled_from(raws),
        st.sampled_from([None, True, False, [], {}, [[]], {"": None}]),
        json_values(),
    )


def dump_json(value: Any) -> str:
    """JSON text of ``value``; ``Raw`` verbatim, ``Pairs`` with duplicate keys, NaN/inf as literals."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Pairs):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dump_json(v)}" for k, v in value.items) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dump_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(dump_json(v) for v in value) + "]"
    return json.dumps(value)


def _plain(value: Any) -> bool:
    """True when ``value`` holds no Raw/Pairs (so a YAML serialiser can write it)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (Raw, Pairs)):
            return False
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return True


def dump_yaml(value: Any, *, block: bool) -> str:
    """YAML text of ``value``: block style through PyYAML when it can, else JSON-style flow YAML."""
    if block and _plain(value):
        try:
            return yaml.safe_dump(value, sort_keys=False, allow_unicode=True, width=1 << 20)
        except (yaml.YAMLError, RecursionError, ValueError):
            pass
    return dump_json(value) + "\n"


# ----------------------------------------------------------------------------------------------- bytes


Draw = Callable[[st.SearchStrategy[Any]], Any]


def _lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True) or [b""]


def _truncate(draw: Draw, data: bytes, _other: bytes) -> bytes:
    return data[: draw(st.integers(0, len(data)))]


def _delete_lines(draw: Draw, data: bytes, _other: bytes) -> bytes:
    lines = _lines(data)
    i = draw(st.integers(0, len(lines) - 1))
    return b"".join(lines[:i] + lines[i + draw(st.integers(1, 3)) :])


def _duplicate_line(draw: Draw, data: bytes, _other: bytes) -> bytes:
    lines = _lines(data)
    i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines)))
    times = draw(st.sampled_from([1, 1, 2, 3, 50, 2_000]))
    line = lines[i] if lines[i].endswith(b"\n") else lines[i] + b"\n"
    return b"".join(lines[:j] + [line] * times + lines[j:])


def _swap_lines(draw: Draw, data: bytes, _other: bytes) -> bytes:
    lines = _lines(data)
    i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
    lines[i], lines[j] = lines[j], lines[i]
    return b"".join(lines)


def _flip_byte(draw: Draw, data: bytes, _other: bytes) -> bytes:
    if not data:
        return b"\x00"
    i = draw(st.integers(0, len(data) - 1))
    return data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1 :]


def _insert_bytes(draw: Draw, data: bytes, _other: bytes) -> bytes:
    i = draw(st.integers(0, len(data)))
    piece: bytes = draw(st.one_of(st.sampled_from(INSERTS), st.binary(min_size=1, max_size=6)))
    return data[:i] + piece + data[i:]


def _replace_number(draw: Draw, data: bytes, _other: bytes) -> bytes:
    found = list(_NUMBER.finditer(data))
    if not found:
        return data
    m = found[draw(st.integers(0, len(found) - 1))]
    number: bytes = draw(st.sampled_from(HOSTILE_NUMBER_TEXT))
    return data[: m.start()] + number + data[m.end() :]


def _replace_word(draw: Draw, data: bytes, _other: bytes) -> bytes:
    found = list(_WORD.finditer(data))
    if not found:
        return data
    m = found[draw(st.integers(0, len(found) - 1))]
    name: str = draw(st.sampled_from(HOSTILE_NAMES))
    return data[: m.start()] + name.encode("utf-8", "surrogatepass") + data[m.end() :]


def _long_line(draw: Draw, data: bytes, _other: bytes) -> bytes:
    found = _WORD.findall(data) or [b"x"]
    token = draw(st.sampled_from([*found[:50], b" ", b"\t", b"0-", b"NV12 ", b"[", b"{", b"a" * 64]))
    size = draw(st.sampled_from([1_000, 20_000, 80_000, 300_000]))
    line = (token * (size // max(1, len(token)) + 1))[:size]
    lines = _lines(data)
    i = draw(st.integers(0, len(lines)))
    return b"".join([*lines[:i], line + b"\n", *lines[i:]])


def _grow(draw: Draw, data: bytes, _other: bytes) -> bytes:
    """The whole input repeated up to about 1 or 8 MiB (a long log, a large cluster)."""
    if not data:
        return data
    size: int = draw(st.sampled_from([1 << 20, 1 << 20, 8 << 20]))
    return data * max(1, size // len(data))


def _splice(draw: Draw, data: bytes, other: bytes) -> bytes:
    if not other:
        return data
    a = draw(st.integers(0, len(other)))
    b = draw(st.integers(a, min(len(other), a + 4096)))
    i = draw(st.integers(0, len(data)))
    return data[:i] + other[a:b] + data[i:]


BYTE_OPS: tuple[Callable[[Draw, bytes, bytes], bytes], ...] = (
    _truncate,
    _delete_lines,
    _duplicate_line,
    _swap_lines,
    _flip_byte,
    _insert_bytes,
    _replace_number,
    _replace_number,
    _replace_word,
    _replace_word,
    _long_line,
    _splice,
    _grow,
)


def mutate_bytes(draw: Draw, data: bytes, others: Sequence[bytes], *, max_ops: int = 4) -> bytes:
    """Apply 0..max_ops byte/line mutations drawn by hypothesis."""
    for _ in range(draw(st.integers(0, max_ops))):
        op = draw(st.sampled_from(BYTE_OPS))
        other = draw(st.sampled_from(others)) if others else b""
        data = op(draw, data, other)
    return data


# ------------------------------------------------------------------------------------------- structure

Path_ = tuple[Any, ...]


def node_paths(doc: Any, limit: int = 4000) -> list[Path_]:
    """Paths (key/index tuples) to the nodes of ``doc``, breadth first, at most ``limit``."""
    out: list[Path_] = []
    queue: list[tuple[Path_, Any]] = [((), doc)]
    while queue and len(out) < limit:
        path, node = queue.pop(0)
        out.append(path)
        if isinstance(node, dict):
            queue.extend(((*path, k), v) for k, v in node.items())
        elif isinstance(node, list):
            queue.extend(((*path, i), v) for i, v in enumerate(node))
    return out


def _get(doc: Any, path: Path_) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def _set(doc: Any, path: Path_, value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def _s_replace(draw: Draw, doc: Any, path: Path_, yaml_too: bool) -> Any:
    return _set(doc, path, draw(hostile_values(yaml_too=yaml_too)))


def _s_delete(draw: Draw, doc: Any, path: Path_, yaml_too: bool) -> Any:
    if not path:
        return doc
    parent = _get(doc, path[:-1])
    del parent[path[-1]]
    return doc


def _s_add_key(draw: Draw, doc: Any, path: Path_, yaml_too: bool) -> Any:
    node = _get(doc, path)
    if isinstance(node, dict):
        key = draw(st.one_of(st.sampled_from(HOSTILE_NAMES), st.text(max_size=10)))
        node[key] = draw(hostile_values(yaml_too=yaml_too))
    elif isinstance(node, list):
        node.insert(draw(st.integers(0, len(node))), draw(hostile_values(yaml_too=yaml_too)))
    return doc


def _s_duplicate_key(draw: Draw, doc: Any, path: Path_, yaml_too: bool) -> Any:
    node = _get(doc, path)
    if not isinstance(node, dict) or not node:
        return doc
    items = list(node.items())
    key, value = items[draw(st.integers(0, len(items) - 1))]
    second = value if draw(st.booleans()) else draw(hostile_values(yaml_too=yaml_too))
    items.insert(draw(st.integers(0, len(items))), (key, second))
    return _set(doc, path, Pairs(tuple(items)))


def _s_repeat(draw: Draw, doc: Any, path: Path_, yaml_too: bool) -> Any:
    node = _get(doc, path)
    if isinstance(node, list) and node:
        item = node[draw(st.integers(0, len(node) - 1))]
        node.extend(copy.deepcopy(item) for _ in range(draw(st.sampled_from([1, 2, 30]))))
    return doc


def _s_wrap(draw: Draw, doc: Any, path: Path_, yaml_too: bool) -> Any:
    node = _get(doc, path)
    return _set(doc, path, draw(st.sampled_from([[node], {"value": node}, [node, node]])))


def _s_move(draw: Draw, doc: Any, path: Path_, yaml_too: bool) -> Any:
    paths = node_paths(doc, limit=500)
    source = copy.deepcopy(_get(doc, paths[draw(st.integers(0, len(paths) - 1))]))
    return _set(doc, path, source)


def _s_text(draw: Draw, doc: Any, path: Path_, yaml_too: bool) -> Any:
    node = _get(doc, path)
    if isinstance(node, str):
        piece = draw(st.sampled_from(HOSTILE_NAMES))
        where = draw(st.sampled_from(["prefix", "suffix", "replace"]))
        node = piece + node if where == "prefix" else node + piece if where == "suffix" else piece
        return _set(doc, path, node)
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return _set(doc, path, draw(st.sampled_from(HOSTILE_NUMBERS + RAW_VALUES[:5])))
    return doc


STRUCT_OPS: tuple[Callable[[Draw, Any, Path_, bool], Any], ...] = (
    _s_replace,
    _s_replace,
    _s_delete,
    _s_add_key,
    _s_duplicate_key,
    _s_repeat,
    _s_wrap,
    _s_move,
    _s_text,
    _s_text,
    _s_text,
)


def mutate_doc(draw: Draw, doc: Any, *, yaml_too: bool = False, max_ops: int = 3) -> Any:
    """Apply 0..max_ops structural mutations to a deep copy of ``doc``."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(0, max_ops))):
        if isinstance(doc, (Raw, Pairs)):
            break
        paths = node_paths(doc)
        path = paths[draw(st.integers(0, len(paths) - 1))]
        try:
            if any(isinstance(_get(doc, path[:k]), (Raw, Pairs)) for k in range(len(path) + 1)):
                continue
        except (KeyError, IndexError, TypeError):
            continue
        doc = draw(st.sampled_from(STRUCT_OPS))(draw, doc, path, yaml_too)
    return doc


def serialise(draw: Draw, doc: Any, fmt: str) -> bytes:
    """Write ``doc`` as ``json``, ``yaml`` or either (``any``), drawn."""
    if fmt == "any":
        fmt = draw(st.sampled_from(["json", "yaml"]))
    if fmt == "json":
        return dump_json(doc).encode("utf-8", "surrogatepass")
    return dump_yaml(doc, block=draw(st.booleans())).encode("utf-8", "surrogatepass")
