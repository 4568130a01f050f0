"""Kubernetes scheduler extender endpoints (kube-scheduler's extender JSON) on a real server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.conftest import REPO
from tests.service.conftest import Server, StartServer

NODE = "hgx-h100"


def gpu_pod(gpus: int, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "default", **meta},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
    }


def node_list(*names: str) -> dict[str, Any]:
    return {"kind": "NodeList", "apiVersion": "v1", "items": [{"metadata": {"name": n}} for n in names]}


def test_filter_passes_a_node_with_a_domain_that_fits_and_fails_unknown_nodes(sqlite_server: Server) -> None:
    args = {"Pod": gpu_pod(4), "Nodes": node_list(NODE, "elsewhere"), "NodeNames": None}
    result = sqlite_server.client.post("/v1/extender/filter", json=args).json()
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == [NODE]
    assert "elsewhere" in result["FailedAndUnresolvableNodes"]
    assert result["Error"] == ""


def test_filter_and_prioritize_follow_free_gpus(sqlite_server: Server) -> None:
    held = sqlite_server.client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": "ext", "allowed_tp": [4]})
    assert held.status_code == 201
    try:
        names = {"Pod": gpu_pod(8), "NodeNames": [NODE]}  # nodeCacheCapable form
        result = sqlite_server.client.post("/v1/extender/filter", json=names).json()
        assert result["NodeNames"] == []
        assert "4 free" in result["FailedNodes"][NODE] or "best has 4" in result["FailedNodes"][NODE]
        fits = sqlite_server.client.post("/v1/extender/prioritize", json={"Pod": gpu_pod(4), "NodeNames": [NODE]})
        assert fits.json() == [{"Host": NODE, "Score": 10}]  # 4 asked, 4 free in the domain: tightest fit
        loose = sqlite_server.client.post("/v1/extender/prioritize", json={"Pod": gpu_pod(1), "NodeNames": [NODE]})
        assert loose.json() == [{"Host": NODE, "Score": 2}]  # round(10 * 1 / 4)
    finally:
        sqlite_server.client.delete("/v1/placements/ext")


def test_a_pod_naming_its_placement_goes_where_the_placement_is(sqlite_server: Server) -> None:
    held = sqlite_server.client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": "pinned"})
    assert held.status_code == 201
    try:
        pod = gpu_pod(1, labels={"toposched.io/placement": "pinned"})
        result = sqlite_server.client.post("/v1/extender/filter", json={"Pod": pod, "NodeNames": [NODE, "other"]})
        assert result.json()["NodeNames"] == [NODE]
        assert "no rank on this node" in result.json()["FailedNodes"]["other"]
        ranked = sqlite_server.client.post("/v1/extender/prioritize", json={"Pod": pod, "NodeNames": [NODE, "other"]})
        assert ranked.json() == [{"Host": NODE, "Score": 10}, {"Host": "other", "Score": 0}]
        ghost = gpu_pod(1, annotations={"toposched.io/placement": "ghost"})
        unknown = sqlite_server.client.post("/v1/extender/filter", json={"Pod": ghost, "NodeNames": [NODE]})
        assert unknown.json()["FailedAndUnresolvableNodes"] == {NODE: "toposched has no placement ghost"}
    finally:
        sqlite_server.client.delete("/v1/placements/pinned")


def test_pods_without_gpus_pass_everywhere(sqlite_server: Server) -> None:
    pod = {"metadata": {"name": "web"}, "spec": {"containers": [{"name": "c"}]}}
    result = sqlite_server.client.post("/v1/extender/filter", json={"Pod": pod, "NodeNames": ["a", "b"]}).json()
    assert result["NodeNames"] == ["a", "b"] and result["FailedNodes"] == {}


def test_the_sample_scheduler_configuration_points_at_these_endpoints() -> None:
    config = yaml.safe_load((REPO / "deploy" / "kubernetes" / "kube-scheduler-config.yaml").read_text())
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    (ext,) = config["extenders"]
    assert ext["urlPrefix"].endswith("/v1/extender")
    assert (ext["filterVerb"], ext["prioritizeVerb"]) == ("filter", "prioritize")
    assert ext["managedResources"][0]["name"] == "nvidia.com/gpu"
    assert 1 <= ext["weight"] <= 100


def test_open_extender_serves_kube_scheduler_without_a_token(serve: StartServer, tmp_path: Path) -> None:
    server = serve("--preset", "hgx-h100", "--state", f"sqlite:{tmp_path / 's.db'}", "--open-extender")
    args = {"Pod": gpu_pod(2), "NodeNames": [NODE]}
    assert httpx.post(f"{server.url}/v1/extender/filter", json=args).json()["NodeNames"] == [NODE]
    assert httpx.post(f"{server.url}/v1/extender/prioritize", json=args).status_code == 200
    assert httpx.get(f"{server.url}/v1/placements").status_code == 401
    assert httpx.post(f"{server.url}/v1/placements", json={"model": "llama-3.1-8b"}).status_code == 401
