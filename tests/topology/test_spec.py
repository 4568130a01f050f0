"""Cluster specs: many nodes, fabric, cliques; errors name the key path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, RunCli
from toposched.errors import InputError, SpecError
from toposched.topology.domains import build_domain_map
from toposched.topology.spec import load_cluster_spec


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def test_mixed_sources_racks_and_fabric(tmp_path: Path) -> None:
    (tmp_path / "topo").mkdir()
    (tmp_path / "topo/a100.txt").write_text((FIXTURES / "topo/13_8x-a100-nv12-1nic-numa3157.txt").read_text())
    path = _write(
        tmp_path,
        """
name: east
fabric: {kind: IB, nic_gbps: 50, nics_per_node: 8, rail_optimized: true, socket_ifname: eth0}
nodes:
  - name: "h100-{i:02d}"
    count: 4
    preset: hgx-h100
    rack: rack0
    zone: zone-a
  - name: gpu21001
    smi: topo/a100.txt
    gpu_model: NVIDIA A100-SXM4-80GB
    hbm_gib: 80
    labels: {pool: batch}
""",
    )
    cluster = load_cluster_spec(path)
    assert [n.name for n in cluster.nodes] == ["h100-00", "h100-01", "h100-02", "h100-03", "gpu21001"]
    assert cluster.fabric is not None and cluster.fabric.socket_ifname == "eth0"
    a100 = cluster.node("gpu21001")
    assert a100.labels == {"pool": "batch"}
    assert a100.gpus[0].model == "NVIDIA A100-SXM4-80GB" and a100.gpus[0].hbm_gib == 80
    assert [g.numa_node for g in a100.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    preset_uuids = [g.uuid for n in cluster.nodes[:4] for g in n.gpus]
    assert len(set(preset_uuids)) == 32  # UUIDs stay unique across nodes made from one preset
    dmap = build_domain_map(cluster)
    assert [d.id for d in dmap.domains] == [f"h100-0{i}/nv0" for i in range(4)] + ["gpu21001/nv0"]


def test_multi_node_nvlink_clique_is_one_domain(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
nodes:
  - {name: "tray{i}", count: 3, preset: hgx-b200}
  - {name: other, preset: hgx-b200}
cliques:
  - {id: rackA, nodes: [tray0, tray1, tray2]}
""",
    )
    dmap = build_domain_map(load_cluster_spec(path))
    assert [(d.id, d.kind, d.size) for d in dmap.domains] == [("rackA", "mnnvl", 24), ("other/nv0", "nvswitch", 8)]
    assert dmap.gpu_domain["tray1/5"] == "rackA"


def test_probe_file_round_trip(tmp_path: Path, run_cli: RunCli) -> None:
    result = run_cli("topo", "show", "--preset", "dgx-a100", "--json")
    (tmp_path / "probe.json").write_text(result.stdout)
    path = _write(tmp_path, "nodes:\n  - {name: saved, probe: probe.json, rack: r9}\n")
    node = load_cluster_spec(path).nodes[0]
    assert node.name == "saved" and node.rack == "r9"
    assert [g.numa_node for g in node.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]


@pytest.mark.parametrize(
    ("text", "key", "phrase"),
    [
        ("nodes: []\n", "nodes", "at least 1"),
        ("nodes:\n  - {name: a}\n", "nodes.0", "exactly one of preset, smi, probe"),
        ("nodes:\n  - {name: a, preset: hgx-h100, smi: x.txt}\n", "nodes.0", "exactly one"),
        ("nodes:\n  - {name: a, preset: hgx-h10}\n", "nodes.0.preset", "did you mean 'hgx-h100'"),
        ("nodes:\n  - {name: a, smi: missing.txt}\n", "nodes.0.smi", "does not exist"),
        ("nodes:\n  - {name: a, preset: dgx2, hbm_gib: -1}\n", "nodes.0.hbm_gib", "greater than 0"),
        ("nodes:\n  - {name: a, preset: dgx2, colour: red}\n", "nodes.0.colour", "Extra inputs"),
        ("nodes:\n  - {name: a, count: 2, preset: dgx2}\n", "nodes.0", "no '{i}'"),
        ("nodes:\n  - {name: a, preset: dgx2}\n  - {name: a, preset: dgx2}\n", "nodes.1.name", "also named by nodes.0"),
        ("fabric: {kind: FDDI}\nnodes:\n  - {name: a, preset: dgx2}\n", "fabric.kind", "Input should be"),
        (
            "nodes:\n  - {name: a, preset: dgx2}\ncliques:\n  - {id: c, nodes: [b]}\n",
            "cliques.0.nodes",
            "unknown node(s): b",
        ),
        ("nodes: [\n", "line", "not valid YAML"),
        ("- 1\n- 2\n", "", "top level must be a mapping"),
    ],
)
def test_errors_name_the_key_path(tmp_path: Path, text: str, key: str, phrase: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_cluster_spec(path)
    message = str(info.value)
    assert message.startswith(str(path))
    assert key in message and phrase in message, message


def test_damaged_smi_in_spec_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "cut.txt").write_text((FIXTURES / "topo/20_8x-pcie-pix-pxb-numa-na-TRUNCATED.txt").read_text())
    path = _write(tmp_path, "nodes:\n  - {name: a, smi: cut.txt}\n")
    with pytest.raises(SpecError, match=r"nodes\.0\.smi: .*row GPU6 has 7 of 8 link cells"):
        load_cluster_spec(path)


def test_missing_spec_file() -> None:
    with pytest.raises(InputError, match="does not exist"):
        load_cluster_spec("/nonexistent/cluster.yaml")


