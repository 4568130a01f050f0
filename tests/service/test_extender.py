"""Kubernetes scheduler extender endpoints (kube-scheduler's extender JSON) on a real server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
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


GOOD_POD = gpu_pod(1)
MALFORMED: dict[str, Any] = {
    "Pod.spec as a list": {"Pod": {"spec": []}, "NodeNames": [NODE]},
    "containers: [1]": {"Pod": {"spec": {"containers": [1]}}, "NodeNames": [NODE]},
    "Nodes.items: 5": {"Pod": GOOD_POD, "Nodes": {"items": 5}},
    "Nodes.items: [5]": {"Pod": GOOD_POD, "Nodes": {"items": [5]}},
    "node without a name": {"Pod": GOOD_POD, "Nodes": {"items": [{"metadata": {}}]}},
    "NodeNames a string": {"Pod": GOOD_POD, "NodeNames": NODE},
    "NodeNames: [1]": {"Pod": GOOD_POD, "NodeNames": [1]},
    "node name with a newline": {"Pod": GOOD_POD, "NodeNames": ["a\nb"]},
    "node name of 10 kB": {"Pod": GOOD_POD, "NodeNames": ["n" * 10_000]},
    "no Pod": {"NodeNames": [NODE]},
    "Pod a string": {"Pod": "p", "NodeNames": [NODE]},
    "Pod null": {"Pod": None, "NodeNames": [NODE]},
    "metadata a list": {"Pod": {"metadata": [], "spec": {}}, "NodeNames": [NODE]},
    "labels a list": {"Pod": {"metadata": {"labels": ["x"]}}, "NodeNames": [NODE]},
    "label value a number": {"Pod": {"metadata": {"labels": {"toposched.io/placement": 5}}}, "NodeNames": [NODE]},
    "resources a string": {"Pod": {"spec": {"containers": [{"resources": "4"}]}}, "NodeNames": [NODE]},
    "limits a list": {"Pod": {"spec": {"containers": [{"resources": {"limits": [4]}}]}}, "NodeNames": [NODE]},
    "gpus 1.5": {"Pod": {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1.5"}}}]}}},
    "gpus -1": {"Pod": {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": -1}}}]}}},
    "gpus a word": {"Pod": {"spec": {"containers": [{"resources": {"requests": {"nvidia.com/gpu": "many"}}}]}}},
    "gpus 5000 digits": {"Pod": {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "9" * 5000}}}]}}},
    "gpus true": {"Pod": {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": True}}}]}}},
    "a JSON list": [1, 2],
    "a JSON string": "ExtenderArgs",
    "JSON null": None,
}


@pytest.mark.parametrize("args", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_extender_call_gets_error_from_filter_and_422_from_prioritize(
    sqlite_server: Server, args: Any
) -> None:
    filtered = sqlite_server.client.post("/v1/extender/filter", json=args)
    assert filtered.status_code == 200, filtered.text  # kube-scheduler reads Error from a 200
    result = filtered.json()
    assert result["Error"].startswith("malformed ExtenderArgs: "), result
    assert (result["Nodes"], result["NodeNames"], result["FailedNodes"]) == (None, None, {})
    assert len(result["Error"]) < 2000  # no echo of a huge input
    ranked = sqlite_server.client.post("/v1/extender/prioritize", json=args)
    assert ranked.status_code == 422, ranked.text  # non-200: kube-scheduler gives no score from this extender
    assert ranked.json()["error"] == "invalid request"


@pytest.mark.parametrize("body", [b"", b"{", b"\xff\xfe\x00", b'{"Pod": {}, "NodeNames": ["a"]'])
def test_a_body_that_is_not_json_gets_error_too(sqlite_server: Server, body: bytes) -> None:
    filtered = sqlite_server.client.post("/v1/extender/filter", content=body)
    assert filtered.status_code == 200 and filtered.json()["Error"].startswith("malformed ExtenderArgs")
    ranked = sqlite_server.client.post("/v1/extender/prioritize", content=body)
    assert ranked.status_code == 422


def test_the_nodes_form_answers_the_node_objects_it_was_sent(sqlite_server: Server) -> None:
    node = {"metadata": {"name": NODE, "labels": {"zone": "a"}}, "status": {"capacity": {"nvidia.com/gpu": "8"}}}
    args = {"Pod": gpu_pod(2), "Nodes": {"kind": "NodeList", "items": [node, {"metadata": {"name": "x"}}]}}
    result = sqlite_server.client.post("/v1/extender/filter", json=args).json()
    assert result["Error"] == ""
    assert result["Nodes"] == {"kind": "NodeList", "items": [node]}
    assert result["FailedAndUnresolvableNodes"] == {"x": "node is not in toposched's topology"}


def test_gpu_quantities_as_numbers_and_lower_case_keys_are_read(sqlite_server: Server) -> None:
    pod = {"spec": {"containers": [{"resources": {"requests": {"nvidia.com/gpu": 8}}}]}}
    ranked = sqlite_server.client.post("/v1/extender/prioritize", json={"pod": pod, "nodenames": [NODE]})
    assert ranked.json() == [{"Host": NODE, "Score": 10}]  # 8 of 8 free: tightest fit


def test_text_that_is_not_utf8_is_echoed_escaped_not_a_500(sqlite_server: Server) -> None:
    """The filter answer echoes the node objects (and unknown fields) it was sent; a lone surrogate from a
    JSON escape is sent back escaped, as it came, and a placement name is shown the same way."""
    nodes = b'{"Pod": {}, "Nodes": {"items": [{"metadata": {"name": "' + NODE.encode() + b'"}}], "kind": "\\ud800"}}'
    answer = sqlite_server.client.post("/v1/extender/filter", content=nodes)
    assert answer.status_code == 200 and b'"kind":"\\ud800"' in answer.content
    named = b'{"Pod": {"metadata": {"annotations": {"toposched.io/placement": "\\ud800"}}}, "NodeNames": ["x"]}'
    answer = sqlite_server.client.post("/v1/extender/filter", content=named)
    assert answer.status_code == 200 and answer.json()["Error"] == ""
