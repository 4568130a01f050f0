"""Hostile and damaged cluster specs (issue 13 items 13-15): one clear error naming the key, bounded work."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
import yaml

from tests.conftest import FIXTURES
from toposched.errors import InputError, SpecError, UnknownNameError
from toposched.topology import spec as spec_module
from toposched.topology.model import Node
from toposched.topology.presets import load_preset, preset_node
from toposched.topology.spec import MAX_NODES, load_cluster_spec


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def _error(path: Path) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_cluster_spec(path)
    assert str(info.value).startswith(str(path)), info.value
    return info.value


def test_duplicate_nodes_key_is_refused_not_merged(tmp_path: Path) -> None:
    # PyYAML kept only the second list: node 'a' vanished without a word
    path = _write(tmp_path, "nodes:\n  - {name: a, preset: dgx2}\nnodes:\n  - {name: b, preset: dgx2}\n")
    assert "duplicate key 'nodes'" in str(_error(path))


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (
            "nodes: [{name: a, preset: dgx2}]\ncliques: [{id: c, nodes: [a], bandwidth_gbps: .inf}]\n",
            "cliques.0.bandwidth_gbps",
        ),
        ("fabric: {nic_gbps: .inf}\nnodes: [{name: a, preset: dgx2}]\n", "fabric.nic_gbps"),
        ("fabric: {latency_us: .nan}\nnodes: [{name: a, preset: dgx2}]\n", "fabric.latency_us"),
        ("nodes: [{name: a, preset: dgx2, hbm_gib: .NaN}]\n", "nodes.0.hbm_gib"),
        ("nodes: [{name: a, smi: x.txt, hbm_gib: -.inf}]\n", "nodes.0.hbm_gib"),
    ],
)
def test_non_finite_numbers_are_refused_with_the_key(tmp_path: Path, text: str, key: str) -> None:
    error = _error(_write(tmp_path, text))
    assert error.path == key and "finite" in error.problem, error


def test_huge_width_in_a_name_pattern_is_refused_before_formatting(tmp_path: Path) -> None:
    path = _write(tmp_path, 'nodes:\n  - {name: "n{i:>900000000}", count: 2, preset: dgx2}\n')
    tracemalloc.start()
    try:
        error = _error(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert error.path == "nodes.0.name"
    assert peak < 20 * 1024 * 1024  # the baseline formatted the pattern: a 900 MB string


@pytest.mark.parametrize(
    ("name", "phrase"),
    [
        ("n{i:0300d}", "up to 301 characters"),
        ("{i:x}", "only '{i}'"),
        ("n{j}", "only '{i}'"),
        ("n{i!r}", "only '{i}'"),
        ("n{i.real}", "only '{i}'"),
        ("n{}", "only '{i}'"),
        ("n{0}", "only '{i}'"),
        ("n{i:{i}}", "only '{i}'"),
        ("n{i", "cannot expand"),
        ("a" * 300, "makes names of up to 300"),
        ("bad\nname", "not a hostname"),
        ("$(reboot)", "not a hostname"),
        ("../x", "not a hostname"),
        ("node:1", "not a hostname"),
    ],
)
def test_name_patterns_and_names_are_checked(tmp_path: Path, name: str, phrase: str) -> None:
    error = _error(_write(tmp_path, yaml.safe_dump({"nodes": [{"name": name, "preset": "dgx2"}]})))
    assert error.path == "nodes.0.name" and phrase in error.problem, error


def test_total_node_count_is_bounded_before_any_node_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    monkeypatch.setattr(spec_module, "preset_node", lambda name: built.append(name))
    entries = "".join(f'  - {{name: "e{n}-{{i}}", count: 10000, preset: dgx2}}\n' for n in range(11))
    error = _error(_write(tmp_path, "nodes:\n" + entries))
    assert error.path == "nodes" and f"at most {MAX_NODES:,}" in error.problem
    assert built == []


def test_a_preset_entry_is_built_once_not_per_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counting(name: str) -> Node:
        calls.append(name)
        return preset_node(name)

    monkeypatch.setattr(spec_module, "preset_node", counting)
    cluster = load_cluster_spec(_write(tmp_path, 'nodes:\n  - {name: "h{i:03d}", count: 300, preset: hgx-h100}\n'))
    assert len(cluster.nodes) == 300 and calls == ["hgx-h100"]
    last = cluster.nodes[299]
    assert last.name == "h299" and str(last.gpus[0].uuid).endswith("-h299")


def test_deep_nesting_and_long_numbers_are_one_error(tmp_path: Path) -> None:
    deep = _error(_write(tmp_path, "nodes: " + "[" * 5000 + "]" * 5000 + "\n"))
    assert "nested" in deep.problem
    long = _error(_write(tmp_path, "nodes: [{name: a, preset: dgx2, count: " + "9" * 5000 + "}]\n"))
    assert "too long" in long.problem or "count" in long.path


def test_non_utf8_and_special_spec_files(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"nodes:\n  - {name: \xff, preset: dgx2}\n")
    with pytest.raises(InputError, match="not UTF-8"):
        load_cluster_spec(path)
    with pytest.raises(InputError, match="not a regular file"):
        load_cluster_spec("/dev/zero")
    with pytest.raises(InputError, match="NUL byte"):
        load_cluster_spec("a\x00.yaml")


@pytest.mark.parametrize(
    ("entry", "key", "phrase"),
    [
        ("{name: a, smi: /dev/zero}", "nodes.0.smi", "not a regular file"),
        ("{name: a, smi: latin1.txt}", "nodes.0.smi", "not UTF-8"),
        ('{name: a, smi: "x\\0y"}', "nodes.0.smi", "should match pattern"),
        ("{name: a, probe: /dev/zero}", "nodes.0.probe", "not a regular file"),
        ("{name: a, probe: deep.json}", "nodes.0.probe", "nested"),
        ("{name: a, probe: nan.json}", "nodes.0.probe", "NaN"),
        ("{name: a, probe: list.json}", "nodes.0.probe", "not a saved probe"),
        ("{name: a, probe: badnode.json}", "nodes.0.probe", "not a saved probe"),
    ],
)
def test_files_named_by_a_spec_are_read_safely(tmp_path: Path, entry: str, key: str, phrase: str) -> None:
    (tmp_path / "latin1.txt").write_bytes(b"\tGPU0\tCPU Affinity\nGPU0\t X \t0-1\xe9\n")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "nan.json").write_text('{"name": "x", "gpus": [{"index": 0, "hbm_gib": NaN}]}')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "badnode.json").write_text('{"cluster": {"nodes": [{"name": "bad\\nname"}]}}')
    error = _error(_write(tmp_path, f"nodes:\n  - {entry}\n"))
    assert error.path == key and phrase in error.problem, error


def test_clique_ids_and_members_are_names(tmp_path: Path) -> None:
    bad_id = _error(_write(tmp_path, 'nodes: [{name: a, preset: dgx2}]\ncliques: [{id: "x\\ny", nodes: [a]}]\n'))
    assert bad_id.path == "cliques.0.id"
    bad_node = _error(_write(tmp_path, 'nodes: [{name: a, preset: dgx2}]\ncliques: [{id: c, nodes: ["$(x)"]}]\n'))
    assert bad_node.path == "cliques.0.nodes.0"


def test_smi_capture_warnings_reach_the_caller_with_the_key(tmp_path: Path) -> None:
    text = (FIXTURES / "topo/15_8x-a100-nv12-3nic-4numa.txt").read_text()
    (tmp_path / "cut.txt").write_text(text[: text.index("NIC Legend")])  # the legend lines are lost
    path = _write(tmp_path, "nodes: [{name: a, smi: cut.txt}]\n")
    warnings: list[str] = []
    cluster = load_cluster_spec(path, warnings=warnings)
    assert [n.device for n in cluster.nodes[0].nics] == [None, None, None]
    assert len(warnings) == 1 and warnings[0].startswith(f"{path}: nodes.0.smi: {tmp_path / 'cut.txt'}: ")
    assert "NIC0, NIC1, NIC2" in warnings[0]


def test_a_huge_preset_name_is_not_echoed_whole() -> None:
    with pytest.raises(UnknownNameError) as info:
        load_preset("hgx-h100" * 100_000)
    assert len(str(info.value)) < 1000


def test_longest_node_names_keep_valid_unique_preset_uuids(tmp_path: Path) -> None:
    long = ".".join(c * 63 for c in "abc") + "." + "d" * 49 + "{i}"  # 242 characters: 'GPU-preset-...-' + it > 253
    cluster = load_cluster_spec(_write(tmp_path, yaml.safe_dump({"nodes": [{"name": long, "count": 2,
                                                                             "preset": "hgx-h100"}]})))  # fmt: skip
    uuids = [g.uuid for n in cluster.nodes for g in n.gpus]
    assert len(set(uuids)) == 16 and all(u is not None and len(u) <= 253 for u in uuids)


def test_total_gpu_count_is_bounded_before_the_nodes_are_built(tmp_path: Path) -> None:
    """Issue 37: the node limit admitted an 80,000-GPU spec (35 s, 2.5 GB) and ten times that; the GPUs of a
    spec are capped at what the machine builds in seconds, checked per entry before its nodes are made."""
    from toposched.errors import InputError
    from toposched.sim.loading import load_cluster
    from toposched.topology.spec import MAX_GPUS

    ok = 'nodes:\n  - {name: "a-{i}", count: 4, preset: hgx-h100}\n'
    assert len(load_cluster_spec(_write(tmp_path, ok)).nodes) == 4
    over = (
        'nodes:\n  - {name: "a-{i}", count: 8000, preset: hgx-h100}\n'
        '  - {name: "b-{i}", count: 193, preset: hgx-h100}\n'
    )
    error = _error(_write(tmp_path, over))
    assert error.path == "nodes.1" and f"at most {MAX_GPUS:,}" in error.problem and "65,544" in error.problem
    with pytest.raises(InputError, match="80,000 GPUs; at most 65,536"):
        load_cluster("10000xhgx-h100")
