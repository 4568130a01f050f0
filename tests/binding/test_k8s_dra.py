"""Pinning pods to the planned GPUs: DRA claims, the device-plugin fallback, presets, multi-node pod needs."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.binding.builders import make_doc, make_placement
from tests.binding.k8s_views import command_script, k8s_objects, render_objects, render_roles
from tests.conftest import FIXTURES
from toposched.binding.k8s_dra import (
    BUS_ATTRIBUTE,
    DRA_BUS_ID,
    GPU_UUID,
    UUID_ATTRIBUTE,
    GpuIds,
    claim_template,
    claim_warning,
    dra_bus_id,
    gpu_ids,
    invented_ids,
    normalise_bus_id,
)
from toposched.binding.k8s_options import K8sOptions
from toposched.binding.k8s_pod import GPU_RESOURCE
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError, SpecError
from toposched.topology.model import Cluster, Fabric, Node
from toposched.topology.nvml import probe_node
from toposched.topology.nvml_fake import FakeNvml
from toposched.topology.presets import load_preset
from toposched.topology.smi import parse_topo_matrix
from toposched.topology.spec import load_cluster_spec

# resource.k8s.io/v1 is GA from Kubernetes 1.34; kubernetes-validate bundles 1.34-1.37 schemas with it.
DRA_VERSIONS = ("1.34", "1.37")


def validate(obj: dict[str, Any], version: str = "1.37") -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def validate_template(template: dict[str, Any]) -> None:
    validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})


def captured(doc: PlanDoc, *, uuids: bool = True) -> PlanDoc:
    """The plan as if its topology had been probed live (NVML): UUIDs in NVML's form, NVML bus ids.

    ``uuids=False`` leaves the UUIDs out, so the GPUs are named by bus id only.
    """
    nodes = []
    for node in doc.cluster.nodes:
        gpus = tuple(
            g.model_copy(
                update={"uuid": f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node.name}/{g.index}')}" if uuids else None}
            )
            for g in node.gpus
        )
        nodes.append(node.model_copy(update={"gpus": gpus, "source": "nvml"}))
    return PlanDoc(doc.placements, doc.request, doc.cluster.model_copy(update={"nodes": tuple(nodes)}))


def with_fabric(doc: PlanDoc, **fields: Any) -> PlanDoc:
    fabric = (doc.cluster.fabric or Fabric()).model_copy(update=fields)
    return PlanDoc(doc.placements, doc.request, doc.cluster.model_copy(update={"fabric": fabric}))


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return [o["kind"] for o in objects]


def expressions(claim: dict[str, Any]) -> list[str]:
    return [r["exactly"]["selectors"][0]["cel"]["expression"] for r in claim["spec"]["spec"]["devices"]["requests"]]


def real_node() -> Node:
    """Two H100 PCIe with an NVLink bridge, probed through NVML as captured (real UUIDs and bus ids)."""
    status = (FIXTURES / "nvlink/02_2x-h100pcie-bridge-nvlink-s-inactive-indented6.txt").read_text()
    remote = (FIXTURES / "nvlink/03_2x-h100pcie-bridge-nvlink-R-remote-indented6.txt").read_text()
    return probe_node(FakeNvml.from_nvlink_text(status, remote), hostname="dl380ag11").node


def real_doc() -> PlanDoc:
    return make_doc(Cluster(nodes=(real_node(),)), make_placement([("dl380ag11", (0, 1))], tp=2), model="llama-3.1-8b")


# --- bus id forms -----------------------------------------------------------------------------


def test_real_bus_ids_convert_to_the_dra_form() -> None:
    remote = (FIXTURES / "nvlink/03_2x-h100pcie-bridge-nvlink-R-remote-indented6.txt").read_text()
    captured_ids = sorted(set(re.findall(r"Remote Device ([0-9A-F:.]+):", remote)))
    assert captured_ids == ["00000000:C2:00.0", "00000000:D5:00.0"]  # NVML's form: 8-digit domain, upper case
    assert [dra_bus_id(b) for b in captured_ids] == ["0000:c2:00.0", "0000:d5:00.0"]
    assert [normalise_bus_id(dra_bus_id(b)) for b in captured_ids] == captured_ids  # and back
    assert dra_bus_id("c2:00.0") == "0000:c2:00.0" and dra_bus_id("0001:1B:1f.7") == "0001:1b:1f.7"
    # a domain past ffff or a device past 1f has no such form; anything else is not a bus id
    bad = ("00010000:18:00.0", "00000000:18:20.0", "00000000:18:00.8", "GPU-1234", "0:1:2.3", '0000:18:00.0" || "')
    for text in bad:
        with pytest.raises(InputError):
            dra_bus_id(text)


def test_checked_id_patterns_refuse_anything_else() -> None:
    assert DRA_BUS_ID.fullmatch("0000:18:00.0") and not DRA_BUS_ID.fullmatch("00000000:18:00.0")
    assert GPU_UUID.fullmatch("GPU-6968dfc2-d444-d92c-c36b-6abe53445cb9")
    for fake in ("GPU-preset-hgx-h100-0", "GPU-fake-n-0", "MIG-GPU-6968dfc2-d444-d92c-c36b-6abe53445cb9/1/0"):
        assert not GPU_UUID.fullmatch(fake)
    # a value that did not match its pattern never reaches a CEL expression, even when handed over directly
    hostile = GpuIds("n", (0,), ('GPU-x" || true || "',), None, None, None)
    with pytest.raises(InputError, match="CEL"):
        claim_template("c", {}, [hostile], pcie_root=False)


# --- DRA claims --------------------------------------------------------------------------------


def test_real_capture_gets_a_claim_on_its_uuids_and_pods_reference_it() -> None:
    out = render_objects(real_doc())
    assert out.gpu_request == "dra" and out.warnings == []
    claim, dep = out.objects
    assert kinds(out.objects) == ["ResourceClaimTemplate", "Deployment"]
    for version in DRA_VERSIONS:
        validate(claim, version)
    validate(dep)
    assert claim["apiVersion"] == "resource.k8s.io/v1"
    requests = claim["spec"]["spec"]["devices"]["requests"]
    assert [r["name"] for r in requests] == ["gpu-0", "gpu-1"]
    assert {r["exactly"]["deviceClassName"] for r in requests} == {"gpu.nvidia.com"}
    assert expressions(claim) == [
        f'{UUID_ATTRIBUTE} == "GPU-6968dfc2-d444-d92c-c36b-6abe53445cb9"',
        f'{UUID_ATTRIBUTE} == "GPU-9b1446e2-8a89-4cf6-b68c-a98d99e958d3"',
    ]
    assert "constraints" not in claim["spec"]["spec"]["devices"]  # an NVLink bridge pair: no PCIe switch known
    spec = dep["spec"]["template"]["spec"]
    assert spec["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": claim["metadata"]["name"]}]
    container = spec["containers"][0]
    assert container["resources"] == {"claims": [{"name": "gpus"}]}  # no nvidia.com/gpu next to the claim
    hosts = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert hosts["nodeSelectorTerms"][0]["matchExpressions"][0] == {
        "key": "kubernetes.io/hostname",
        "operator": "In",
        "values": ["dl380ag11"],
    }


def test_bus_id_claim_in_rank_order_with_a_pcie_root_only_behind_switches() -> None:
    cluster = captured(make_doc(load_preset("l40s-8x-pcie")), uuids=False).cluster
    tp4 = render_objects(make_doc(cluster, make_placement([("l40s", (3, 1, 0, 2))], tp=4), model="llama-3.1-8b"))
    claim = tp4.objects[0]
    assert expressions(claim) == [
        f'{BUS_ATTRIBUTE} == "0000:48:00.0"',
        f'{BUS_ATTRIBUTE} == "0000:28:00.0"',
        f'{BUS_ATTRIBUTE} == "0000:18:00.0"',
        f'{BUS_ATTRIBUTE} == "0000:38:00.0"',
    ]
    assert "constraints" not in claim["spec"]["spec"]["devices"]  # GPUs 0-3 reach each other through the host
    pair = render_objects(make_doc(cluster, make_placement([("l40s", (0, 1))], tp=2), model="llama-3.1-8b"))
    assert pair.objects[0]["spec"]["spec"]["devices"]["constraints"] == [
        {"matchAttribute": "resource.kubernetes.io/pcieRoot"}
    ]
    for obj in (claim, pair.objects[0]):
        validate(obj)


def test_the_validator_rejects_the_v1beta1_request_shape() -> None:
    claim = render_objects(real_doc()).objects[0]
    request = claim["spec"]["spec"]["devices"]["requests"][0]
    request["deviceClassName"] = request["exactly"].pop("deviceClassName")  # v1beta1 put it on the request
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(claim)


def test_multi_node_claims_for_leader_and_workers(plans: dict[str, PlanDoc]) -> None:
    doc = with_fabric(captured(plans["multi"]), rdma_resource="rdma/ib")
    out = render_objects(doc)
    assert out.gpu_request == "dra" and out.warnings == []
    leader_claim, worker_claim, lws = out.objects
    assert kinds(out.objects) == ["ResourceClaimTemplate", "ResourceClaimTemplate", "LeaderWorkerSet"]
    lwt = lws["spec"]["leaderWorkerTemplate"]
    nodes = sorted({r.node for r in doc.placements[0].ranks})
    for claim, tpl, node in (
        (leader_claim, lwt["leaderTemplate"], nodes[0]),
        (worker_claim, lwt["workerTemplate"], nodes[1]),
    ):
        validate(claim)
        validate_template(tpl)
        assert tpl["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == claim["metadata"]["name"]
        wanted = [f'{UUID_ATTRIBUTE} == "{doc.cluster.node(node).gpu(g).uuid}"' for g in range(8)]
        assert expressions(claim) == wanted
        container = tpl["spec"]["containers"][0]
        assert GPU_RESOURCE not in container["resources"]["limits"]
        assert container["resources"]["limits"] == {"rdma/ib": "1"}
        assert container["resources"]["requests"] == {"rdma/ib": "1", "cpu": "201"}  # its NUMA share: 0.9 x 224
        assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert "hostNetwork" not in tpl["spec"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in tpl["spec"]["volumes"]


def test_workers_on_several_nodes_uuids_stay_exact_bus_ids_warn() -> None:
    # Worker pods on two nodes that use different GPUs there (the claim is built from the pods' ids).
    cluster = load_preset("cluster-32x-hgx-h100")
    probed = captured(make_doc(cluster), uuids=True).cluster
    pods = [gpu_ids(probed.node("h100-01"), [0, 1]), gpu_ids(probed.node("h100-02"), [4, 5])]
    claim = claim_template("w", {}, pods, pcie_root=False)
    first = expressions(claim)[0]
    assert first == f'{UUID_ATTRIBUTE} in ["{pods[0].uuids[0]}", "{pods[1].uuids[0]}"]'  # type: ignore[index]
    assert claim_warning("p", pods) is None
    bare = captured(make_doc(cluster), uuids=False).cluster
    pods = [gpu_ids(bare.node("h100-01"), [0, 1]), gpu_ids(bare.node("h100-02"), [4, 5])]
    assert expressions(claim_template("w", {}, pods, pcie_root=False))[0] == (
        f'{BUS_ATTRIBUTE} in ["0000:18:00.0", "0000:58:00.0"]'
    )
    warning = claim_warning("p", pods)
    assert warning is not None and "differ between nodes h100-01, h100-02" in warning
    same = [gpu_ids(bare.node("h100-01"), [0, 1]), gpu_ids(bare.node("h100-02"), [0, 1])]
    assert claim_warning("p", same) is None


def test_role_based_group_with_dra(plans: dict[str, PlanDoc]) -> None:
    out = render_roles({"prefill": captured(plans["pcie"]), "decode": captured(plans["two"])}, "pd")
    assert kinds(out.objects) == [
        "ResourceClaimTemplate", "ResourceClaimTemplate", "ResourceClaimTemplate", "RoleBasedGroup", "CoordinatedPolicy"
    ]  # fmt: skip
    rbg = out.objects[3]
    names = [o["metadata"]["name"] for o in out.objects[:3]]
    refs = [
        r["standalonePattern"]["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
        for r in rbg["spec"]["roles"]
    ]
    assert refs == names and len(set(names)) == 3
    for claim in out.objects[:3]:
        validate(claim)


def test_a_probe_reused_for_several_spec_nodes_pins_by_bus_id(tmp_path: Path) -> None:
    """One saved probe for ``count: 2`` nodes gives both the same UUIDs: right for one machine at most."""
    (tmp_path / "probe.json").write_text(real_node().model_dump_json())
    spec = {"nodes": [{"name": "gpu-{i}", "count": 2, "probe": "probe.json"}]}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(spec))
    cluster = load_cluster_spec(tmp_path / "cluster.yaml")
    doc = make_doc(cluster, make_placement([("gpu-1", (0, 1))], tp=2), model="llama-3.1-8b")
    claim, dep = render_objects(doc).objects
    assert expressions(claim) == [f'{BUS_ATTRIBUTE} == "0000:c2:00.0"', f'{BUS_ATTRIBUTE} == "0000:d5:00.0"']
    assert "select_gpus bus 00000000:C2:00.0 00000000:D5:00.0" in command_script(
        dep["spec"]["template"]["spec"]["containers"][0]
    )
    spec["nodes"][0]["count"] = 1
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(spec))
    one = make_doc(load_cluster_spec(tmp_path / "cluster.yaml"), make_placement([("gpu-0", (0, 1))], tp=2))
    assert expressions(render_objects(one).objects[0])[0].startswith(f'{UUID_ATTRIBUTE} == "GPU-6968dfc2')


# --- presets and plans without ids: the device plugin, with the reason -----------------------------


def test_presets_are_marked_as_invented(plans: dict[str, PlanDoc]) -> None:
    assert all(invented_ids(n) for n in plans["multi"].cluster.nodes)
    assert not any(invented_ids(n) for n in captured(plans["multi"]).cluster.nodes)
    assert invented_ids(real_node()) is False
    # A cluster spec node made from a preset keeps the marker (source and UUIDs both say so).
    assert invented_ids(load_preset("hgx-h100").nodes[0].model_copy(update={"source": "edited"}))


def test_a_preset_plan_falls_back_to_the_device_plugin_and_says_why(plans: dict[str, PlanDoc]) -> None:
    out = render_objects(plans["pcie"])
    assert out.gpu_request == "device-plugin"
    assert kinds(out.objects) == ["Deployment"]
    (warning,) = out.warnings
    assert warning.startswith("GPU pinning needs a captured or live topology: node l40s: made from a preset")
    assert "--live" in warning
    container = out.objects[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"][GPU_RESOURCE] == "4"
    script = command_script(container)
    assert "select_gpus bus" not in script and "select_gpus uuid" not in script  # invented ids are never matched
    assert "00000000:18:00.0" not in script
    with pytest.raises(
        InputError, match=r"^--gpu-request dra cannot pin the GPUs of node l40s: made from a preset"
    ) as err:
        render_objects(plans["pcie"], K8sOptions(gpu_request="dra"))
    assert "\n" not in err.value.message and "captured or live topology" in err.value.message


def test_an_smi_capture_plan_has_no_ids_and_falls_back() -> None:
    node = parse_topo_matrix((FIXTURES / "topo/13_8x-a100-nv12-1nic-numa3157.txt").read_text(), hostname="a100").node
    node = node.model_copy(
        update={
            "gpus": tuple(g.model_copy(update={"model": "NVIDIA A100-SXM4-80GB", "hbm_gib": 80.0}) for g in node.gpus)
        }
    )
    doc = make_doc(Cluster(nodes=(node,)), make_placement([("a100", (0, 1))], tp=2), model="llama-3.1-8b")
    out = render_objects(doc)
    assert out.gpu_request == "device-plugin" and len(out.warnings) == 1
    assert "neither the PCI bus ids nor the UUIDs" in out.warnings[0]
    with pytest.raises(InputError, match="cannot pin"):
        render_objects(doc, K8sOptions(gpu_request="dra"))


def test_device_plugin_mode_warns_when_a_pod_does_not_take_the_whole_node(plans: dict[str, PlanDoc]) -> None:
    doc = captured(plans["two"])
    out = render_objects(doc, K8sOptions(gpu_request="device-plugin"))
    assert kinds(out.objects) == ["Deployment", "Deployment"]
    assert len(out.warnings) == 2 and all("crash-loops" in w and "4 of the 8 GPUs" in w for w in out.warnings)
    for dep in out.objects:
        spec = dep["spec"]["template"]["spec"]
        assert "resourceClaims" not in spec
        assert spec["containers"][0]["resources"]["limits"][GPU_RESOURCE] == "4"
        assert "select_gpus uuid GPU-" in command_script(spec["containers"][0])  # still checked at start
    whole = make_doc(doc.cluster, make_placement([("hgx-h100", range(8))], tp=8), model="llama-3.1-8b")
    assert render_objects(whole, K8sOptions(gpu_request="device-plugin")).warnings == []


def test_an_unknown_gpu_request_is_refused() -> None:
    with pytest.raises(InputError, match="not one of auto, dra, device-plugin"):
        K8sOptions(gpu_request="exact")  # type: ignore[arg-type]


# --- multi-node pods: RDMA, IPC_LOCK, host network ------------------------------------------------


def test_multi_node_pods_without_rdma_get_a_warning(plans: dict[str, PlanDoc]) -> None:
    out = render_objects(plans["multi"])
    assert any("request no RDMA device" in w and "fabric.rdma_resource" in w for w in out.warnings)
    lwt = out.objects[0]["spec"]["leaderWorkerTemplate"]
    for tpl in (lwt["leaderTemplate"], lwt["workerTemplate"]):
        assert tpl["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    single = render_objects(captured(plans["pcie"]))
    assert "securityContext" not in single.objects[-1]["spec"]["template"]["spec"]["containers"][0]


def test_host_network_and_rdma_resource_from_the_fabric(plans: dict[str, PlanDoc]) -> None:
    doc = with_fabric(plans["multi"], host_network=True, rdma_resource="nvidia.com/hostdev", rdma_per_pod=8)
    out = render_objects(doc)
    assert not any("RDMA" in w for w in out.warnings)
    lwt = out.objects[0]["spec"]["leaderWorkerTemplate"]
    for tpl in (lwt["leaderTemplate"], lwt["workerTemplate"]):
        validate_template(tpl)
        spec = tpl["spec"]
        assert (spec["hostNetwork"], spec["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
        limits = spec["containers"][0]["resources"]["limits"]
        assert limits == {GPU_RESOURCE: "8", "nvidia.com/hostdev": "8"}
    # host network alone carries the host's RDMA devices: no warning either
    assert not any("RDMA" in w for w in render_objects(with_fabric(plans["multi"], host_network=True)).warnings)
    # single-node pods never get them
    dep = k8s_objects(with_fabric(plans["pcie"], host_network=True, rdma_resource="rdma/ib"))[0]
    spec = dep["spec"]["template"]["spec"]
    assert "hostNetwork" not in spec and "rdma/ib" not in spec["containers"][0]["resources"]["limits"]


def test_fabric_settings_come_from_the_cluster_spec(tmp_path: Path) -> None:
    spec = {
        "fabric": {"kind": "IB", "rdma_resource": "rdma/ib", "rdma_per_pod": 1, "host_network": True},
        "nodes": [{"name": "gpu-{i}", "count": 2, "preset": "hgx-h100"}],
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec))
    fabric = load_cluster_spec(path).fabric
    assert fabric is not None and (fabric.rdma_resource, fabric.host_network) == ("rdma/ib", True)
    for bad in ("rdma", "RDMA/ib", "rdma/ib x", "kubernetes.io/rdma"):
        spec["fabric"]["rdma_resource"] = bad  # type: ignore[index]
        path.write_text(yaml.safe_dump(spec))
        with pytest.raises(
            SpecError, match=r"fabric\.rdma_resource: .*(not a Kubernetes extended resource|kubernetes\.io domain)"
        ):
            load_cluster_spec(path)
