"""The plan handed to the cluster's scheduler (issue 36): KAI, Kueue and Volcano each get the gang and topology
objects and fields they read, checked against their vendored CRDs; the GPUs stay the plan's."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
from checks.engines.static_checks import object_problems

from tests.binding.builders import nvl72_doc
from tests.binding.test_k8s import templates
from tests.binding.test_k8s_dra import captured
from tests.conftest import RunCli
from toposched.binding import k8s as real
from toposched.binding import k8s_pd
from toposched.binding.k8s_affinity import GPU_CLIQUE, HOSTNAME
from toposched.binding.k8s_options import DEFAULT_RACK_LABEL, K8sOptions
from toposched.binding.plan_doc import PlanDoc, load_plan
from toposched.errors import InputError

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def pd_set(tmp_path_factory: pytest.TempPathFactory) -> PlanDoc:
    """One prefill and two decode TP=4 instances of Llama-3.1-70B on the 256-GPU preset (one rack)."""
    from toposched.cli.main import main

    path = tmp_path_factory.mktemp("sched") / "pd.json"
    buf = io.StringIO()
    args = ["-m", "llama-3.1-70b", "--preset", "cluster-32x-hgx-h100", "--pd-prefill", "1", "--pd-decode", "2"]
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main(["plan", *args, "--json"])
    path.write_text(buf.getvalue())
    return load_plan(path)


def _valid(objects: list[Obj]) -> None:
    for obj in objects:
        assert object_problems(obj) == [], obj["kind"]


def _only(objects: list[Obj], kind: str) -> Obj:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def test_kai_gets_one_pod_group_per_instance_with_the_racks_level(plans: dict[str, PlanDoc]) -> None:
    """TP=8 x PP=2 over two HGX nodes of one rack: a PodGroup of both pods, required to share the rack."""
    doc = plans["multi"]
    racks = {doc.cluster.node(r.node).rack for r in doc.placements[0].ranks}
    assert len(racks) == 1 and len({r.node for r in doc.placements[0].ranks}) == 2
    objects = real.k8s_objects(doc, K8sOptions(scheduler="kai", queue="inference"))
    _valid(objects)
    group, lws = _only(objects, "PodGroup"), _only(objects, "LeaderWorkerSet")
    assert group["apiVersion"] == "scheduling.run.ai/v2alpha2"
    assert group["spec"] == {
        "minMember": 2,  # the whole TP x PP group or nothing
        "queue": "inference",
        "topologyConstraint": {"topology": "cluster-topology", "requiredTopologyLevel": DEFAULT_RACK_LABEL},
    }
    for template in templates(lws):
        assert template["spec"]["schedulerName"] == "kai-scheduler"
        assert template["metadata"]["labels"]["kai.scheduler/queue"] == "inference"
        assert template["metadata"]["annotations"]["pod-group-name"] == group["metadata"]["name"]
        # the plan's GPUs stay pinned: node affinity on the planned hosts
        terms = template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        hosts = {e["key"]: e for e in terms["nodeSelectorTerms"][0]["matchExpressions"]}[HOSTNAME]["values"]
        assert set(hosts) <= {r.node for r in doc.placements[0].ranks}


def test_volcano_gets_a_pod_group_with_a_hard_network_topology(plans: dict[str, PlanDoc]) -> None:
    objects = real.k8s_objects(plans["multi"], K8sOptions(scheduler="volcano"))
    _valid(objects)
    group, lws = _only(objects, "PodGroup"), _only(objects, "LeaderWorkerSet")
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["spec"] == {
        "minMember": 2,
        "queue": "default",
        "networkTopology": {"mode": "hard", "highestTierAllowed": 1},
    }
    for template in templates(lws):
        assert template["spec"]["schedulerName"] == "volcano"
        assert template["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == group["metadata"]["name"]
    one_node = real.k8s_objects(plans["two"], K8sOptions(scheduler="volcano"))
    groups = [o for o in one_node if o["kind"] == "PodGroup"]
    assert len(groups) == 2 and all("networkTopology" not in g["spec"] for g in groups)  # one node each
    assert all(g["spec"]["minMember"] == 1 for g in groups)


def test_kueue_gets_the_queue_label_and_one_podset_group_per_leader_worker_set(plans: dict[str, PlanDoc]) -> None:
    objects = real.k8s_objects(plans["multi"], K8sOptions(scheduler="kueue", queue="tas-user-queue"))
    _valid(objects)
    assert not [o for o in objects if o["kind"] == "PodGroup"]
    lws = _only(objects, "LeaderWorkerSet")
    assert lws["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tas-user-queue"
    leader, worker = templates(lws)
    for template in (leader, worker):
        annotations = template["metadata"]["annotations"]
        assert annotations["kueue.x-k8s.io/podset-required-topology"] == DEFAULT_RACK_LABEL
        assert "schedulerName" not in template["spec"]  # Kueue admits; kube-scheduler places
    assert (
        leader["metadata"]["annotations"]["kueue.x-k8s.io/podset-group-name"]
        == worker["metadata"]["annotations"]["kueue.x-k8s.io/podset-group-name"]
    )  # leader and workers fitted into one rack together
    (dep, _other) = [
        o for o in real.k8s_objects(plans["two"], K8sOptions(scheduler="kueue")) if o["kind"] == "Deployment"
    ]
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["kueue.x-k8s.io/podset-required-topology"] == HOSTNAME
    assert "kueue.x-k8s.io/podset-group-name" not in annotations


def test_a_prefill_decode_set_is_one_gang(pd_set: PlanDoc) -> None:
    """Prefill, decode, router (and stores) are admitted together or not at all."""
    out = k8s_pd.render_pd(
        pd_set, "llama", K8sOptions(engine="sglang", image="lmsysorg/sglang:v0.5.23", scheduler="kai")
    )
    _valid(out.objects)
    group, rbg = _only(out.objects, "PodGroup"), _only(out.objects, "RoleBasedGroup")
    pods = sum(
        role.get("replicas", 1) * (role["leaderWorkerPattern"]["size"] if "leaderWorkerPattern" in role else 1)
        for role in rbg["spec"]["roles"]
    )
    assert group["spec"]["minMember"] == pods >= 4  # 1 prefill + 2 decode + the router
    for role in rbg["spec"]["roles"]:
        pattern = role.get("standalonePattern") or role["leaderWorkerPattern"]
        assert pattern["template"]["metadata"]["annotations"]["pod-group-name"] == group["metadata"]["name"]
    with pytest.raises(InputError, match="Kueue has no RoleBasedGroup integration"):
        k8s_pd.render_pd(pd_set, "llama", K8sOptions(engine="sglang", image="x/sglang:1", scheduler="kueue"))


def test_a_tp_group_across_gb200_trays_is_held_to_its_nvlink_clique() -> None:
    doc = captured(nvl72_doc((3, 11), tp=8))
    objects = real.k8s_objects(doc, K8sOptions(scheduler="kai"))
    _valid(objects)
    assert _only(objects, "PodGroup")["spec"]["topologyConstraint"]["requiredTopologyLevel"] == GPU_CLIQUE
    assert _only(objects, "ComputeDomain")  # and the IMEX channel, as without a scheduler


def test_scheduler_options_are_checked(run_cli: RunCli, plan_files: dict[str, Path]) -> None:
    for bad, match in (
        ({"scheduler": "yunikorn"}, "--scheduler"),
        ({"queue": "Inference"}, "--queue"),
        ({"scheduler_topology": "a b"}, "--scheduler-topology"),
    ):
        with pytest.raises(InputError, match=match):
            K8sOptions(**bad)  # type: ignore[arg-type]
    result = run_cli("launch", "k8s", "--plan", str(plan_files["multi"]), "--scheduler", "slurm")
    assert result.exit_code == 2 and result.stderr.startswith("error: --scheduler 'slurm' is not one of")
    ok = run_cli("launch", "k8s", "--plan", str(plan_files["multi"]), "--scheduler", "volcano", "--queue", "llm")
    assert ok.exit_code == 0 and "kind: PodGroup" in ok.stdout and "queue: llm" in ok.stdout


def test_the_documented_samples_are_valid_against_their_crds() -> None:
    """docs/kubernetes.md's scheduler and ComputeDomain examples (the objects with an apiVersion), as applied."""
    import re

    import yaml
    from checks.engines.crd_schemas import SCHEMAS

    text = (Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md").read_text()
    section = text[text.index("### GB200: a ComputeDomain") : text.index("## Metrics and alerts")]
    checked = 0
    for block in re.findall(r"```yaml\n(.*?)```", section, re.S):
        for obj in yaml.safe_load_all(block):
            if isinstance(obj, dict) and (obj.get("apiVersion"), obj.get("kind")) in SCHEMAS:
                assert object_problems(obj) == [], obj["kind"]
                checked += 1
    assert checked == 6  # ComputeDomain, KAI PodGroup and Topology, Kueue Topology and ResourceFlavor, Volcano PodGroup