def test_bad_probe_file(tmp_path: Path) -> None:
    (tmp_path / "probe.json").write_text(json.dumps({"gpus": "nope"}))
    path = _write(tmp_path, "nodes:\n  - {name: a, probe: probe.json}\n")
    with pytest.raises(SpecError, match=r"nodes\.0\.probe: .* is not a saved probe"):
        load_cluster_spec(path)


@pytest.mark.parametrize(
    ("fabric", "gbps", "link", "generation"),
    [
        ("{nic_gbit_per_s: 200}", 25.0, "ib-hdr", "HDR"),
        ("{nic_gbit_per_s: 400}", 50.0, "ib-ndr", "NDR"),
        ("{nic_gbit_per_s: 800}", 100.0, "ib-xdr", "XDR"),
        ("{nic_gbit_per_s: 100}", 12.5, "ib-hdr", None),  # EDR: no table of its own, HDR's is the slowest
        ("{nic_gbps: 50}", 50.0, "ib-ndr", "NDR"),  # the older GB/s spelling still reads
        ("{kind: ROCE, nic_gbit_per_s: 400}", 50.0, "roce-400", None),
    ],
)
def test_nic_speed_units_and_link_table(
    tmp_path: Path, fabric: str, gbps: float, link: str, generation: str | None
) -> None:
    cluster = load_cluster_spec(_write(tmp_path, f"fabric: {fabric}\nnodes: [{{name: a, preset: hgx-h100}}]\n"))
    assert cluster.fabric is not None
    assert (cluster.fabric.nic_gbps, cluster.fabric.perf_link, cluster.fabric.generation) == (gbps, link, generation)


@pytest.mark.parametrize(
    ("fabric", "key", "phrase"),
    [
        ("{nic_gbps: 400}", "fabric.nic_gbps", "for a 400 Gb/s NIC write nic_gbit_per_s: 400"),
        ("{nic_gbit_per_s: 3200}", "fabric.nic_gbit_per_s", "nic_gbit_per_s: 400 for InfiniBand NDR"),
        ("{nic_gbit_per_s: fast}", "fabric.nic_gbit_per_s", "not a NIC speed in Gb/s"),
        ("{nic_gbps: 50, nic_gbit_per_s: 400}", "fabric", "not both"),
    ],
)
def test_implausible_nic_speed_names_the_key_and_the_fix(tmp_path: Path, fabric: str, key: str, phrase: str) -> None:
    path = _write(tmp_path, f"fabric: {fabric}\nnodes: [{{name: a, preset: hgx-h100}}]\n")
    with pytest.raises(SpecError) as info:
        load_cluster_spec(path)
    assert info.value.path == key
    assert phrase in f"{info.value.message} fix: {info.value.fix}"


def test_p2p_per_node_on_off_or_capture(tmp_path: Path) -> None:
    p2p = FIXTURES / "p2p"
    (tmp_path / "topo.txt").write_text((FIXTURES / "topo/24_3gpu-5070-2x5060ti-phb-raw-ansi-tabs.txt").read_text())
    (tmp_path / "p2p.txt").write_text((p2p / "03_3gpu-5070-2x5060ti-p2p-ansi-tabs.txt").read_text())
    path = _write(
        tmp_path,
        "nodes:\n"
        "  - {name: 'off-{i}', count: 2, preset: l40s-8x-pcie, p2p: off}\n"
        "  - {name: yes-p2p, preset: l40s-8x-pcie, p2p: on}\n"
        "  - {name: said, smi: topo.txt, p2p_file: p2p.txt}\n"
        "  - {name: plain, preset: l40s-8x-pcie}\n",
    )
    nodes = {n.name: n for n in load_cluster_spec(path).nodes}
    assert {link.p2p for name in ("off-0", "off-1") for link in nodes[name].links} == {False}
    assert not nodes["off-1"].peer_to_peer([0, 1])
    assert {link.p2p for link in nodes["yes-p2p"].links} == {True} and nodes["yes-p2p"].peer_to_peer([0, 1, 2, 3])
    assert not nodes["yes-p2p"].peer_to_peer([3, 4])  # across sockets (SYS) even with P2P on
    assert [link.p2p for link in nodes["said"].links] == [True, True, True]
    assert {link.p2p for link in nodes["plain"].links} == {None} and nodes["plain"].peer_to_peer([0, 1])


@pytest.mark.parametrize(
    ("entry", "key", "phrase"),
    [
        ("{name: a, preset: l40s-8x-pcie, p2p: on, p2p_file: p.txt}", "nodes.0", "not both"),
        ("{name: a, preset: l40s-8x-pcie, p2p: maybe}", "nodes.0.p2p", "valid boolean"),
        ("{name: a, preset: l40s-8x-pcie, p2p_file: nope.txt}", "nodes.0.p2p_file", "does not exist"),
        ("{name: a, preset: l40s-8x-pcie, p2p_file: p.txt}", "nodes.0.p2p_file", "lists GPUs 0,1 but node"),
        (
            "{name: a, preset: l40s-8x-pcie, p2p_file: bad.txt}",
            "nodes.0.p2p_file",
            "bad.txt, line 2, column GPU1: 'YES' is not a P2P status",
        ),
    ],
)
def test_p2p_errors_name_the_key(tmp_path: Path, entry: str, key: str, phrase: str) -> None:
    (tmp_path / "p.txt").write_text((FIXTURES / "p2p/02_2x-rtx5090-p2p-rw-gns-tabs.txt").read_text())
    (tmp_path / "bad.txt").write_text(" \tGPU0\tGPU1\n GPU0\tX\tYES\n GPU1\tOK\tX\n")
    path = _write(tmp_path, f"nodes:\n  - {entry}\n")
    with pytest.raises(SpecError) as info:
        load_cluster_spec(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {key}") and phrase in message, message
