"""toposched.inputs: bounded reads and strict YAML/JSON for every file a user hands us."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from toposched.errors import InputError
from toposched.inputs import MAX_DEPTH, load_json, load_yaml, read_text

LAUGHS = "a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9)
)  # 81 aliases standing for 9**10 values


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes: [a]\nnodes: [b]\n", "duplicate key 'nodes'"),
        ("a: &a [*a]\n", "cycle"),
        (LAUGHS, "expand to more than"),
        ("a: " + "1" * 5000 + "\n", "4300 digits"),
        ("bandwidth_gbps: .inf\n", "not a finite number"),
        ("x: [.nan]\n", "not a finite number"),
        ("[" * 5000 + "]" * 5000, "nested deeper"),
        ("a: [" + "[" * (MAX_DEPTH + 2) + "]" * (MAX_DEPTH + 2) + "]\n", "nested deeper"),
        ('a: "\x00"\n', "NUL"),
        ("a: [1, 2\n", "not valid YAML"),
    ],
    ids=["duplicate", "cycle", "laughs", "bigint", "inf", "nan", "deep-parser", "deep", "nul", "syntax"],
)
def test_load_yaml_refuses_hostile_documents_in_one_line(text: str, message: str) -> None:
    with pytest.raises(InputError) as err:
        load_yaml(text, source="spec.yaml")
    assert err.value.message.startswith("spec.yaml:") and message in err.value.message
    assert "\n" not in err.value.message


def test_load_yaml_keeps_what_real_specs_use() -> None:
    data = load_yaml("base: &b {x: 1}\nn: {<<: *b, y: 2}\nm: *b\nf: 1.5\n", source="s")
    assert data == {"base": {"x": 1}, "n": {"x": 1, "y": 2}, "m": {"x": 1}, "f": 1.5}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a": 1, "a": 2}', "duplicate key 'a'"),
        ('{"a": NaN}', "NaN"),
        ('{"a": Infinity}', "Infinity"),
        ('{"a": 1e999}', "infinity"),
        ('{"a": ' + "9" * 5000 + "}", "5000 digits"),
        ("[" * 100_000 + "]" * 100_000, "nested deeper"),
        ('{"a": ', "not valid JSON"),
    ],
)
def test_load_json_refuses_what_json_loads_would_accept_or_crash_on(text: str, message: str) -> None:
    with pytest.raises(InputError) as err:
        load_json(text, source="config.json")
    assert message in err.value.message


def test_read_text_refuses_special_files_huge_files_and_bad_bytes(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a regular file"):
        read_text("/dev/zero", what="topology file")
    with pytest.raises(InputError, match="is a directory"):
        read_text(tmp_path)
    with pytest.raises(InputError, match="does not exist"):
        read_text(tmp_path / "missing.yaml")
    with pytest.raises(InputError, match="NUL byte"):
        read_text(str(tmp_path) + "/a\x00b")
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 2048)
    with pytest.raises(InputError, match="at most 1,024 are read"):
        read_text(big, max_bytes=1024)
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("name: n\u00e9ud\n".encode("latin-1"))
    with pytest.raises(InputError, match="not UTF-8 text \\(bad byte at offset 7\\)"):
        read_text(latin)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):  # and does not block waiting for a writer
        read_text(fifo)
    long_name = tmp_path / ("x" * 200)
    with pytest.raises(InputError) as err:
        read_text(long_name)
    assert len(err.value.message) < 160  # the path is shortened in the message


def test_read_text_drops_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_bytes(b"\xef\xbb\xbfname: a\n")
    assert read_text(path) == "name: a\n"
