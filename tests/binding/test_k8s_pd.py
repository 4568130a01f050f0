"""The RoleBasedGroup of a prefill/decode disaggregated plan: schemas, pinning, rack affinity, router, quoting."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from checks.engines.static_checks import object_problems

from tests.binding.k8s_views import command_script, render_objects, render_pd, render_roles, script_of
from tests.binding.test_k8s import expressions, run_entrypoint
from tests.binding.test_k8s_dra import captured, with_fabric
from tests.conftest import RunCli
from toposched.binding import k8s_pd
from toposched.binding.engines import build_launches
from toposched.binding.k8s_affinity import HOSTNAME
from toposched.binding.k8s_dra import gpu_ids
from toposched.binding.k8s_entrypoint import unpinned_argv
from toposched.binding.k8s_options import K8sOptions
from toposched.binding.k8s_pd import DEFAULT_RDMA_RESOURCE
from toposched.binding.node_launch import NodeLaunch
from toposched.binding.plan_doc import PlanDoc, load_plan
from toposched.errors import InputError

IMAGE = "lmsysorg/sglang:v0.5.23"
SGLANG = K8sOptions(engine="sglang", image=IMAGE)
RACK = "toposched.io/rack"
RDMA = DEFAULT_RDMA_RESOURCE
PD_ARGS = {
    # 4 prefill + 8 decode TP=4 instances of a 70B model fill two racks of the 256-GPU preset: two stores.
    "two-racks": ["--pd-prefill", "4", "--pd-decode", "8", "--kv-store", "mooncake"],
    "no-store": ["--pd-prefill", "1", "--pd-decode", "2"],
}


@pytest.fixture(scope="module")
def pd_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from toposched.cli.main import main

    out = tmp_path_factory.mktemp("pd")
    files = {}
    for name, args in PD_ARGS.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            main(["plan", "-m", "llama-3.1-70b", "--preset", "cluster-32x-hgx-h100", *args, "--json"])
        files[name] = out / f"{name}.json"
        files[name].write_text(buf.getvalue())
    return files


@pytest.fixture(scope="module")
def pd(pd_files: dict[str, Path]) -> dict[str, PlanDoc]:
    return {name: load_plan(path) for name, path in pd_files.items()}


def probed(doc: PlanDoc) -> PlanDoc:
    """The disaggregated plan as if its nodes had been probed live (real UUIDs: DRA claims)."""
    return dataclasses.replace(captured(doc), disaggregation=doc.disaggregation, stores=doc.stores)


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def roles_of(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (rbg,) = of_kind(objects, "RoleBasedGroup")
    return {r["name"]: r for r in rbg["spec"]["roles"]}


def template(role: dict[str, Any]) -> dict[str, Any]:
    return role["standalonePattern"]["template"]  # type: ignore[no-any-return]


def exec_argv(role: dict[str, Any]) -> list[str]:
    """The command the pod execs, as the shell splits it (the kubelet's ``$$`` undone)."""
    (line,) = [x.strip() for x in script_of(template(role)).splitlines() if x.strip().startswith("exec ")]
    return shlex.split(line)[1:]


def launches(doc: PlanDoc, model_path: str | None = None, *, stores: bool = False) -> list[NodeLaunch]:
    return build_launches(
        doc.placements, doc.request, doc.cluster, "sglang", model_path=model_path, disaggregation=doc.disaggregation,
        stores=doc.stores if stores else (),
    )  # fmt: skip


@pytest.mark.parametrize("pinned", [False, True], ids=["device-plugin", "dra"])
@pytest.mark.parametrize("name", list(PD_ARGS))
def test_every_object_validates(pd: dict[str, PlanDoc], name: str, pinned: bool) -> None:
    doc = probed(pd[name]) if pinned else pd[name]
    out = render_pd(doc, "pd", SGLANG)
    assert out.gpu_request == ("dra" if pinned else "device-plugin")
    kinds = [o["kind"] for o in out.objects]
    assert kinds.count("RoleBasedGroup") == 1
    assert kinds.count("ResourceClaimTemplate") == (len(doc.placements) if pinned else 0)
    assert kinds.count("Service") == len(doc.placements) + len(doc.stores) + 1  # instances, stores, the router
    assert kinds.count("CoordinatedPolicy") == (1 if doc.stores else 0)
    for obj in out.objects:
        assert object_problems(obj) == [], obj["kind"]


def test_the_crd_schema_refuses_what_rbg_does_not_have(pd: dict[str, PlanDoc]) -> None:
    objects = render_pd(pd["two-racks"], "pd", SGLANG).objects
    (rbg,) = copy.deepcopy(of_kind(objects, "RoleBasedGroup"))
    rbg["spec"]["roles"][0]["topologyAwarePlacement"] = True  # engines.md section 10: not a real field
    assert object_problems(rbg)
    (policy,) = copy.deepcopy(of_kind(objects, "CoordinatedPolicy"))
    policy["spec"]["policies"][0]["strategy"]["rollingUpdate"]["maxSurge"] = 1
    assert object_problems(policy)


def test_each_instance_runs_its_planned_command_on_its_planned_node(pd: dict[str, PlanDoc]) -> None:
    doc = pd["two-racks"]
    roles = roles_of(render_pd(doc, "pd", SGLANG).objects)
    by_placement = {x.placement: x for x in launches(doc, stores=True)}
    assert sorted(roles) == sorted(
        [*(f"prefill-{i}" for i in range(4)), *(f"decode-{i}" for i in range(8)), "store-0", "store-1", "router"]
    )
    for p in doc.placements:
        role = roles[f"{p.role}-{p.id.rsplit('-', 1)[1]}"]
        launch = by_placement[p.id]
        pod = template(role)
        assert pod["metadata"]["annotations"]["toposched.io/placement"] == p.id
        assert expressions(pod)[HOSTNAME]["values"] == [p.ranks[0].node]
        got, flag = exec_argv(role), "--hicache-storage-backend-extra-config"
        # a preset has no real GPU ids: a pod on part of a node runs without the plan's numactl
        planned = unpinned_argv(doc, launch, gpu_ids(doc.cluster.node(launch.node), launch.gpus, frozenset()))
        assert planned[0] != "numactl" and launch.argv[0] == "numactl"
        assert flag in planned  # the plan has stores: HiCache with the rack's store
        at = planned.index(flag) + 1  # the store's address is its Service's (the next test)
        assert got[:at] == planned[:at] and got[at + 1 :] == planned[at + 1 :]
        assert pod["metadata"]["annotations"]["toposched.io/kv-nics"] == ",".join(p.kv_nics)
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == str(len(p.ranks)) and limits[DEFAULT_RDMA_RESOURCE] == "1"
        assert pod["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    stores = [x for x in launches(doc, stores=True) if x.role == "store"]
    for i, store in enumerate(doc.stores):
        pod = template(roles[f"store-{i}"])
        assert expressions(pod)[HOSTNAME]["values"] == [store.node]
        assert expressions(pod)[RACK]["values"] == [store.rack]
        service, master = pod["spec"]["containers"]
        assert "nvidia.com/gpu" not in service["resources"]["limits"] and service["resources"]["limits"][RDMA] == "1"
        # the commands of launch sglang's store scripts: the store service here, its master beside it
        assert exec_argv(roles[f"store-{i}"]) == stores[2 * i + 1].argv
        (line,) = [x for x in command_script(master).splitlines() if x.startswith("exec ")]
        assert shlex.split(line)[1:] == stores[2 * i].argv
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in service["env"]}
        assert env["MOONCAKE_MASTER"] == f"toposched-pd-store-{i}.default.svc:50051"
        assert env["MOONCAKE_LOCAL_HOSTNAME"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["MOONCAKE_DEVICE"] == ",".join(store.nics)


def test_decode_shares_a_rack_with_its_store(pd: dict[str, PlanDoc]) -> None:
    doc = pd["two-racks"]
    roles = roles_of(render_pd(doc, "pd", SGLANG).objects)
    store_labels = {name: template(r)["metadata"]["labels"] for name, r in roles.items() if name.startswith("store")}
    rack_of = {n.name: n.rack for n in doc.cluster.nodes}
    racks_used = set()
    for p in doc.placements:
        if p.role != "decode":
            continue
        role = roles[f"decode-{p.id.rsplit('-', 1)[1]}"]
        (term,) = template(role)["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == RACK
        (store,) = [
            n for n, labels in store_labels.items() if term["labelSelector"]["matchLabels"].items() <= labels.items()
        ]
        assert role["dependencies"] == [store]  # RBG creates the decode pod after its store
        store_node = expressions(template(roles[store]))[HOSTNAME]["values"][0]
        assert rack_of[store_node] == rack_of[p.ranks[0].node]
        racks_used.add(rack_of[store_node])
    assert len(racks_used) == 2  # the case covers two racks, each with its own store


def test_a_node_without_a_rack_is_its_own_rack(pd: dict[str, PlanDoc]) -> None:
    doc = pd["two-racks"]
    nodes = tuple(n.model_copy(update={"rack": None}) for n in doc.cluster.nodes)
    stores = tuple(s.model_copy(update={"rack": None}) for s in doc.stores)
    flat = dataclasses.replace(doc, cluster=doc.cluster.model_copy(update={"nodes": nodes}), stores=stores)
    # with no racks every decode needs a store on its own node; this plan's stores are on two nodes only
    with pytest.raises(InputError, match="no KV-cache store in the rack of decode node"):
        render_pd(flat, "pd", SGLANG)
    decode_nodes = {p.ranks[0].node for p in doc.placements if p.role == "decode"}
    own = tuple(stores[0].model_copy(update={"node": n}) for n in sorted(decode_nodes))
    roles = roles_of(render_pd(dataclasses.replace(flat, stores=own), "pd", SGLANG).objects)
    for name, role in roles.items():
        if name.startswith("decode"):
            (term,) = template(role)["spec"]["affinity"]["podAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]
            assert term["topologyKey"] == HOSTNAME


def test_the_router_reaches_every_instance_through_its_service(pd: dict[str, PlanDoc]) -> None:
    doc = pd["two-racks"]
    objects = render_pd(doc, "pd", dataclasses.replace(SGLANG, namespace="llm")).objects
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
    roles = roles_of(objects)
    argv = exec_argv(roles["router"])
    planned = launches(doc)[-1].argv
    assert len(argv) == len(planned)
    for got, want in zip(argv, planned, strict=True):
        if not want.startswith("http://"):
            assert got == want
            continue
        host, port = got.removeprefix("http://").rsplit(":", 1)
        name, namespace, svc = host.split(".")
        assert (namespace, svc) == ("llm", "svc")
        ports = {p["name"]: p["port"] for p in services[name]["spec"]["ports"]}
        assert ports["http"] == int(port) == int(want.rsplit(":", 1)[1])
        # the Service selects exactly the pod of the instance the plan's URL names
        selected = [
            r
            for r in roles.values()
            if services[name]["spec"]["selector"].items() <= template(r)["metadata"]["labels"].items()
        ]
        (role,) = selected
        assert expressions(template(role))[HOSTNAME]["values"] == [want.removeprefix("http://").rsplit(":", 1)[0]]
        if "bootstrap" in ports:  # a prefill URL is followed by its bootstrap port
            assert str(ports["bootstrap"]) == argv[argv.index(got) + 1]


def test_instances_reach_their_store_through_its_service(pd: dict[str, PlanDoc]) -> None:
    doc = pd["two-racks"]
    objects = render_pd(doc, "pd", dataclasses.replace(SGLANG, namespace="llm")).objects
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
    roles = roles_of(objects)
    planned = {  # as the pods run them (a preset: no real GPU ids, no numactl on part of a node)
        (x.placement, x.node): unpinned_argv(doc, x, gpu_ids(doc.cluster.node(x.node), x.gpus))
        for x in launches(doc, stores=True)
    }
    flag = "--hicache-storage-backend-extra-config"
    for p in doc.placements:
        role = roles[f"{p.role}-{p.id.rsplit('-', 1)[1]}"]
        got, want = exec_argv(role), planned[(p.id, p.ranks[0].node)]
        config, plain = json.loads(got[got.index(flag) + 1]), json.loads(want[want.index(flag) + 1])
        assert got[: got.index(flag)] == want[: want.index(flag)]  # all else is build_launches' command
        host, port = config.pop("master_server_address").rsplit(":", 1)
        name, namespace, svc = host.split(".")
        assert (namespace, svc) == ("llm", "svc") and name.startswith("toposched-pd-store")
        assert {q["name"]: q["port"] for q in services[name]["spec"]["ports"]}["rpc"] == int(port)
        store_node = expressions(template(roles[name.removeprefix("toposched-pd-")]))[HOSTNAME]["values"][0]
        assert plain.pop("master_server_address") == f"{store_node}:{port}" and config == plain
        env = template(role)["spec"]["containers"][0]["env"]
        assert {"name": "MOONCAKE_LOCAL_HOSTNAME", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env
    (rbg,) = of_kind(objects, "RoleBasedGroup")  # the pods with their HiCache flags still fit the CRD schema
    assert object_problems(rbg) == []


def test_prefill_and_store_roll_out_together(pd: dict[str, PlanDoc]) -> None:
    objects = render_pd(pd["two-racks"], "pd", SGLANG).objects
    (policy,) = of_kind(objects, "CoordinatedPolicy")
    (rule,) = policy["spec"]["policies"]
    assert rule["roles"] == ["prefill-0", "prefill-1", "prefill-2", "prefill-3", "store-0", "store-1"]
    assert rule["strategy"]["rollingUpdate"]["maxSkew"] == "0%"
    assert not of_kind(render_pd(pd["no-store"], "pd", SGLANG).objects, "CoordinatedPolicy")


def test_rdma_resource_from_the_option_else_the_fabric(pd: dict[str, PlanDoc]) -> None:
    doc = with_fabric(pd["no-store"], rdma_resource="rdma/ib")
    doc = dataclasses.replace(doc, disaggregation=pd["no-store"].disaggregation)
    for opts, want in (
        (SGLANG, "rdma/ib"),
        (dataclasses.replace(SGLANG, rdma_resource="nvidia.com/hostdev"), "nvidia.com/hostdev"),
    ):
        roles = roles_of(render_pd(doc, "pd", opts).objects)
        limits = template(roles["decode-0"])["spec"]["containers"][0]["resources"]["limits"]
        assert limits[want] == "1" and DEFAULT_RDMA_RESOURCE not in limits
    with pytest.raises(InputError, match="not a Kubernetes extended resource name"):
        K8sOptions(rdma_resource="rdma ib")


def test_host_network_from_the_fabric_for_every_pod_that_moves_kv(pd: dict[str, PlanDoc]) -> None:
    plan = pd["two-racks"]
    doc = dataclasses.replace(
        with_fabric(plan, host_network=True), disaggregation=plan.disaggregation, stores=plan.stores
    )
    for name, role in roles_of(render_pd(doc, "pd", SGLANG).objects).items():
        spec = template(role)["spec"]
        assert spec.get("hostNetwork", False) == (name != "router"), name
    assert not any(
        "hostNetwork" in template(r)["spec"] for r in roles_of(render_pd(plan, "pd", SGLANG).objects).values()
    )


def test_guaranteed_qos_only_with_cpu_and_memory(pd: dict[str, PlanDoc]) -> None:
    assert any("not Guaranteed QoS" in w for w in render_pd(pd["no-store"], "pd", SGLANG).warnings)
    out = render_pd(pd["no-store"], "pd", dataclasses.replace(SGLANG, cpu="16", memory="200Gi"))
    assert not any("Guaranteed" in w for w in out.warnings)
    for role in roles_of(out.objects).values():
        resources = template(role)["spec"]["containers"][0]["resources"]
        assert resources["limits"] == resources["requests"] and resources["limits"]["memory"] == "200Gi"


def test_refusals(pd: dict[str, PlanDoc]) -> None:
    with pytest.raises(InputError, match="SGLang only"):
        render_pd(pd["no-store"], "pd", K8sOptions(engine="vllm"))
    with pytest.raises(InputError, match="one RoleBasedGroup"):
        render_objects(pd["no-store"], SGLANG)
    with pytest.raises(InputError, match="one RoleBasedGroup"):
        render_roles({"prefill": pd["no-store"]}, "pd", SGLANG)
    plain = dataclasses.replace(pd["no-store"], disaggregation=None, stores=())
    with pytest.raises(InputError, match="not a prefill/decode disaggregated plan"):
        render_pd(plain, "pd", SGLANG)


FAKE_PYTHON = """#!/bin/sh
printf '%s\\n' "$@" > "$REC/python3"
"""


def test_a_hostile_model_path_stays_one_quoted_argument(pd: dict[str, PlanDoc], tmp_path: Path) -> None:
    evil = "/models/my model $(touch PWNED1) `touch PWNED2` $(HOME) $HOME; touch PWNED3 'q\""
    doc = pd["no-store"]
    opts = dataclasses.replace(SGLANG, model_path=evil)
    objects = render_pd(doc, "pd", opts).objects
    text = yaml.dump_all(objects, Dumper=yaml.SafeDumper, sort_keys=False)
    assert list(yaml.safe_load_all(text)) == objects  # the serialiser round-trips it
    role = roles_of(objects)["prefill"]
    prefill = next(x for x in launches(doc, evil) if x.role == "prefill")
    assert exec_argv(role) == unpinned_argv(doc, prefill, gpu_ids(doc.cluster.node(prefill.node), prefill.gpus))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/python3").write_text(FAKE_PYTHON)
    (tmp_path / "bin/python3").chmod(0o755)
    result = run_entrypoint(tmp_path, template(role), doc.placements[0].ranks[0].node, ["00000000:AF:00.0, GPU-x"] * 4)
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob("PWNED*"))
    recorded = (tmp_path / "rec/python3").read_text().splitlines()
    assert recorded[recorded.index("--model-path") + 1] == evil


def test_launch_k8s_emits_the_group(run_cli: RunCli, pd_files: dict[str, Path]) -> None:
    plan = str(pd_files["two-racks"])
    result = run_cli("launch", "k8s", "--plan", plan, "--engine", "sglang", "--image", IMAGE, "--group", "llama")
    assert result.exit_code == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    assert objects == k8s_pd.render_pd(load_plan(plan), "llama", SGLANG).objects  # the ConfigMap first
    assert objects[0]["kind"] == "ConfigMap"
    assert "not Guaranteed QoS" in result.stderr
    as_json = run_cli("launch", "k8s", "--plan", plan, "--engine", "sglang", "--image", IMAGE, "--group", "llama",
                      "--format", "json")  # fmt: skip
    assert json.loads(as_json.stdout)["items"] == objects
    refused = run_cli("launch", "k8s", "--plan", plan, "--image", IMAGE)  # --engine vllm by default
    assert refused.exit_code != 0 and "pass --engine sglang" in refused.stderr and "Traceback" not in refused.stderr
    bad = run_cli("launch", "k8s", "--plan", plan, "--engine", "sglang", "--image", IMAGE, "--rdma-resource", "x y")
    assert bad.exit_code != 0 and "--rdma-resource" in bad.stderr


# --- instances over several nodes: RBG's leaderWorkerPattern ---------------------------------------

# A 405B model at TP8 x PP2: the prefill and the decode instance each span two HGX nodes; one store.
MULTI_NODE_ARGS = ["-m", "llama-3.1-405b", "--preset", "cluster-32x-hgx-h100", "--slo-tpot-ms", "60"]
MULTI_NODE_ARGS += ["--pd-prefill", "1", "--pd-decode", "1", "--kv-store", "mooncake"]


@pytest.fixture(scope="module")
def multi_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from toposched.cli.main import main

    path = tmp_path_factory.mktemp("pd-multi") / "405b.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main(["plan", *MULTI_NODE_ARGS, "--json"])
    path.write_text(buf.getvalue())
    return path


@pytest.fixture(scope="module")
def multi(multi_file: Path) -> PlanDoc:
    doc = load_plan(multi_file)
    assert all(len({r.node for r in p.ranks}) == 2 for p in doc.placements), "the case needs two-node instances"
    return doc


def merge_patch(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (maps merge, anything else is replaced): how a template patch applies."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def lw_templates(role: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The leader's and the workers' pod templates of a leader/worker role, patches applied."""
    lw = role["leaderWorkerPattern"]
    return merge_patch(lw["template"], lw["leaderTemplatePatch"]), merge_patch(
        lw["template"], lw["workerTemplatePatch"]
    )


def planned_argv(launch: NodeLaunch, store: str, leader: str) -> list[str]:
    """``build_launches``' argv with the two addresses a pod cannot use rewritten: the store's master and the
    rendezvous at their Services (both as launch sglang writes them otherwise)."""
    argv = list(launch.argv)
    flag = "--hicache-storage-backend-extra-config"
    config = json.loads(argv[argv.index(flag) + 1])
    config["master_server_address"] = f"{store}:{config['master_server_address'].rsplit(':', 1)[1]}"
    argv[argv.index(flag) + 1] = json.dumps(config, separators=(",", ":"))
    at = argv.index("--dist-init-addr") + 1
    argv[at] = f"{leader}:{argv[at].rsplit(':', 1)[1]}"
    return argv


@pytest.mark.parametrize("pinned", [False, True], ids=["device-plugin", "dra"])
def test_a_multi_node_instance_is_a_leader_worker_role_pinned_node_by_node(multi: PlanDoc, pinned: bool) -> None:
    doc = probed(multi) if pinned else multi
    out = render_pd(doc, "pd", SGLANG)
    for obj in out.objects:
        assert object_problems(obj) == [], obj["kind"]
    assert not any("request no RDMA device" in w for w in out.warnings)  # every pod here asks for one
    roles = roles_of(out.objects)
    claims = {c["metadata"]["name"]: c for c in of_kind(out.objects, "ResourceClaimTemplate")}
    assert len(claims) == (2 * len(doc.placements) if pinned else 0)
    for p in doc.placements:
        role = roles[str(p.role)]
        assert "standalonePattern" not in role
        lw = role["leaderWorkerPattern"]
        nodes = list(dict.fromkeys(r.node for r in p.ranks))
        assert lw["size"] == len(nodes) == 2 and lw["restartPolicy"] == "RecreateRoleInstanceOnPodRestart"
        leader, worker = lw_templates(role)
        for pod in (leader, worker):  # what the pods are made from: kubernetes-validate's core schemas
            assert object_problems({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                    "template": pod}) == []  # fmt: skip
            (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert term["topologyKey"] == HOSTNAME  # two pods of the instance never share a node
            assert pod["spec"]["containers"][0]["resources"]["limits"][RDMA] == "1"
        assert expressions(leader)[HOSTNAME]["values"] == nodes[:1]
        assert expressions(worker)[HOSTNAME]["values"] == nodes[1:]
        rack = {n.name: n.rack for n in doc.cluster.nodes}
        assert expressions(leader)[RACK]["values"] == [rack[nodes[0]]]
        assert leader["metadata"]["labels"]["toposched.io/leader"] == "true"
        assert "toposched.io/leader" not in worker["metadata"]["labels"]
        if pinned:  # each side claims its own node's planned GPUs
            for pod, node in ((leader, nodes[0]), (worker, nodes[1])):
                (ref,) = pod["spec"]["resourceClaims"]
                claim = claims[ref["resourceClaimTemplateName"]]
                uuids = {g.uuid for g in doc.cluster.node(node).gpus if g.index in {r.gpu for r in p.ranks}}
                selectors = " ".join(
                    s["cel"]["expression"] for r in claim["spec"]["spec"]["devices"]["requests"]
                    for s in r["exactly"]["selectors"]
                )  # fmt: skip
                assert all(str(u) in selectors for u in uuids)
        if p.role == "decode":  # the store's rack, for the leader (and here the worker: same rack)
            for pod in (leader, worker):
                (term,) = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                assert term["topologyKey"] == RACK


def test_each_pod_of_a_multi_node_instance_runs_its_nodes_planned_command(multi: PlanDoc, tmp_path: Path) -> None:
    objects = render_pd(multi, "pd", dataclasses.replace(SGLANG, namespace="llm")).objects
    roles = roles_of(objects)
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/python3").write_text(FAKE_PYTHON)
    (tmp_path / "bin/python3").chmod(0o755)
    store = "toposched-pd-store.llm.svc"
    for launch in launches(multi, stores=True):
        if launch.role not in ("prefill", "decode"):
            continue
        role = roles[launch.role]
        leader, worker = lw_templates(role)
        pod = leader if launch.node_rank == 0 else worker
        assert launch.node in expressions(pod)[HOSTNAME]["values"]
        script = script_of(pod)
        subprocess.run(["sh", "-n"], input=script, text=True, check=True)
        checked = subprocess.run(["shellcheck", "--shell=sh", "--norc", "-"], input=script, capture_output=True,
                                 text=True, check=False)  # fmt: skip
        assert checked.returncode == 0, checked.stdout
        result = run_entrypoint(tmp_path, pod, launch.node, ["00000000:AF:00.0, GPU-x"] * 8)
        assert result.returncode == 0, result.stderr
        recorded = (tmp_path / "rec/python3").read_text().splitlines()
        want = planned_argv(launch, store, f"toposched-pd-{launch.role}.llm.svc")
        assert recorded == want[want.index("python3") + 1 :]
        assert recorded[recorded.index("--node-rank") + 1] == str(launch.node_rank)
        # the rendezvous names the instance's headless Service, which selects the leader pod only
        service = services[f"toposched-pd-{launch.role}"]["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
        assert service["selector"].items() <= leader["metadata"]["labels"].items()
        assert not service["selector"].items() <= worker["metadata"]["labels"].items()
        assert {q["name"]: q["port"] for q in service["ports"]}["rendezvous"] == launch.dist_port


def test_the_router_reaches_a_multi_node_instance_at_its_leader(multi: PlanDoc) -> None:
    objects = render_pd(multi, "pd", SGLANG).objects
    argv = exec_argv(roles_of(objects)["router"])
    planned = launches(multi)[-1].argv
    heads = {f"http://{x.node}:{x.port}": x for x in launches(multi) if x.node_rank == 0 and x.role != "router"}
    urls = [a for a in planned if a.startswith("http://")]
    assert sorted(urls) == sorted(heads) and len(urls) == 2
    for url in urls:
        got = argv[planned.index(url)]
        assert got == f"http://toposched-pd-{heads[url].role}.default.svc:{heads[url].port}"
