"""Live NVML discovery, run against FakeNvml (pynvml's names and error classes) built from captures."""

from __future__ import annotations

import os

import pytest

from tests.conftest import FIXTURES
from toposched.errors import DiscoveryError, InputError, NoDriverError
from toposched.topology.domains import build_domain_map
from toposched.topology.model import Cluster, Health, LinkKind, Node
from toposched.topology.nvml import probe_live, probe_node
from toposched.topology.nvml_fake import FakeNvml
from toposched.topology.presets import dgx1_v100, hgx
from toposched.topology.smi import parse_topo_matrix


def _domains(node: Node) -> list[list[int]]:
    dmap = build_domain_map(Cluster(nodes=(node,)))
    return [[int(r.split("/")[1]) for r in d.gpus] for d in dmap.domains]


def test_nvswitch_links_mean_one_all_to_all_domain() -> None:
    # Every NVLink of an HGX board ends at an NVSwitch, not at a peer GPU. A reader that only counts
    # GPU-to-GPU links (go-gpuallocator) would see no NVLink at all here.
    source = parse_topo_matrix((FIXTURES / "topo/04_8x-h100-nv18-no-gpunumaid.txt").read_text()).node
    probe = probe_node(FakeNvml.from_node(source, nvswitch=True), hostname="h100")
    node = probe.node
    assert node.nvswitch is True
    assert _domains(node) == [list(range(8))]
    assert {(x.kind, x.nvlinks) for x in node.links} == {(LinkKind.NVLINK, 18)}
    assert node.links[0].bandwidth_gbps == 450.0  # 18 lanes x 25 GB/s per direction
    assert [g.numa_node for g in node.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert node.gpu(0).cpu_affinity == "0-51,104-155"
    assert node.gpu(0).hbm_gib == 80.0
    assert probe.warnings == ()


def test_direct_mesh_lanes_and_pcie_ancestors_match_the_topo_matrix() -> None:
    source = parse_topo_matrix((FIXTURES / "topo/07_dgx1-v100-1nic-driver440.txt").read_text()).node
    node = probe_node(FakeNvml.from_node(source, nvswitch=False, model="Tesla V100-SXM2-32GB")).node
    for want in source.links:
        got = node.link(want.a, want.b)
        assert got is not None
        assert (got.kind, got.nvlinks) == (want.kind, want.nvlinks), (want.a, want.b)
    assert node.nvswitch is None


def test_pcie_only_box_reads_common_ancestors() -> None:
    source = parse_topo_matrix((FIXTURES / "topo/21_8x-rtx4090-node-sys-with-prompt.txt").read_text()).node
    node = probe_node(FakeNvml.from_node(source, nvswitch=False, model="NVIDIA GeForce RTX 4090")).node
    assert node.link(0, 1).kind is LinkKind.NODE  # type: ignore[union-attr]
    assert node.link(0, 4).kind is LinkKind.SYS  # type: ignore[union-attr]
    assert _domains(node) == []


def test_p2p_status_from_nvml_matches_the_p2p_capture() -> None:
    """A PCIe box whose `topo -p2p r` capture says OK between all GPUs, then one pair refused: the live probe
    asks NVML (``nvmlDeviceGetP2PStatus``, read, both ways) and records the same per link."""
    from toposched.topology.p2p import apply_p2p, parse_p2p_matrix

    source = parse_topo_matrix((FIXTURES / "topo/24_3gpu-5070-2x5060ti-phb-raw-ansi-tabs.txt").read_text()).node
    capture = (FIXTURES / "p2p/03_3gpu-5070-2x5060ti-p2p-ansi-tabs.txt").read_text()
    captured = apply_p2p(source, parse_p2p_matrix(capture, source="p2p.txt"))
    node = probe_node(FakeNvml.from_node(captured, nvswitch=False)).node
    assert [link.p2p for link in node.links] == [link.p2p for link in captured.links] == [True, True, True]
    refused = captured.model_copy(
        update={
            "links": tuple(x.model_copy(update={"p2p": False}) if (x.a, x.b) == (0, 2) else x for x in captured.links)
        }
    )
    node = probe_node(FakeNvml.from_node(refused, nvswitch=False)).node
    assert {(x.a, x.b): x.p2p for x in node.links} == {(0, 1): True, (0, 2): False, (1, 2): True}
    assert not node.peer_to_peer([0, 2]) and node.peer_to_peer([0, 1])


def test_p2p_is_unknown_when_the_driver_cannot_say() -> None:
    source = parse_topo_matrix((FIXTURES / "topo/21_8x-rtx4090-node-sys-with-prompt.txt").read_text()).node
    node = probe_node(FakeNvml.from_node(source, nvswitch=False)).node  # no P2P answers: NotSupported
    assert {x.p2p for x in node.links} == {None}
    nvlinked = probe_node(
        FakeNvml.from_node(parse_topo_matrix((FIXTURES / "topo/04_8x-h100-nv18-no-gpunumaid.txt").read_text()).node)
    ).node
    assert {x.p2p for x in nvlinked.links} == {None}  # NVLink pairs are not asked


def test_bridge_pair_from_nvlink_status_and_remote_captures() -> None:
    status = (FIXTURES / "nvlink/02_2x-h100pcie-bridge-nvlink-s-inactive-indented6.txt").read_text()
    remote = (FIXTURES / "nvlink/03_2x-h100pcie-bridge-nvlink-R-remote-indented6.txt").read_text()
    fake = FakeNvml.from_nvlink_text(status, remote)
    assert [g.bus_id for g in fake.gpus] == ["00000000:C2:00.0", "00000000:D5:00.0"]
    node = probe_node(fake).node
    link = node.link(0, 1)
    assert link is not None
    assert (link.kind, link.nvlinks) == (LinkKind.NVLINK, 12)  # 12 of 18 links active = NV12 in topo -m
    assert node.gpu(0).uuid == "GPU-6968dfc2-d444-d92c-c36b-6abe53445cb9"
    assert node.gpu(0).model == "NVIDIA H100 PCIe"
    assert _domains(node) == [[0, 1]]


def test_a_gpu_with_links_down_is_degraded() -> None:
    fake = FakeNvml.from_node(hgx("n", "NVIDIA H100 80GB HBM3", 79.65), nvswitch=True)
    for link in fake.gpus[3].links[:4]:
        link.up = False
    probe = probe_node(fake)
    assert probe.node.gpu(3).health is Health.DEGRADED
    assert probe.node.gpu(2).health is Health.OK
    assert probe.node.link(2, 3).nvlinks == 14  # type: ignore[union-attr]
    assert any("GPU 3 has 14 of 18 NVLinks" in w for w in probe.warnings)


def test_fabric_clique_is_reported() -> None:
    cluster = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31"  # NVML gives 16 raw bytes; written as GFD writes them
    fake = FakeNvml.from_node(hgx("n", "NVIDIA GB200", 173.0), fabric=(cluster, 7))
    assert probe_node(fake).fabric_clique == f"{cluster}/7"


def test_no_driver_is_a_clear_error() -> None:
    with pytest.raises(NoDriverError, match="no NVIDIA driver"):
        probe_node(FakeNvml([], driver=False))


def test_real_pynvml_without_a_driver_is_a_clear_error() -> None:
    # Without an NVIDIA driver the real library path must say so, not crash.
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # a GPU machine: the real path works here
        pynvml.nvmlShutdown()
        pytest.skip("NVML works here")
    with pytest.raises(NoDriverError) as info:
        probe_live()
    assert info.value.fix is not None and "--smi" in info.value.fix


def test_other_nvml_failures_name_the_call_and_gpu() -> None:
    fake = FakeNvml.from_node(dgx1_v100(), nvswitch=False)

    def broken(handle: int) -> str:
        raise RuntimeError("GPU is lost")

    fake.nvmlDeviceGetName = broken  # type: ignore[method-assign]
    with pytest.raises(DiscoveryError, match="NVML name for GPU 0 failed: GPU is lost"):
        probe_node(fake)
    assert fake.initialised is False  # shut down even on failure


def test_nvlink_captures_that_disagree_are_an_input_error() -> None:
    status = (FIXTURES / "nvlink/02_2x-h100pcie-bridge-nvlink-s-inactive-indented6.txt").read_text()
    remote = (FIXTURES / "nvlink/03_2x-h100pcie-bridge-nvlink-R-remote-indented6.txt").read_text()
    cut = "\n".join(line for line in remote.splitlines() if "Link 11:" not in line)  # one remote end fewer
    with pytest.raises(InputError, match="remote ends for GPU 0, but nvlink -s shows 12 active links"):
        FakeNvml.from_nvlink_text(status, cut)
    orphan = "Link 0: Remote Device 00000000:C2:00.0: Link 0\n" + remote  # before any "GPU n:" line
    assert len(FakeNvml.from_nvlink_text(status, orphan).gpus) == 2


@pytest.mark.parametrize("cpus", ["0-4000000000", "7-3", "0-x"])
def test_fake_cpu_affinity_is_bounded(cpus: str) -> None:
    node = hgx("n", "NVIDIA H100 80GB HBM3", 79.65)
    gpus = tuple(g.model_copy(update={"cpu_affinity": cpus}) for g in node.gpus)
    with pytest.raises(InputError, match="CPU list"):
        FakeNvml.from_node(node.model_copy(update={"gpus": gpus}))


def test_cpu_affinity_past_256_cpus_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML reports only the CPU words asked for; 4 words (256 CPUs) lost half of a 384-CPU machine.
    node = hgx("n", "NVIDIA H100 80GB HBM3", 79.65)
    gpus = tuple(g.model_copy(update={"cpu_affinity": "96-191,288-383"}) for g in node.gpus)
    monkeypatch.setattr(os, "cpu_count", lambda: 384)
    probe = probe_node(FakeNvml.from_node(node.model_copy(update={"gpus": gpus})), hostname="n")
    assert probe.node.gpu(0).cpu_affinity == "96-191,288-383"


def test_invalid_hostname_is_an_input_error() -> None:
    fake = FakeNvml.from_node(dgx1_v100(), nvswitch=False)
    with pytest.raises(InputError, match="this machine's node name 'bad_host"):
        probe_node(fake, hostname="bad_host\n")
    assert fake.initialised is False


def test_the_fake_takes_the_same_arguments_as_nvidia_ml_py() -> None:
    """Every NVML call the fake stands in for has nvidia-ml-py's own parameters, so code that passes the
    fake the wrong arguments (a fabric info call without the structure to fill) fails here, not on a GPU."""
    import inspect

    import pynvml

    from toposched.topology.nvml_fake import FakeNvml

    calls = [name for name in vars(FakeNvml) if name.startswith("nvml")]
    assert "nvmlDeviceGetGpuFabricInfo" in calls
    for name in calls:
        real = inspect.signature(getattr(pynvml, name)).parameters.values()
        required = [p for p in real if p.default is inspect.Parameter.empty]
        fake = list(inspect.signature(getattr(FakeNvml, name)).parameters)[1:]  # without self
        assert len(required) <= len(fake) <= len(real), (name, fake, [p.name for p in real])
