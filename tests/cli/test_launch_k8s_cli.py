"""``toposched launch k8s | k8s-lint | ray``."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import yaml

from tests.binding.conftest import DATA
from tests.binding.test_k8s_dra import real_node
from tests.conftest import RunCli

MULTI = ["--preset", "cluster-32x-hgx-h100", "--model", "llama-3.1-405b", "--slo-tpot-ms", "60"]


def _plan(run_cli: RunCli, tmp_path: Path, *args: str, name: str = "plan.json") -> Path:
    result = run_cli("plan", *args, "--json")
    assert result.exit_code == 0, result.stderr
    path = tmp_path / name
    path.write_text(result.stdout)
    return path


def test_k8s_plan_prints_yaml_documents(run_cli: RunCli, tmp_path: Path) -> None:
    plan = _plan(run_cli, tmp_path, "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--tp", "4", "--replicas", "2")
    result = run_cli("launch", "k8s", "--plan", str(plan))
    assert result.exit_code == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Deployment", "Deployment"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.37", strict=True)
    # each pod runs its entrypoint from the plan's ConfigMap, readable as it runs (no $$ escaping)
    files = docs[0]["data"]
    for dep in docs[1:]:
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        script = files[container["command"][1].removeprefix("/opt/toposched/entrypoint/")]
        assert script.startswith("set -eu\n") and "$$" not in script and "exec vllm serve" in script
    assert "&id" not in result.stdout  # no YAML anchors
    # a preset's bus ids are invented: the device plugin is used, and stderr says why
    assert "warning: GPU pinning needs a captured or live topology: node hgx-h100: made from a preset" in result.stderr


def test_k8s_from_plan_options_multi_node_json(run_cli: RunCli) -> None:
    result = run_cli("launch", "k8s", *MULTI, "--format", "json", "--namespace", "llm", "--image", "reg/vllm:v0.33.0")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["apiVersion"], data["kind"]) == ("v1", "List")
    configmap, lws = data["items"]
    assert configmap["kind"] == "ConfigMap" and configmap["metadata"]["namespace"] == "llm"
    assert lws["kind"] == "LeaderWorkerSet" and lws["metadata"]["namespace"] == "llm"
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert leader["spec"]["containers"][0]["image"] == "reg/vllm:v0.33.0"


def test_k8s_kubelet_and_roles(run_cli: RunCli, tmp_path: Path) -> None:
    pcie = _plan(run_cli, tmp_path, "--preset", "l40s-8x-pcie", "--model", "llama-3.1-8b", "--tp", "4", name="p.json")
    result = run_cli("launch", "k8s", "--plan", str(pcie), "--kubelet", "--topology-policy", "restricted")
    assert result.exit_code == 0, result.stderr
    (item,) = yaml.safe_load_all(result.stdout)
    cfg = item["config"]
    assert item["nodes"] == ["l40s"]
    assert item["reason"] == "--topology-policy restricted as asked (auto would choose single-numa-node)"
    assert cfg["kind"] == "KubeletConfiguration" and cfg["topologyManagerPolicy"] == "restricted"
    as_json = run_cli(
        "launch", "k8s", "--plan", str(pcie), "--kubelet", "--topology-policy", "restricted", "--format", "json"
    )
    assert json.loads(as_json.stdout)["kubelet_configs"] == [item]  # YAML and JSON carry the same objects
    assert not [line for line in result.stdout.splitlines() if line.lstrip().startswith("#")]
    result = run_cli("launch", "k8s", "--roles", f"prefill={pcie},decode={pcie}", "--group", "pd")
    assert result.exit_code == 0, result.stderr
    configmap, rbg, policy = yaml.safe_load_all(result.stdout)
    assert sorted(configmap["data"]) == ["toposched-pd-decode.sh", "toposched-pd-prefill.sh"]
    assert [r["name"] for r in rbg["spec"]["roles"]] == ["prefill", "decode"]
    assert policy["spec"]["policies"][0]["roles"] == ["prefill", "decode"]


def test_k8s_kubelet_policy_from_the_plan(run_cli: RunCli) -> None:
    result = run_cli("launch", "k8s", *MULTI, "--kubelet", "--format", "json")
    assert result.exit_code == 0, result.stderr
    (item,) = json.loads(result.stdout)["kubelet_configs"]  # TP8 pods span both sockets of each node
    assert item["config"]["topologyManagerPolicy"] == "best-effort" and "NUMA nodes 0,1" in item["reason"]
    refused = run_cli("launch", "k8s", *MULTI, "--kubelet", "--topology-policy", "single-numa-node")
    assert refused.exit_code == 2 and refused.stdout == ""
    assert refused.stderr.startswith("error: --topology-policy single-numa-node: the kubelet of node h100-0")


def test_k8s_dra_from_a_saved_probe(run_cli: RunCli, tmp_path: Path) -> None:
    """A cluster spec node from a saved NVML probe has real ids: the plan is pinned through DRA claims."""
    (tmp_path / "probe.json").write_text(real_node().model_dump_json())
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"nodes": [{"name": "gpu-0", "probe": "probe.json"}]}))
    plan = _plan(
        run_cli, tmp_path, "--cluster", str(tmp_path / "cluster.yaml"), "--model", "llama-3.1-8b-instruct", "--tp", "2"
    )
    result = run_cli("launch", "k8s", "--plan", str(plan))
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""  # no warning (and no base-checkpoint note: the chat model is launched)
    configmap, claim, dep = yaml.safe_load_all(result.stdout)
    kubernetes_validate.validate(configmap, "1.37", strict=True)
    for version in ("1.34", "1.37"):
        kubernetes_validate.validate(claim, version, strict=True)
    kubernetes_validate.validate(dep, "1.37", strict=True)
    assert claim["kind"] == "ResourceClaimTemplate" and dep["kind"] == "Deployment"
    ref = dep["spec"]["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    assert ref == claim["metadata"]["name"]
    plugin = run_cli("launch", "k8s", "--plan", str(plan), "--gpu-request", "device-plugin", "--format", "json")
    _configmap, only = json.loads(plugin.stdout)["items"]
    assert only["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert plugin.stderr == ""  # both GPUs of the node: the device plugin has no choice to make


def test_k8s_bad_input_is_one_line(run_cli: RunCli, tmp_path: Path) -> None:
    result = run_cli("launch", "k8s", *MULTI, "--format", "sh")
    assert result.exit_code == 2 and "--format 'sh'" in result.stderr
    result = run_cli("launch", "k8s", *MULTI, "--gpu-request", "exact")
    assert result.exit_code == 2 and "--gpu-request 'exact' is not one of auto, dra, device-plugin" in result.stderr
    result = run_cli("launch", "k8s", *MULTI, "--gpu-request", "dra")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines()[0].startswith("error: --gpu-request dra cannot pin the GPUs of nodes h100-0")
    assert "captured or live topology" in result.stderr.splitlines()[0]
    result = run_cli("launch", "k8s", "--roles", "prefill")
    assert result.exit_code == 2 and "ROLE=PLAN.json" in result.stderr
    result = run_cli("launch", "k8s", *MULTI, "--engine", "sglang")
    assert result.exit_code == 2 and "--image" in result.stderr


def test_k8s_lint_reports_and_fails(run_cli: RunCli, tmp_path: Path) -> None:
    plan = _plan(run_cli, tmp_path, *MULTI)
    nodes = DATA / "nodes-h100.json"
    result = run_cli("launch", "k8s-lint", "--nodes", str(nodes), "--plan", str(plan), "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert data["findings"] == [{"placement": "plan", "node": "h100-01", "problem": "no label nvidia.com/gpu.product"}]
    table = run_cli("launch", "k8s-lint", "--nodes", str(nodes), "--plan", str(plan))
    assert table.exit_code == 1 and "h100-01" in table.stdout and "nvidia.com/gpu.product" in table.stdout
    fixed = json.loads(nodes.read_text())
    fixed["items"][1]["metadata"]["labels"]["nvidia.com/gpu.product"] = "NVIDIA-H100-80GB-HBM3"
    good = tmp_path / "nodes.json"
    good.write_text(json.dumps(fixed))
    ok = run_cli("launch", "k8s-lint", "--nodes", str(good), "--plan", str(plan))
    assert ok.exit_code == 0 and ok.stdout.startswith("ok:")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert run_cli("launch", "k8s-lint", "--nodes", str(bad), "--plan", str(plan)).exit_code == 2


def test_ray_command(run_cli: RunCli) -> None:
    result = run_cli("launch", "ray", *MULTI)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    (pg,) = data["placement_groups"]
    assert pg["strategy"] == "PACK" and len(pg["bundles"]) == 16
    assert set(data["ray_start"]) == {"h100-00", "h100-01"}
    as_yaml = run_cli("launch", "ray", *MULTI, "--format", "yaml")
    assert as_yaml.exit_code == 0 and yaml.safe_load(as_yaml.stdout) == data
