"""Property tests: the reader never crashes, and never guesses on damaged input.

* garbage text -> a result or a TopologyParseError, nothing else;
* any prefix of a real capture -> either a TopologyParseError, or exactly what the whole file says
  about the GPUs (recovering only what is complete);
* whitespace mangling of a real capture (tabs <-> runs of spaces, indentation, trailing blanks)
  -> the same GPUs, links and NUMA nodes.
"""

from __future__ import annotations

import contextlib
import os
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import FIXTURES
from toposched.errors import TopologyParseError
from toposched.topology.smi import SmiTopology, parse_topo_matrix

TOPO = FIXTURES / "topo"
GOOD: dict[str, tuple[str, SmiTopology]] = {}
for path in sorted(TOPO.iterdir()):
    with contextlib.suppress(TopologyParseError):
        GOOD[path.name] = (path.read_bytes().decode(), parse_topo_matrix(path.read_bytes().decode()))

NAMES = sorted(GOOD)
SETTINGS = settings(
    max_examples=int(os.environ.get("TOPOSCHED_HYPOTHESIS_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TOKENS = st.sampled_from(
    [
        "GPU0",
        "GPU1",
        "GPU2",
        "NIC0",
        "mlx5_0",
        " X ",
        "X",
        "NV12",
        "NV",
        "PIX",
        "PXB",
        "PHB",
        "NODE",
        "SYS",
        "SOC",
        "CPU Affinity",
        "NUMA Affinity",
        "GPU NUMA ID",
        "N/A",
        "0-7",
        "0,5-11",
        "3",
        "\t",
        "  ",
        "\n",
        "#",
        "\x1b[4m",
        "\x1b[0m",
        "Legend:",
        "NIC Legend:",
        "NIC0: mlx5_0",
        "OK",
        "GNS",
        "-",
        ",",
        "é",
        "\r",
    ]
)


def _gpu_view(result: SmiTopology) -> tuple[object, ...]:
    node = result.node
    return (
        tuple((g.index, g.numa_node) for g in node.gpus),
        tuple((x.a, x.b, x.kind, x.nvlinks) for x in node.links),
    )


def _parse(text: str) -> SmiTopology | None:
    try:
        return parse_topo_matrix(text)
    except TopologyParseError as exc:
        assert str(exc) and "\n" not in str(exc)
        return None


@SETTINGS
@given(st.text(max_size=400))
def test_random_text_never_crashes(text: str) -> None:
    _parse(text)


@SETTINGS
@given(st.lists(TOKENS, max_size=80))
def test_token_soup_never_crashes(tokens: list[str]) -> None:
    _parse("".join(tokens))


@SETTINGS
@given(st.sampled_from(NAMES), st.data())
def test_prefix_is_an_error_or_the_truth(name: str, data: st.DataObject) -> None:
    text, full = GOOD[name]
    cut = data.draw(st.integers(min_value=0, max_value=len(text)))
    result = _parse(text[:cut])
    if result is not None:
        assert _gpu_view(result) == _gpu_view(full)


@SETTINGS
@given(st.sampled_from(NAMES), st.data())
def test_whitespace_mangling_keeps_the_meaning(name: str, data: st.DataObject) -> None:
    text, full = GOOD[name]
    indent = data.draw(st.sampled_from(["", "  ", "      ", "\t", "# "]))
    lines = []
    for line in text.split("\n"):
        # Re-space the gaps between cells: a tab or any run of 2..9 spaces stands for the same gap.
        def regap(match: re.Match[str]) -> str:
            return data.draw(st.sampled_from(["\t", "  ", "    ", "         ", " \t "]))

        mangled = re.sub(r"\t+| {2,}", regap, line)
        trail = data.draw(st.sampled_from(["", " ", "\t", "   "]))
        lines.append(indent + mangled + trail)
    result = _parse("\n".join(lines))
    assert result is not None
    assert _gpu_view(result) == _gpu_view(full)


def test_every_prefix_of_every_capture_is_an_error_or_the_truth() -> None:
    """Exhaustive: cut each readable capture after every character (about 25,000 inputs)."""
    wrong = []
    for name, (text, full) in GOOD.items():
        truth = _gpu_view(full)
        for cut in range(len(text) + 1):
            result = _parse(text[:cut])
            if result is not None and _gpu_view(result) != truth:
                wrong.append((name, cut))
    assert wrong == []
    assert len(GOOD) == 20
