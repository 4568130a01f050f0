"""Kubernetes objects: schema validation, affinity, the GPU-selecting entrypoint, kubelet config, lint."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.binding.builders import make_doc, make_placement, nvl72_doc
from tests.binding.conftest import DATA
from tests.binding.k8s_views import k8s_objects, render_objects, role_based_group, runnable_command, script_of
from tests.binding.test_k8s_dra import captured
from toposched.binding.engines import VLLM_FLAGS
from toposched.binding.k8s import lint_nodes, normalise_bus_id
from toposched.binding.k8s_affinity import GPU_CLIQUE, node_requirements
from toposched.binding.k8s_options import K8sOptions
from toposched.binding.kubelet import kubelet_configs
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError
from toposched.solver.request import Rank
from toposched.topology.presets import load_preset

K8S_VERSION = "1.37"  # kubernetes-validate's newest bundled schemas (tooling-checked.md)

# CRD field lists, written from reference/engines.md (section 4: LWS; section 3: RBG v1alpha2 and
# CoordinatedPolicy; section 5: KubeletConfiguration json names, incl. its constructed example).
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE = {
    "leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy", "volumeClaimTemplates",
    "persistentVolumeClaimRetentionPolicy",
}  # fmt: skip
LWS_RESTART = {"Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"}
RBG_SPEC = {"roles", "roleTemplates"}
RBG_ROLE = {
    "name", "labels", "annotations", "replicas", "rolloutStrategy", "dependencies", "standalonePattern",
    "leaderWorkerPattern", "customComponentsPattern", "servicePorts", "engineRuntimes", "scalingAdapter",
    "minReadySeconds", "podManagementPolicy",
}  # fmt: skip
RBG_ROLLOUT = {"type", "rollingUpdate"}
RBG_ROLLING = {"type", "partition", "maxUnavailable", "maxSurge", "paused", "inPlaceUpdateStrategy"}
RBG_STANDALONE = {"template", "templateRef"}
COORD_SPEC = {"policies"}
COORD_POLICY = {"name", "roles", "strategy"}
COORD_STRATEGY = {"rollingUpdate", "scaling"}
COORD_ROLLING = {"maxSkew", "partition", "maxUnavailable"}
KUBELET_FIELDS = {
    "apiVersion", "kind", "topologyManagerPolicy", "topologyManagerScope", "topologyManagerPolicyOptions",
    "cpuManagerPolicy", "cpuManagerPolicyOptions", "memoryManagerPolicy", "reservedMemory", "reservedSystemCPUs",
    "kubeReserved", "systemReserved", "evictionHard",
}  # fmt: skip
TOPOLOGY_OPTIONS = {"prefer-closest-numa-nodes", "max-allowable-numa-nodes", "numa-allocation-strategy"}


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def validate_template(template: dict[str, Any]) -> None:
    """A CRD's embedded PodTemplateSpec, checked as the template of a core ``v1`` ``PodTemplate``."""
    validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})


def templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] == "Deployment":
        return [obj["spec"]["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return [r["standalonePattern"]["template"] for r in obj["spec"]["roles"]]


def expressions(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    terms = template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return {e["key"]: e for e in terms["nodeSelectorTerms"][0]["matchExpressions"]}


# --- schema validation -------------------------------------------------------------------------


@pytest.mark.parametrize("probed", [False, True], ids=["preset", "captured"])
@pytest.mark.parametrize("name", ["pcie", "two", "multi"])
def test_objects_validate_against_the_kubernetes_schemas(plans: dict[str, PlanDoc], name: str, probed: bool) -> None:
    out = render_objects(captured(plans[name]) if probed else plans[name])
    assert out.gpu_request == ("dra" if probed else "device-plugin")
    workloads = [o for o in out.objects if o["kind"] != "ResourceClaimTemplate"]
    claims = [o for o in out.objects if o["kind"] == "ResourceClaimTemplate"]
    assert len(workloads) == len(plans[name].placements)
    assert len(claims) == (sum(len(templates(o)) for o in workloads) if probed else 0)
    for obj in out.objects:
        if obj["kind"] in ("Deployment", "ResourceClaimTemplate"):
            validate(obj)
    for obj in workloads:
        for template in templates(obj):
            validate_template(template)


def test_the_validator_rejects_an_invented_field(plans: dict[str, PlanDoc]) -> None:
    obj = k8s_objects(plans["pcie"])[0]
    obj["spec"]["template"]["spec"]["topologyAwarePlacement"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(obj)


def test_leader_worker_set_uses_only_published_fields(plans: dict[str, PlanDoc]) -> None:
    (lws,) = k8s_objects(plans["multi"])
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert set(lws["spec"]) <= LWS_SPEC
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert set(lwt) <= LWS_TEMPLATE
    assert lwt["size"] == 2
    assert lwt["restartPolicy"] in LWS_RESTART


def test_role_based_group_and_coordinated_policy_use_only_published_fields(plans: dict[str, PlanDoc]) -> None:
    rbg, policy = role_based_group({"prefill": plans["pcie"], "decode": plans["two"]}, "pd")
    assert (rbg["apiVersion"], rbg["kind"]) == ("workloads.x-k8s.io/v1alpha2", "RoleBasedGroup")
    assert (policy["apiVersion"], policy["kind"]) == ("workloads.x-k8s.io/v1alpha2", "CoordinatedPolicy")
    assert set(rbg["spec"]) <= RBG_SPEC
    names = []
    for role in rbg["spec"]["roles"]:
        assert set(role) <= RBG_ROLE
        assert set(role["rolloutStrategy"]) <= RBG_ROLLOUT
        assert set(role["rolloutStrategy"]["rollingUpdate"]) <= RBG_ROLLING
        assert role["rolloutStrategy"]["rollingUpdate"]["maxSurge"] == 0  # pinned GPUs: never surge
        assert set(role["standalonePattern"]) <= RBG_STANDALONE
        validate_template(role["standalonePattern"]["template"])
        names.append(role["name"])
    assert names == ["prefill", "decode-0", "decode-1"]
    assert set(policy["spec"]) <= COORD_SPEC
    (p,) = policy["spec"]["policies"]
    assert set(p) <= COORD_POLICY and set(p["strategy"]) <= COORD_STRATEGY
    assert set(p["strategy"]["rollingUpdate"]) <= COORD_ROLLING
    assert p["roles"] == names
    assert "topologyAwarePlacement" not in json.dumps([rbg, policy])  # engines.md section 10


def test_role_based_group_refuses_multi_node_roles(plans: dict[str, PlanDoc]) -> None:
    with pytest.raises(InputError, match="single-node placements only"):
        role_based_group({"decode": plans["multi"]}, "pd")


# --- what the objects say ---------------------------------------------------------------------


def test_pcie_plan_deployment(plans: dict[str, PlanDoc]) -> None:
    (dep,) = k8s_objects(captured(plans["pcie"], uuids=False), K8sOptions(gpu_request="device-plugin"))
    assert dep["kind"] == "Deployment" and dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    tpl = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()
    exprs = expressions(tpl)
    assert exprs["kubernetes.io/hostname"]["values"] == ["l40s"]
    assert exprs["nvidia.com/gpu.product"] == {
        "key": "nvidia.com/gpu.product",
        "operator": "In",
        "values": ["NVIDIA-L40S"],
    }
    container = tpl["spec"]["containers"][0]
    assert container["image"] == "vllm/vllm-openai:v0.33.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in tpl["spec"]["volumes"]
    script = script_of(tpl)
    assert "exec numactl --cpunodebind=0 --membind=0 vllm serve" in script
    assert "00000000:18:00.0 00000000:28:00.0 00000000:38:00.0 00000000:48:00.0" in script
    assert "CUDA_VISIBLE_DEVICES=0" not in script and "nvidia-smi -i" not in script
    # SIGTERM (a scale-down, a deleted pod): vLLM finishes its requests for 30 s, then Kubernetes may kill it
    assert "--shutdown-timeout 30" in script and tpl["spec"]["terminationGracePeriodSeconds"] == 45


def test_two_replicas_get_disjoint_numa_aligned_gpus(plans: dict[str, PlanDoc]) -> None:
    deps = k8s_objects(captured(plans["two"], uuids=False), K8sOptions(gpu_request="device-plugin"))
    assert [d["kind"] for d in deps] == ["Deployment", "Deployment"]
    assert len({d["metadata"]["name"] for d in deps}) == 2
    buses = []
    for dep in deps:
        script = script_of(dep["spec"]["template"])
        buses.append(set(re.findall(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-9A-F]", script)))
        assert len(buses[-1]) == 4
        assert re.search(r"numactl --cpunodebind=(\d) --membind=\1 ", script)
    assert not buses[0] & buses[1]
    numas = {re.search(r"--cpunodebind=(\d)", script_of(d["spec"]["template"])).group(1) for d in deps}  # type: ignore[union-attr]
    assert numas == {"0", "1"}


def test_multi_node_plan_is_one_leader_worker_set(plans: dict[str, PlanDoc]) -> None:
    (lws,) = k8s_objects(plans["multi"])
    leader, worker = templates(lws)
    nodes = sorted({r.node for r in plans["multi"].placements[0].ranks})
    assert expressions(leader)["kubernetes.io/hostname"]["values"] == nodes[:1]
    assert expressions(worker)["kubernetes.io/hostname"]["values"] == nodes[1:]
    for tpl, rank in ((leader, "0"), (worker, "1")):
        script = script_of(tpl)
        assert f'--nnodes 2 --node-rank {rank} --master-addr "$LWS_LEADER_ADDRESS" --master-port 29501' in script
        assert ("--headless" in script) == (rank == "1")
        anti = tpl["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert tpl["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
        env = {e["name"]: e.get("value") for e in tpl["spec"]["containers"][0]["env"]}
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and "CUDA_VISIBLE_DEVICES" not in env
        assert env["NCCL_IB_HCA"].startswith("=mlx5_")
    flags = set(re.findall(r"(?<= )--[a-z-]+", script_of(worker).split("vllm serve", 1)[1]))
    assert flags <= VLLM_FLAGS


def test_clique_label_for_multi_node_nvlink(plans: dict[str, PlanDoc]) -> None:
    cluster = load_preset("gb200-nvl72")
    trays = [n.name for n in cluster.nodes[:2]]
    base = plans["pcie"].placements[0]
    ranks = tuple(Rank(rank=i, node=trays[i // 4], gpu=i % 4, stage=0, tp_rank=i) for i in range(8))
    placement = base.model_copy(update={"ranks": ranks, "tp": 8})
    doc = PlanDoc((placement,), plans["pcie"].request, cluster)
    reqs = {r.key: r for r in node_requirements(doc, placement, trays, K8sOptions())}
    assert reqs[GPU_CLIQUE].operator == "Exists"  # the preset does not know the fabric's cluster UUID
    labelled = cluster.model_copy(
        update={
            "nodes": tuple(
                n.model_copy(update={"labels": {GPU_CLIQUE: "7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1"}})
                for n in cluster.nodes
            )
        }
    )
    doc = PlanDoc((placement,), plans["pcie"].request, labelled)
    reqs = {r.key: r for r in node_requirements(doc, placement, trays, K8sOptions())}
    assert reqs[GPU_CLIQUE].values == ("7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1",)


def test_spread_replicas_get_anti_affinity_and_spread(plans: dict[str, PlanDoc]) -> None:
    doc = plans["two"]
    assert "podAntiAffinity" not in k8s_objects(doc)[0]["spec"]["template"]["spec"]["affinity"]
    spread = PlanDoc(doc.placements, doc.request.model_copy(update={"spread_replicas": True}), doc.cluster)
    for dep in k8s_objects(spread):
        validate(dep)
        spec = dep["spec"]["template"]["spec"]
        assert spec["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"] == {"toposched.io/request": "plan"}
        assert spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
            "topologyKey"
        ] == ("kubernetes.io/hostname")


def test_plan_without_bus_ids_or_uuids_cannot_pin(plans: dict[str, PlanDoc]) -> None:
    doc = captured(plans["pcie"], uuids=False)
    bare = doc.cluster.model_copy(
        update={
            "nodes": tuple(
                n.model_copy(update={"gpus": tuple(g.model_copy(update={"pci_bus_id": None}) for g in n.gpus)})
                for n in doc.cluster.nodes
            )
        }
    )
    with pytest.raises(InputError, match="neither the PCI bus ids nor the UUIDs"):
        k8s_objects(PlanDoc(doc.placements, doc.request, bare), K8sOptions(gpu_request="dra"))
    out = render_objects(PlanDoc(doc.placements, doc.request, bare))
    assert out.gpu_request == "device-plugin" and "captured or live topology" in out.warnings[0]
    assert "nvidia-smi -i" not in script_of(out.objects[0]["spec"]["template"])  # never an index


def test_bus_id_forms_normalise_to_nvidia_smi_form() -> None:
    assert normalise_bus_id("0000:18:00.0") == "00000000:18:00.0"
    assert normalise_bus_id("00000000:af:00.0") == "00000000:AF:00.0"
    assert normalise_bus_id("1b:00.0") == "00000000:1B:00.0"
    for bad in ("GPU-1234", "00000000:18:00.0;x", "0000:18:00"):
        with pytest.raises(InputError):
            normalise_bus_id(bad)


# --- the entrypoint, run for real with fake nvidia-smi / numactl / vllm --------------------------


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion of ``command`` (k8s third_party/forked/golang/expansion)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env.get(name, f"$({name})"))
                    i = end + 1
                    continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


FAKE_SMI = """#!/bin/sh
# what nvidia-smi --query-gpu=pci.bus_id,uuid --format=csv,noheader prints; order and count differ from the host
cat "$FAKE_GPUS"
"""
FAKE_NUMACTL = """#!/bin/sh
printf '%s\\n' "$@" > "$REC/numactl"
while [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""
FAKE_VLLM = """#!/bin/sh
printf '%s\\n' "$@" > "$REC/vllm"
printf '%s|%s\\n' "$CUDA_VISIBLE_DEVICES" "$CUDA_DEVICE_ORDER" > "$REC/env"
"""


def run_entrypoint(
    tmp_path: Path, template: dict[str, Any], node: str, gpus: list[str]
) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("nvidia-smi", FAKE_SMI), ("numactl", FAKE_NUMACTL), ("vllm", FAKE_VLLM)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "gpus.csv").write_text("".join(g + "\n" for g in gpus))
    rec = tmp_path / "rec"
    rec.mkdir(exist_ok=True)
    container = template["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env.update(
        NODE_NAME=node, LWS_LEADER_ADDRESS="grp-0.grp.default", PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_GPUS=str(tmp_path / "gpus.csv"), REC=str(rec), HOME=str(tmp_path),
    )  # fmt: skip
    assert [kubelet_expand(part, env) for part in container["command"]] == container["command"]  # nothing to expand
    command = runnable_command(container, tmp_path)
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30, check=False)


# What the container sees of the l40s box: the device plugin gave it GPUs 0-3, listed in another order.
L40S_VISIBLE = [
    "00000000:38:00.0, GPU-ccc",
    "00000000:18:00.0, GPU-aaa",
    "00000000:48:00.0, GPU-ddd",
    "00000000:28:00.0, GPU-bbb",
]


def test_entrypoint_selects_planned_gpus_by_bus_id_in_rank_order(plans: dict[str, PlanDoc], tmp_path: Path) -> None:
    (dep,) = k8s_objects(captured(plans["pcie"], uuids=False), K8sOptions(gpu_request="device-plugin"))
    result = run_entrypoint(tmp_path, dep["spec"]["template"], "l40s", L40S_VISIBLE)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "rec/env").read_text() == "GPU-aaa,GPU-bbb,GPU-ccc,GPU-ddd|PCI_BUS_ID\n"
    assert (tmp_path / "rec/numactl").read_text().splitlines()[:2] == ["--cpunodebind=0", "--membind=0"]
    argv = (tmp_path / "rec/vllm").read_text().splitlines()
    assert argv[:2] == ["serve", "meta-llama/Llama-3.1-8B"]


def test_entrypoint_fails_when_a_planned_gpu_is_not_visible(plans: dict[str, PlanDoc], tmp_path: Path) -> None:
    _claim, dep = k8s_objects(captured(plans["pcie"], uuids=False))  # DRA: the same check at start
    result = run_entrypoint(tmp_path, dep["spec"]["template"], "l40s", L40S_VISIBLE[:3])
    assert result.returncode == 1
    assert "00000000:48:00.0" in result.stderr and "not visible" in result.stderr
    assert not (tmp_path / "rec/vllm").exists()


def test_entrypoint_refuses_a_node_outside_the_plan(plans: dict[str, PlanDoc], tmp_path: Path) -> None:
    (dep,) = k8s_objects(plans["pcie"])
    result = run_entrypoint(tmp_path, dep["spec"]["template"], "other-node", L40S_VISIBLE)
    assert result.returncode == 1 and "other-node" in result.stderr


def test_entrypoint_of_a_preset_plan_takes_the_gpus_it_was_given(plans: dict[str, PlanDoc], tmp_path: Path) -> None:
    """Invented bus ids are never matched: the pod runs on the GPUs the device plugin gave, and says so."""
    (dep,) = k8s_objects(plans["pcie"])
    result = run_entrypoint(tmp_path, dep["spec"]["template"], "l40s", ["00000000:AF:00.0, GPU-real"] * 4)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "rec/env").read_text() == "|PCI_BUS_ID\n"  # CUDA_VISIBLE_DEVICES left as the runtime set it
    assert "no real GPU ids" in result.stderr


def test_entrypoint_runs_no_command_hidden_in_the_model_path(plans: dict[str, PlanDoc], tmp_path: Path) -> None:
    evil = "/models/my model $(touch PWNED1) `touch PWNED2` $(HOME) $HOME; touch PWNED3 'q\""
    (dep,) = k8s_objects(captured(plans["pcie"], uuids=False), K8sOptions(model_path=evil, gpu_request="device-plugin"))
    result = run_entrypoint(tmp_path, dep["spec"]["template"], "l40s", L40S_VISIBLE)
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob("PWNED*"))
    assert (tmp_path / "rec/vllm").read_text().splitlines()[1] == evil


def test_worker_entrypoint_reaches_the_leader(plans: dict[str, PlanDoc], tmp_path: Path) -> None:
    (lws,) = k8s_objects(captured(plans["multi"], uuids=False), K8sOptions(gpu_request="device-plugin"))
    worker = templates(lws)[1]
    node = expressions(worker)["kubernetes.io/hostname"]["values"][0]
    visible = [f"00000000:{b}:00.0, GPU-{b}" for b in ("88", "78", "68", "58", "48", "38", "28", "18")]
    result = run_entrypoint(tmp_path, worker, node, visible)
    assert result.returncode == 0, result.stderr
    argv = (tmp_path / "rec/vllm").read_text().splitlines()
    assert argv[argv.index("--master-addr") + 1] == "grp-0.grp.default"
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert (tmp_path / "rec/env").read_text().startswith("GPU-18,GPU-28,GPU-38,GPU-48,GPU-58,GPU-68,GPU-78,GPU-88|")


# --- kubelet ------------------------------------------------------------------------------------


def _mib(q: str) -> int:
    n, unit = re.fullmatch(r"(\d+)(Mi|Gi)", q).groups()  # type: ignore[union-attr]
    return int(n) * (1024 if unit == "Gi" else 1)


@pytest.mark.parametrize(("name", "policy"), [("pcie", "single-numa-node"), ("multi", "best-effort")])
def test_kubelet_config_fields_and_reserved_memory_sum(plans: dict[str, PlanDoc], name: str, policy: str) -> None:
    configs = kubelet_configs(plans[name], kube_reserved="2Gi", system_reserved="1Gi", eviction_memory="500Mi")
    assert configs
    for item in configs:
        nodes, cfg = item.nodes, item.config
        assert nodes and item.reason
        assert list(item.document()) == ["nodes", "reason", "config"]
        assert set(cfg) <= KUBELET_FIELDS
        assert cfg["apiVersion"] == "kubelet.config.k8s.io/v1beta1" and cfg["kind"] == "KubeletConfiguration"
        assert cfg["topologyManagerPolicy"] == policy and cfg["topologyManagerScope"] == "pod"
        assert set(cfg["topologyManagerPolicyOptions"]) <= TOPOLOGY_OPTIONS
        assert (cfg["cpuManagerPolicy"], cfg["memoryManagerPolicy"]) == ("static", "Static")
        assert cfg["reservedSystemCPUs"]  # the static CPU manager needs a non-zero CPU reservation
        total = sum(_mib(r["limits"]["memory"]) for r in cfg["reservedMemory"])
        expected = (
            _mib(cfg["kubeReserved"]["memory"])
            + _mib(cfg["systemReserved"]["memory"])
            + _mib(cfg["evictionHard"]["memory.available"])
        )
        assert total == expected == 2048 + 1024 + 500
        assert [r["numaNode"] for r in cfg["reservedMemory"]] == [0, 1]
        assert set(cfg["evictionHard"]) >= {"memory.available", "nodefs.available", "imagefs.available"}


def test_kubelet_rejects_an_unknown_policy(plans: dict[str, PlanDoc]) -> None:
    with pytest.raises(InputError, match="not one of"):
        kubelet_configs(plans["pcie"], policy="numa-aware")


def _policies(doc: PlanDoc, policy: str = "auto") -> dict[str, tuple[str, str]]:
    return {
        n: (k.config["topologyManagerPolicy"], k.reason) for k in kubelet_configs(doc, policy=policy) for n in k.nodes
    }


def test_kubelet_policy_admits_every_planned_pod(plans: dict[str, PlanDoc]) -> None:
    """single-numa-node (pod scope) only where no pod's GPUs span NUMA nodes: it would refuse those pods."""
    assert _policies(plans["two"])["hgx-h100"][0] == "single-numa-node"  # TP4 halves, one per socket
    multi = _policies(plans["multi"])  # TP8 x PP2: each pod has 8 GPUs over both sockets of its node
    assert {p for p, _ in multi.values()} == {"best-effort"}
    assert all("NUMA nodes 0,1" in reason and "TopologyAffinityError" in reason for _, reason in multi.values())
    cluster = load_preset("dgx-a100")  # NPS4: GPUs 0,1 on NUMA 3, 2,3 on 1, 4,5 on 7, 6,7 on 5
    pair = make_doc(cluster, make_placement([("dgx-a100", (0, 1))], tp=2), model="llama-3.1-8b")
    assert _policies(pair)["dgx-a100"][0] == "single-numa-node"
    both = make_doc(
        cluster,
        make_placement([("dgx-a100", (0, 1))], tp=2, id="plan-0"),
        make_placement([("dgx-a100", range(2, 8))], tp=2, pp=3, id="plan-1"),
        model="llama-3.1-8b",
    )
    policy, reason = _policies(both)["dgx-a100"]  # one pod spans NUMA 1, 5 and 7: the node's kubelet must admit it
    assert policy == "best-effort" and "1,5,7" in reason
    unknown = captured(pair).cluster.model_copy(
        update={
            "nodes": tuple(
                n.model_copy(update={"gpus": tuple(g.model_copy(update={"numa_node": None}) for g in n.gpus)})
                for n in cluster.nodes
            )
        }
    )
    assert _policies(PlanDoc(pair.placements, pair.request, unknown))["dgx-a100"][0] == "best-effort"


def test_kubelet_policy_asked_for(plans: dict[str, PlanDoc]) -> None:
    with pytest.raises(InputError, match="would refuse the pod of placement plan") as err:
        kubelet_configs(plans["multi"], policy="single-numa-node")
    assert "NUMA nodes 0,1" in err.value.message and "auto" in (err.value.fix or "")
    policy, reason = _policies(plans["multi"], "restricted")["h100-00"]
    assert policy == "restricted" and reason == "--topology-policy restricted as asked (auto would choose best-effort)"
    assert _policies(plans["pcie"], "single-numa-node")["l40s"][0] == "single-numa-node"


# --- lint (seed 003 section 3.1) -----------------------------------------------------------------


def nodes_fixture() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / "nodes-h100.json").read_text())
    return data


def test_nodes_fixture_is_valid_kubernetes() -> None:
    data = nodes_fixture()
    assert data["kind"] == "List"
    for item in data["items"]:
        validate(item)


def test_lint_finds_the_node_without_gpu_labels(plans: dict[str, PlanDoc]) -> None:
    findings = lint_nodes(plans["multi"], nodes_fixture())
    assert [(f.node, f.problem) for f in findings] == [("h100-01", "no label nvidia.com/gpu.product")]


def test_lint_finds_missing_rack_labels_and_missing_nodes(plans: dict[str, PlanDoc]) -> None:
    doc = plans["multi"]
    racked = PlanDoc(doc.placements, doc.request.model_copy(update={"racks": ("rack0",)}), doc.cluster)
    data = nodes_fixture()
    problems = {(f.node, f.problem) for f in lint_nodes(racked, data)}
    assert ("h100-01", "no label toposched.io/rack") in problems
    assert not any(n == "h100-00" for n, _ in problems)
    data["items"] = [i for i in data["items"] if i["metadata"]["name"] != "h100-00"]
    problems = {(f.node, f.problem) for f in lint_nodes(doc, data)}
    assert ("h100-00", "node not found in the nodes file") in problems


def test_lint_passes_when_every_label_is_there(plans: dict[str, PlanDoc]) -> None:
    data = nodes_fixture()
    data["items"][1]["metadata"]["labels"]["nvidia.com/gpu.product"] = "NVIDIA-H100-80GB-HBM3"
    assert lint_nodes(plans["multi"], data) == []
    data["items"][1]["metadata"]["labels"]["nvidia.com/gpu.product"] = "NVIDIA-H100-80GB-HBM3-SHARED"
    (finding,) = lint_nodes(plans["multi"], data)
    assert "is not one of NVIDIA-H100-80GB-HBM3" in finding.problem


def test_sglang_workers_reach_the_leader_and_need_an_image(plans: dict[str, PlanDoc]) -> None:
    with pytest.raises(InputError, match="no default image"):
        k8s_objects(plans["multi"], K8sOptions(engine="sglang"))
    (lws,) = k8s_objects(plans["multi"], K8sOptions(engine="sglang", image="example/sglang:pinned"))
    script = script_of(templates(lws)[1])
    assert '--dist-init-addr "$LWS_LEADER_ADDRESS:20000"' in script
    assert "--node-rank 1" in script


# --- TP across the trays of a multi-node NVLink domain (GB200 NVL72; issue 12, defect 5) -------------

NVL72_VISIBLE = [  # what a tray's container sees: its four GPUs, listed out of order
    "00000000:38:00.0, GPU-t2",
    "00000000:18:00.0, GPU-t0",
    "00000000:48:00.0, GPU-t3",
    "00000000:28:00.0, GPU-t1",
]


def test_tp_over_nvl72_trays_is_a_leader_worker_set_of_one_pod_per_tray(tmp_path: Path) -> None:
    doc = captured(nvl72_doc((5, 2, 9, 7), tp=16), uuids=False)
    domain, lws = k8s_objects(doc, K8sOptions(gpu_request="device-plugin"))
    assert domain["kind"] == "ComputeDomain" and lws["kind"] == "LeaderWorkerSet"
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 4 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = lwt["leaderTemplate"], lwt["workerTemplate"]
    for tpl, hosts in ((leader, ["nvl72-tray05"]), (worker, ["nvl72-tray02", "nvl72-tray09", "nvl72-tray07"])):
        validate_template(tpl)
        assert tpl["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
        exprs = expressions(tpl)
        assert exprs["kubernetes.io/hostname"]["values"] == hosts
        assert exprs[GPU_CLIQUE] == {"key": GPU_CLIQUE, "operator": "Exists"}
        assert tpl["spec"]["affinity"]["podAntiAffinity"]  # one pod per tray
        # the IMEX channel of the instance's ComputeDomain, beside the device plugin's GPUs
        channel = domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
        assert tpl["spec"]["resourceClaims"] == [{"name": "imex-channel", "resourceClaimTemplateName": channel}]
        assert tpl["spec"]["containers"][0]["resources"]["claims"] == [{"name": "imex-channel"}]
    # The worker pod that lands on tray09 is node rank 2 of 4, headless, on that tray's four GPUs.
    result = run_entrypoint(tmp_path, worker, "nvl72-tray09", NVL72_VISIBLE)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "rec/env").read_text() == "GPU-t0,GPU-t1,GPU-t2,GPU-t3|PCI_BUS_ID\n"
    argv = (tmp_path / "rec/vllm").read_text().splitlines()
    assert argv[argv.index("--tensor-parallel-size") + 1] == "16"
    assert argv[argv.index("--nnodes") + 1] == "4" and argv[argv.index("--node-rank") + 1] == "2"
    assert argv[argv.index("--master-addr") + 1] == "grp-0.grp.default" and "--headless" in argv
    sglang = k8s_objects(
        doc, K8sOptions(engine="sglang", image="registry.invalid/sglang:pinned", gpu_request="device-plugin")
    )[1]
    script = script_of(sglang["spec"]["leaderWorkerTemplate"]["workerTemplate"])
    assert '--nnodes 4 --node-rank 2 --dist-init-addr "$LWS_LEADER_ADDRESS:20000"' in script


def test_tp_over_nvl72_trays_with_dra_one_claim_per_template() -> None:
    """The trays are identical, so the workers' one claim names the same four bus ids on each tray (exact)."""
    out = render_objects(captured(nvl72_doc((5, 2, 9, 7), tp=16), uuids=False))
    assert out.gpu_request == "dra"
    assert not any("differ between" in w or "RDMA" in w for w in out.warnings)  # one NVLink clique: no RDMA needed
    # multi-node NVLink needs an IMEX channel in the pods: the instance's ComputeDomain, no warning any more
    assert not any("IMEX" in w for w in out.warnings)
    leader, worker, domain, lws = out.objects
    assert domain["kind"] == "ComputeDomain"
    for claim in (leader, worker):
        validate(claim)
        exprs = [
            r["exactly"]["selectors"][0]["cel"]["expression"] for r in claim["spec"]["spec"]["devices"]["requests"]
        ]
        assert exprs == [
            f'device.attributes["resource.kubernetes.io"].pciBusID == "0000:{b}:00.0"' for b in (18, 28, 38, 48)
        ]
    claims = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["resourceClaims"]
    assert [c["resourceClaimTemplateName"] for c in claims] == [
        worker["metadata"]["name"],
        domain["spec"]["channel"]["resourceClaimTemplate"]["name"],
    ]


@pytest.mark.parametrize("name", ["pcie", "two", "multi"])
def test_every_pod_carries_its_exact_placement_id_for_the_extender(plans: dict[str, PlanDoc], name: str) -> None:
    """The label holds a DNS name made from the id ('toposched-plan-0'); the extender needs the id itself."""
    from toposched.service.extender import Pod, pod_placement

    doc = plans[name]
    seen = set()
    for obj in k8s_objects(doc):
        if obj["kind"] not in ("Deployment", "LeaderWorkerSet"):
            continue
        for template in templates(obj):
            wanted = pod_placement(Pod.model_validate(template))
            assert wanted in {p.id for p in doc.placements}
            seen.add(wanted)
    assert seen == {p.id for p in doc.placements}


def test_an_unpinned_pod_on_part_of_a_node_runs_without_the_plans_numa_binding(
    plans: dict[str, PlanDoc], tmp_path: Path
) -> None:
    """A preset has no real GPU ids: the device plugin picks the pod's 4 of 8 GPUs, maybe on the other socket,
    so binding the pod to the planned NUMA node could put it on the wrong one. Pinned (bus ids), it keeps it."""
    (dep,) = k8s_objects(plans["pcie"], K8sOptions(gpu_request="device-plugin"))
    script = script_of(dep["spec"]["template"])
    assert "numactl" not in script and "exec vllm serve" in script
    result = run_entrypoint(tmp_path, dep["spec"]["template"], "l40s", L40S_VISIBLE)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "rec/numactl").exists() and (tmp_path / "rec/vllm").exists()
    (pinned,) = k8s_objects(captured(plans["pcie"], uuids=False), K8sOptions(gpu_request="device-plugin"))
    assert "exec numactl --cpunodebind=0 --membind=0 vllm serve" in script_of(pinned["spec"]["template"])


def test_long_placement_ids_name_distinct_objects_and_a_clash_is_refused(plans: dict[str, PlanDoc]) -> None:
    doc = plans["two"]
    long = "llama-3-1-8b-chat-production-tenant-acme-us-east-1-blue"  # the first 52 characters are shared
    renamed = tuple(
        p.model_copy(update={"id": f"{long}-{n}", "request_id": long}) for n, p in enumerate(doc.placements)
    )
    objects = k8s_objects(PlanDoc(renamed, doc.request, doc.cluster))
    names = [o["metadata"]["name"] for o in objects]
    assert len(set(names)) == 2 and all(len(n) <= 52 and re.fullmatch(r"[a-z0-9-]+-[0-9a-f]{8}", n) for n in names)
    clash = tuple(p.model_copy(update={"id": f"a{n}"}) for n, p in enumerate(doc.placements))
    opts = K8sOptions(name_prefix="x" * 60)  # both names are cut before the ids differ: the hash tells them apart
    assert len({o["metadata"]["name"] for o in k8s_objects(PlanDoc(clash, doc.request, doc.cluster), opts)}) == 2
    from toposched.binding.k8s import K8sOutput

    with pytest.raises(InputError, match="would both be named 'same'"):
        K8sOutput([{"kind": "Deployment", "metadata": {"name": "same"}}] * 2, [], "dra")


def test_an_upper_case_node_name_is_refused_before_any_object_is_made(plans: dict[str, PlanDoc]) -> None:
    """Issue 36: a plan on node ``GPU-A`` gave pods pinned to a name no Kubernetes node can carry (the kubelet
    registers lower-case hostnames): Pending for ever. Now one line naming the node and the fix."""
    doc = plans["pcie"]
    (p, *_rest) = doc.placements
    old = p.ranks[0].node
    renamed = p.model_copy(update={"ranks": tuple(r.model_copy(update={"node": "GPU-A"}) for r in p.ranks)})
    nodes = tuple(n.model_copy(update={"name": "GPU-A"}) if n.name == old else n for n in doc.cluster.nodes)
    upper = PlanDoc((renamed, *_rest), doc.request, doc.cluster.model_copy(update={"nodes": nodes}))
    with pytest.raises(InputError, match=r"node 'GPU-A' cannot be a Kubernetes node name") as err:
        k8s_objects(upper)
    assert "'gpu-a'" in (err.value.fix or "")
    assert k8s_objects(doc)  # the same plan on its lower-case node renders
