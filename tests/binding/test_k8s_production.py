"""Pods an operator applies as they are (issue 36): probes on the health route, the Hugging Face token, a model
cache, the entrypoint as a file of the plan's ConfigMap, Kubernetes node names, vLLM's online FP8."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest

from tests.binding.builders import nvl72_doc
from tests.binding.test_k8s import K8S_VERSION, templates
from tests.binding.test_k8s_dra import captured
from toposched.binding import k8s as real
from toposched.binding.k8s_configmap import ANNOTATION_SHA, ENTRYPOINT_DIR, script_of
from toposched.binding.k8s_dra import ANNOTATION_DRIVER
from toposched.binding.k8s_options import MODEL_CACHE_DIR, K8sOptions
from toposched.binding.k8s_pod import HEALTH_PATH
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError

Obj = dict[str, Any]


def _engine(template: Obj) -> Obj:
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == "engine"]
    return container


def _env(container: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_serving_pod_has_startup_readiness_and_liveness_probes_and_workers_none(plans: dict[str, PlanDoc]) -> None:
    (dep,) = [o for o in real.k8s_objects(plans["pcie"]) if o["kind"] == "Deployment"]
    engine = _engine(dep["spec"]["template"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"] == {"path": HEALTH_PATH, "port": "http"}
    # weights load before anything else is asked: an hour of startup, then the other two take over
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] >= 3600
    assert engine["livenessProbe"]["periodSeconds"] * engine["livenessProbe"]["failureThreshold"] >= 120
    (lws,) = [o for o in real.k8s_objects(plans["multi"]) if o["kind"] == "LeaderWorkerSet"]
    leader, worker = templates(lws)
    assert "readinessProbe" in _engine(leader) and not {"startupProbe", "readinessProbe", "livenessProbe"} & set(
        _engine(worker)
    )  # a worker serves no HTTP: a probe would restart it for ever


def test_the_hf_token_is_an_optional_secret_by_default_and_required_when_named(plans: dict[str, PlanDoc]) -> None:
    def token(opts: K8sOptions) -> Obj:
        (dep,) = [o for o in real.k8s_objects(plans["pcie"], opts) if o["kind"] == "Deployment"]
        return _env(_engine(dep["spec"]["template"]))["HF_TOKEN"]["secretKeyRef"]

    assert token(K8sOptions()) == {"name": "hf-token", "key": "token", "optional": True}  # public models start
    assert token(K8sOptions(hf_token_secret="llama-access")) == {"name": "llama-access", "key": "token"}
    assert token(K8sOptions(hf_token_secret="llama-access:HF_TOKEN")) == {"name": "llama-access", "key": "HF_TOKEN"}
    for bad in ("Llama", "a:b c", "x/y", ""):
        with pytest.raises(InputError, match="--hf-token-secret"):
            K8sOptions(hf_token_secret=bad)


@pytest.mark.parametrize(
    ("spec", "volume"),
    [
        ("pvc:llm-weights", {"name": "model-cache", "persistentVolumeClaim": {"claimName": "llm-weights"}}),
        ("host:/data/hf", {"name": "model-cache", "hostPath": {"path": "/data/hf", "type": "DirectoryOrCreate"}}),
    ],
)
def test_the_model_cache_is_mounted_where_the_engine_caches_weights(
    plans: dict[str, PlanDoc], spec: str, volume: Obj
) -> None:
    objects = real.k8s_objects(plans["multi"], K8sOptions(model_cache=spec))
    (lws,) = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    for template in templates(lws):  # every node loads its own shard of the weights
        engine = _engine(template)
        assert volume in template["spec"]["volumes"]
        assert {"name": "model-cache", "mountPath": MODEL_CACHE_DIR} in engine["volumeMounts"]
        assert _env(engine)["HF_HOME"] == MODEL_CACHE_DIR
    for template in templates(lws):  # the pod spec with the new volume, as the API server checks it
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
            K8S_VERSION,
            strict=True,
        )
    bare = real.k8s_objects(plans["pcie"])
    assert all("HF_HOME" not in _env(_engine(t)) for o in bare if o["kind"] == "Deployment" for t in templates(o))
    for bad in ("pvc:Weights", "host:relative/path", "host:/", "host:/a/../etc", "s3://bucket", "pvc:"):
        with pytest.raises(InputError, match="--model-cache"):
            K8sOptions(model_cache=bad)


def test_entrypoints_are_files_of_one_configmap_readable_and_shellcheck_clean(plans: dict[str, PlanDoc]) -> None:
    objects = real.k8s_objects(captured(plans["multi"], uuids=False), K8sOptions(gpu_request="device-plugin"))
    configmap, lws = objects
    assert configmap["kind"] == "ConfigMap" and lws["kind"] == "LeaderWorkerSet"
    kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)
    assert len(configmap["data"]) == 2  # the leader's and the workers' scripts
    checker = shutil.which("shellcheck")
    for template in templates(lws):
        engine = _engine(template)
        (path,) = engine["command"][1:]
        assert engine["command"][0] == "/bin/sh" and path.startswith(ENTRYPOINT_DIR + "/")
        assert {"name": "toposched-entrypoint", "mountPath": ENTRYPOINT_DIR, "readOnly": True} in engine["volumeMounts"]
        script = script_of(objects, template)
        assert "$$" not in script and "vllm serve" in script and script == configmap["data"][path.split("/")[-1]]
        subprocess.run(["sh", "-n"], input=script, text=True, check=True)
        if checker:
            checked = subprocess.run([checker, "--shell=sh", "--norc", "-"], input=script, capture_output=True,
                                     text=True, check=False)  # fmt: skip
            assert checked.returncode == 0, checked.stdout
        assert len(template["metadata"]["annotations"][ANNOTATION_SHA]) == 64


def test_a_changed_script_rolls_the_pods(plans: dict[str, PlanDoc]) -> None:
    """A ConfigMap change alone restarts nothing: the pod template carries the script's hash."""

    def sha(opts: K8sOptions) -> str:
        (dep,) = [o for o in real.k8s_objects(plans["pcie"], opts) if o["kind"] == "Deployment"]
        return str(dep["spec"]["template"]["metadata"]["annotations"][ANNOTATION_SHA])

    assert sha(K8sOptions()) == sha(K8sOptions())
    assert sha(K8sOptions()) != sha(K8sOptions(model_path="/models/llama"))


