"""Presets build valid clusters with the documented domains."""

from __future__ import annotations

import pytest

from toposched.errors import UnknownNameError
from toposched.topology.domains import build_domain_map
from toposched.topology.model import Cluster
from toposched.topology.presets import Preset, load_preset, preset_names, register_preset


def _domain_sizes(name: str) -> list[int]:
    return [d.size for d in build_domain_map(load_preset(name)).domains]


@pytest.mark.parametrize(
    ("name", "gpus", "domains", "largest_clique"),
    [
        ("dgx1-v100", 8, [8], 4),  # hybrid cube mesh: connected, but all-pairs NVLink only in quads
        ("dgx2", 16, [16], 16),
        ("dgx-a100", 8, [8], 8),
        ("hgx-h100", 8, [8], 8),
        ("hgx-h200", 8, [8], 8),
        ("hgx-b200", 8, [8], 8),
        ("gb200-nvl72", 72, [72], 72),
        ("l40s-8x-pcie", 8, [], 0),
        ("4gpu-2numa-nvlink-pairs", 4, [2, 2], 2),
        ("cluster-32x-hgx-h100", 256, [8] * 32, 8),
    ],
)
def test_preset_shapes(name: str, gpus: int, domains: list[int], largest_clique: int) -> None:
    cluster = load_preset(name)
    dmap = build_domain_map(cluster)
    assert cluster.gpu_count == gpus
    assert [d.size for d in dmap.domains] == domains
    assert max((d.largest_clique for d in dmap.domains), default=0) == largest_clique
    # JSON round trip keeps the snapshot identical
    assert Cluster.model_validate_json(cluster.model_dump_json()) == cluster


def test_b200_nvlink5_bandwidth_and_h100_nvlink4() -> None:
    b200 = load_preset("hgx-b200").nodes[0].links[0]
    h100 = load_preset("hgx-h100").nodes[0].links[0]
    assert (b200.bandwidth_gbps, h100.bandwidth_gbps) == (900.0, 450.0)


def test_seed_256_cluster_layout() -> None:
    cluster = load_preset("cluster-32x-hgx-h100")
    assert cluster.fabric is not None and cluster.fabric.kind == "IB" and cluster.fabric.nics_per_node == 8
    assert len({n.rack for n in cluster.nodes}) == 8
    assert len({n.zone for n in cluster.nodes}) == 2


def test_seed_004_box_numa_matches_nvlink_pairs() -> None:
    dmap = build_domain_map(load_preset("4gpu-2numa-nvlink-pairs"))
    assert [d.gpus for d in dmap.domains] == [("box4/0", "box4/1"), ("box4/2", "box4/3")]
    assert [g.gpus for g in dmap.numa_groups] == [("box4/0", "box4/1"), ("box4/2", "box4/3")]


def test_l40s_pcie_switch_groups() -> None:
    dmap = build_domain_map(load_preset("l40s-8x-pcie"))
    assert [len(g.gpus) for g in dmap.pcie_groups] == [2, 2, 2, 2]
    assert dmap.nearest_nics["l40s/0"] == ("NIC0",)


def test_unknown_preset_suggests_names() -> None:
    with pytest.raises(UnknownNameError) as info:
        load_preset("hgx-h10")
    assert "did you mean 'hgx-h100'" in str(info.value)
    assert load_preset("HGX-H100").nodes[0].gpus[0].model == "NVIDIA H100 80GB HBM3"


def test_registering_a_name_twice_fails() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register_preset(Preset("dgx2", "again", lambda: load_preset("dgx2")))
    assert "dgx2" in preset_names()