def test_a_gb200_tp8_across_two_trays_gets_one_compute_domain_valid_against_its_crd() -> None:
    """Issue 36: TP=8 over two trays of an NVL72: one ComputeDomain, both pods claim its IMEX channel beside
    their GPU claims, and the objects pass the CRD's schema (vendored from the NVIDIA DRA driver)."""
    from checks.engines.static_checks import object_problems

    doc = captured(nvl72_doc((3, 11), tp=8))
    out = real.render_objects(doc)
    kinds = [o["kind"] for o in out.objects]
    assert kinds == ["ConfigMap", "ResourceClaimTemplate", "ResourceClaimTemplate", "ComputeDomain", "LeaderWorkerSet"]
    domain, lws = out.objects[3], out.objects[4]
    assert domain["spec"] == {
        "numNodes": 0,
        "channel": {"resourceClaimTemplate": {"name": "toposched-plan-0-imex-channel"}},
    }
    for obj in out.objects:
        assert object_problems(obj) == [], obj["kind"]
    for template in templates(lws):
        names = [c["resourceClaimTemplateName"] for c in template["spec"]["resourceClaims"]]
        assert names[-1] == "toposched-plan-0-imex-channel" and len(names) == 2  # GPUs, then the channel
        assert {"name": "imex-channel"} in _engine(template)["resources"]["claims"]
    invented = {**domain, "spec": {**domain["spec"], "imexChannels": 1}}
    assert object_problems(invented)  # the CRD's schema refuses a field it does not have
    single = real.render_objects(captured(nvl72_doc((3,), tp=4)))
    assert "ComputeDomain" not in [o["kind"] for o in single.objects]  # one tray: NVLink inside it, no IMEX


def test_claims_follow_the_dra_driver_release_of_the_cluster(plans: dict[str, PlanDoc]) -> None:
    """Before v25.12.0 the driver publishes no resource.kubernetes.io/pciBusID: GPUs with NVML UUIDs are still
    pinned (every release publishes ``uuid``), bus ids alone are not; each claim names the oldest release."""
    by_uuid = captured(plans["pcie"])
    by_bus = captured(plans["pcie"], uuids=False)

    def claim(doc: PlanDoc, version: str) -> Obj:
        out = real.render_objects(doc, K8sOptions(dra_driver_version=version))
        (found,) = [o for o in out.objects if o["kind"] == "ResourceClaimTemplate"]
        return found

    new = claim(by_bus, "25.12.0")
    assert new["metadata"]["annotations"][ANNOTATION_DRIVER] == "25.12.0"
    assert "pciBusID" in str(new["spec"])
    old_uuid = claim(by_uuid, "v25.8.1")
    assert old_uuid["metadata"]["annotations"][ANNOTATION_DRIVER] == "25.3.2"
    assert "uuid" in str(old_uuid["spec"]) and "pcieRoot" not in str(old_uuid["spec"])
    old = real.render_objects(by_bus, K8sOptions(dra_driver_version="25.8.1"))
    assert old.gpu_request == "device-plugin" and "before v25.12.0" in old.warnings[0]
    with pytest.raises(InputError, match=r"before v25\.12\.0"):
        real.render_objects(by_bus, K8sOptions(dra_driver_version="25.8.1", gpu_request="dra"))
    for bad in ("latest", "25", "25.12.0-rc1", ""):
        with pytest.raises(InputError, match="--dra-driver-version"):
            K8sOptions(dra_driver_version=bad)


def test_pods_request_their_numa_share_of_cpus_unless_told(plans: dict[str, PlanDoc]) -> None:
    """Two TP=4 replicas on an HGX H100 (GPUs 0-3 and 4-7, each half's NUMA node has 112 CPUs): each pod
    requests 0.9 x 112 = 100 CPUs (a request only); --cpu/--memory set an equal request and limit instead."""
    deps = [o for o in real.k8s_objects(plans["two"]) if o["kind"] == "Deployment"]
    for dep in deps:
        resources = _engine(dep["spec"]["template"])["resources"]
        assert resources["requests"]["cpu"] == "100" and "cpu" not in resources.get("limits", {})
    (given,) = [
        o for o in real.k8s_objects(plans["pcie"], K8sOptions(cpu="16", memory="64Gi")) if o["kind"] == "Deployment"
    ]
    resources = _engine(given["spec"]["template"])["resources"]
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"] == "16"
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "64Gi"
    bare = PlanDoc(
        plans["pcie"].placements,
        plans["pcie"].request,
        plans["pcie"].cluster.model_copy(
            update={
                "nodes": tuple(
                    n.model_copy(update={"gpus": tuple(g.model_copy(update={"cpu_affinity": None}) for g in n.gpus)})
                    for n in plans["pcie"].cluster.nodes
                )
            }
        ),
    )
    (dep,) = [o for o in real.k8s_objects(bare) if o["kind"] == "Deployment"]
    assert "cpu" not in _engine(dep["spec"]["template"])["resources"].get("requests", {})  # affinity unknown
