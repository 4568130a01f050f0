"""deploy/kubernetes/: what an operator applies to run toposched, rendered and checked like a cluster would.

Each kustomization is rendered with ``kubectl kustomize`` (kustomize is built into kubectl); built-in kinds
are validated with kubernetes-validate (its newest schemas, strict); the Prometheus Operator objects are
checked against field lists written from prometheus-operator v0.80's ``monitoring.coreos.com/v1`` CRDs
(the CRD schemas themselves are not available offline). The containers' args are run through the real
``toposched`` CLI with the volumes and environment they would get in the pod, and the trial overlay is
started for real: its etcd with the manifest's flags and ``toposched serve`` with the Deployment's args,
probed on the manifest's probe paths and scraped the way the ServiceMonitor scrapes.

``python -m tests.deploy.test_manifests`` rewrites deploy/kubernetes/base/prometheusrule.yaml from
deploy/prometheus/toposched-rules.yml (a test fails while they differ).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from tests.conftest import REPO, RunCli
from tests.ledger.conftest import free_port
from toposched.binding.k8s import k8s_objects
from toposched.binding.plan_doc import load_plan
from toposched.service.metrics import SIGNAL_NAMES
from toposched.topology.sources import load_source

Obj = dict[str, Any]

K8S = REPO / "deploy" / "kubernetes"
BASE, TRIAL, SIDECAR = K8S / "base", K8S / "trial", K8S / "sidecar"
RULES = REPO / "deploy" / "prometheus" / "toposched-rules.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
K8S_VERSION = kubernetes_validate.utils.latest_version()
TOKEN = "manifest-test-token-0123456789"
REPORT_TOKEN = "manifest-report-token-0123456789"
READ_TOKEN = "manifest-read-token-0123456789"
SECRETS = {
    "toposched-api-token": {"token": TOKEN},
    "toposched-report-token": {"token": REPORT_TOKEN},
    "toposched-read-token": {"token": READ_TOKEN},
}
"""The Secrets the operator creates (never in the repository), with stand-in values."""
IMAGE = "registry.example.invalid/toposched:0.1.0"
SIDECAR_NAME = "toposched-sidecar"
PLACEMENT_ANNOTATION = "toposched.io/placement"

# --- rendering ---------------------------------------------------------------------------------------


def kustomize(path: Path) -> list[Obj]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not installed (its built-in kustomize renders deploy/kubernetes/): "
            "`apt-get install -y kubectl` from the Kubernetes or Google Cloud apt repository",
            pytrace=False,
        )
    done = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def base() -> list[Obj]:
    return kustomize(BASE)


@pytest.fixture(scope="module")
def trial() -> list[Obj]:
    return kustomize(TRIAL)


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} objects"
    return found[0]


def pod_templates(obj: Obj) -> list[Obj]:
    spec = obj.get("spec") or {}
    if "template" in spec:
        return [spec["template"]]
    if "leaderWorkerTemplate" in spec:
        lwt = spec["leaderWorkerTemplate"]
        return [lwt[k] for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    return []


def ours(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(pod template, container) for every container this repository defines (not the engines')."""
    for obj in objects:
        for template in pod_templates(obj):
            for container in template["spec"]["containers"]:
                if container["name"] in ("toposched", SIDECAR_NAME, "etcd"):
                    yield template, container


# --- Prometheus Operator CRDs ------------------------------------------------------------------------

# Durations as the CRDs' OpenAPI patterns have them (monitoring.coreos.com/v1, prometheus-operator v0.80).
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"


@dataclass(frozen=True)
class Fields:
    """A CRD object's allowed and required keys; ``nested`` checks a dict value or each item of a list."""

    allowed: frozenset[str]
    required: frozenset[str] = frozenset()
    nested: Mapping[str, Fields] = field(default_factory=dict)
    patterns: Mapping[str, str] = field(default_factory=dict)
    choices: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def problems(self, value: Any, where: str) -> list[str]:
        if not isinstance(value, dict):
            return [f"{where}: not a mapping"]
        found = [f"{where}.{k}: unknown field" for k in sorted(set(value) - self.allowed)]
        found += [f"{where}.{k}: required" for k in sorted(self.required - set(value))]
        for key, pattern in self.patterns.items():
            if key in value and not re.match(pattern, str(value[key])):
                found.append(f"{where}.{key}: {value[key]!r} does not match {pattern}")
        for key, options in self.choices.items():
            if key in value and value[key] not in options:
                found.append(f"{where}.{key}: {value[key]!r} is not one of {sorted(options)}")
        for key, sub in self.nested.items():
            if key in value:
                items = value[key] if isinstance(value[key], list) else [value[key]]
                for i, item in enumerate(items):
                    found += sub.problems(
                        item, f"{where}.{key}[{i}]" if isinstance(value[key], list) else where + "." + key
                    )
        return found


def _f(*names: str) -> frozenset[str]:
    return frozenset(names)


SELECTOR = Fields(_f("matchLabels", "matchExpressions"))
AUTHORIZATION = Fields(
    _f("type", "credentials"), nested={"credentials": Fields(_f("name", "key", "optional"), _f("key"))}
)
_ENDPOINT = {
    "authorization", "basicAuth", "bearerTokenSecret", "enableHttp2", "filterRunning", "followRedirects",
    "honorLabels", "honorTimestamps", "interval", "metricRelabelings", "oauth2", "params", "path", "port",
    "proxyUrl", "relabelings", "scheme", "scrapeTimeout", "targetPort", "tlsConfig", "trackTimestampsStaleness",
}  # fmt: skip
_ENDPOINT_CHECKS: dict[str, Any] = {
    "nested": {"authorization": AUTHORIZATION},
    "patterns": {"interval": DURATION, "scrapeTimeout": DURATION},
    "choices": {"scheme": _f("http", "https")},
}
_MONITOR_SPEC = {
    "attachMetadata", "bodySizeLimit", "fallbackScrapeProtocol", "jobLabel", "keepDroppedTargets", "labelLimit",
    "labelNameLengthLimit", "labelValueLengthLimit", "namespaceSelector", "nativeHistogramBucketLimit",
    "nativeHistogramMinBucketFactor", "podTargetLabels", "sampleLimit", "scrapeClass", "scrapeClassicHistograms",
    "scrapeProtocols", "selector", "selectorMechanism", "targetLimit",
}  # fmt: skip
RULE = Fields(
    _f("alert", "annotations", "expr", "for", "keep_firing_for", "labels", "record"),
    _f("expr"),
    patterns={"for": DURATION, "keep_firing_for": DURATION},
)
CRD_SPECS: dict[str, Fields] = {
    "ServiceMonitor": Fields(
        frozenset(_MONITOR_SPEC | {"endpoints", "targetLabels"}),
        _f("endpoints", "selector"),
        nested={
            "selector": SELECTOR,
            "endpoints": Fields(frozenset(_ENDPOINT | {"bearerTokenFile"}), **_ENDPOINT_CHECKS),
        },
    ),
    "PodMonitor": Fields(
        frozenset(_MONITOR_SPEC | {"podMetricsEndpoints"}),
        _f("selector"),
        nested={
            "selector": SELECTOR,
            "podMetricsEndpoints": Fields(frozenset(_ENDPOINT | {"portNumber"}), **_ENDPOINT_CHECKS),
        },
    ),
    "PrometheusRule": Fields(
        _f("groups"),
        nested={
            "groups": Fields(
                _f("interval", "labels", "limit", "name", "partial_response_strategy", "query_offset", "rules"),
                _f("name"),
                nested={"rules": RULE},
                patterns={"interval": DURATION},
            )
        },
    ),
}
METADATA = Fields(_f("name", "namespace", "labels", "annotations"), _f("name"))


def validate(obj: Obj) -> list[str]:
    """Problems of one rendered object: kubernetes-validate (strict) or the CRD field lists."""
    kind = obj.get("kind", "?")
    if kind in CRD_SPECS:
        where = f"{kind}/{obj.get('metadata', {}).get('name')}"
        found = [f"{where}.{k}: unknown field" for k in sorted(set(obj) - {"apiVersion", "kind", "metadata", "spec"})]
        if obj.get("apiVersion") != "monitoring.coreos.com/v1":
            found.append(f"{where}.apiVersion: {obj.get('apiVersion')!r} is not monitoring.coreos.com/v1")
        found += METADATA.problems(obj.get("metadata"), where + ".metadata")
        found += CRD_SPECS[kind].problems(obj.get("spec"), where + ".spec")
        for i, rule in enumerate(r for g in obj["spec"].get("groups", []) for r in g.get("rules", [])):
            if ("alert" in rule) == ("record" in rule):
                found.append(f"{where}: rule {i} must have exactly one of alert and record")
        return found
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{kind}/{obj['metadata'].get('name')}: {exc.message} at {'.'.join(map(str, exc.path))}"]
    return []


# --- running a container's args ----------------------------------------------------------------------


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion in args (``$$`` escapes); an unknown name is left as it is."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


@dataclass
class Pod:
    """What a container sees in a pod: its environment and its volumes, laid out under ``root``."""

    objects: list[Obj]
    template: Obj
    container: Obj
    root: Path
    name: str = "toposched-7d9f-abcde"
    node: str = "gpu-node-00"

    def config_map(self, name: str) -> dict[str, str]:
        data: dict[str, str] = one(self.objects, "ConfigMap", name)["data"]
        return data

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for var in self.container.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                annotation = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)
                if annotation:
                    env[var["name"]] = self.template["metadata"].get("annotations", {}).get(annotation[1], "")
                else:
                    env[var["name"]] = {"metadata.name": self.name, "spec.nodeName": self.node}[path]
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                env[var["name"]] = self.config_map(ref["name"])[ref["key"]]
            else:
                ref = source["secretKeyRef"]
                env[var["name"]] = SECRETS[ref["name"]][ref["key"]]
        return env

    def mounts(self) -> dict[str, Path]:
        """mountPath -> a folder holding what the volume would hold."""
        volumes = {v["name"]: v for v in self.template["spec"].get("volumes", [])}
        found: dict[str, Path] = {}
        for mount in self.container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            folder = self.root / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            if "secret" in volume:
                data = SECRETS[volume["secret"]["secretName"]]
                items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
            elif "configMap" in volume:
                data = self.config_map(volume["configMap"]["name"])
                items = volume["configMap"].get("items") or [{"key": k, "path": k} for k in data]
            else:
                assert "emptyDir" in volume, volume
                items = []
            for item in items:
                (folder / item["path"]).write_text(data[item["key"]])
            found[mount["mountPath"]] = folder
        return found

    def argv(self) -> list[str]:
        """The container's args as the kubelet passes them, with mounted paths moved under ``root``."""
        assert "command" not in self.container, "the image's ENTRYPOINT (toposched) runs the args"
        env, mounts = self.env(), self.mounts()
        args = [expand(a, env) for a in self.container["args"]]
        assert not [a for a in args if "$(" in a], f"unresolved variables in {args}"
        return [self._local(a, mounts) for a in args]

    @staticmethod
    def _local(arg: str, mounts: Mapping[str, Path]) -> str:
        flag, eq, value = arg.rpartition("=") if arg.startswith("--") else ("", "", arg)
        for path in sorted(mounts, key=len, reverse=True):  # the deepest mount holds the file
            if value.startswith(path.rstrip("/") + "/"):
                return f"{flag}{eq}{mounts[path]}/{value[len(path.rstrip('/')) + 1 :]}"
        return arg


def node_of(template: Obj) -> str:
    """The node a pinned engine pod lands on: the first ``kubernetes.io/hostname`` value of its affinity."""
    terms = template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    hosts = [
        e["values"][0]
        for t in terms["nodeSelectorTerms"]
        for e in t["matchExpressions"]
        if e["key"] == "kubernetes.io/hostname"
    ]
    return str(hosts[0])


# --- the PrometheusRule ------------------------------------------------------------------------------


def prometheus_rule() -> Obj:
    """The PrometheusRule that carries deploy/prometheus/toposched-rules.yml's groups."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "toposched", "labels": {"app.kubernetes.io/name": "toposched"}},
        "spec": {"groups": groups},
    }


RULE_HEADER = """\
# GENERATED from deploy/prometheus/toposched-rules.yml: edit that file, then run
#   .venv/bin/python -m tests.deploy.test_manifests
# The Prometheus must select this object (its ruleSelector, e.g. `release: NAME` for kube-prometheus-stack).
"""


def write_prometheus_rule() -> None:
    text = yaml.safe_dump(prometheus_rule(), sort_keys=False, width=200, allow_unicode=True)
    (BASE / "prometheusrule.yaml").write_text(RULE_HEADER + text)


# --- tests: files and schemas ------------------------------------------------------------------------


def test_every_file_is_in_its_kustomization_and_every_entry_exists() -> None:
    assert sorted(p.name for p in K8S.iterdir()) == ["base", "kube-scheduler-config.yaml", "sidecar", "trial"]
    for folder in (BASE, TRIAL, SIDECAR):
        k = yaml.safe_load((folder / "kustomization.yaml").read_text())
        named = list(k.get("resources", [])) + [p["path"] for p in k.get("patches", [])]
        named += [f for g in k.get("configMapGenerator", []) for f in g.get("files", [])]
        files = [n for n in named if not (folder / n).is_dir()]
        assert len(files) == len(set(files)), f"{folder.name}: listed twice"
        present = sorted(p.name for p in folder.iterdir() if p.name != "kustomization.yaml")
        assert sorted(files) == present, f"{folder.name}: listed {sorted(files)}, present {present}"
        for name in files:
            assert all(doc for doc in yaml.safe_load_all((folder / name).read_text())), f"{name}: an empty document"


def test_rendered_objects_validate(base: list[Obj], trial: list[Obj]) -> None:
    kinds = {o["kind"] for o in trial}
    assert kinds == {
        "Namespace", "ServiceAccount", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
        "NetworkPolicy", "ServiceMonitor", "PrometheusRule", "StatefulSet",
    }  # fmt: skip
    assert not [o for o in base + trial if o["kind"] in ("Secret", "Role", "ClusterRole", "RoleBinding")]
    assert {o["metadata"].get("namespace") for o in trial if o["kind"] != "Namespace"} == {"toposched"}
    problems = [p for o in base + trial for p in validate(o)]
    assert problems == []


def test_the_checks_refuse_what_a_cluster_would_refuse(base: list[Obj]) -> None:
    deployment = copy.deepcopy(one(base, "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    assert validate(deployment) and "livenesProbe" in validate(deployment)[0]
    monitor = copy.deepcopy(one(base, "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["interval"] = "30 seconds"
    monitor["spec"]["endpoints"][0]["bearerToken"] = "x"
    assert len(validate(monitor)) == 2
    rule = copy.deepcopy(one(base, "PrometheusRule"))
    rule["spec"]["groups"][1]["rules"][0]["record"] = "both"
    del rule["spec"]["groups"][0]["name"]
    assert len(validate(rule)) == 2


def test_prometheus_rule_carries_the_rules_file(base: list[Obj]) -> None:
    rendered = one(base, "PrometheusRule")
    assert rendered["spec"]["groups"] == prometheus_rule()["spec"]["groups"], (
        "base/prometheusrule.yaml differs from deploy/prometheus/toposched-rules.yml: "
        "run .venv/bin/python -m tests.deploy.test_manifests"
    )
    assert sum(1 for g in rendered["spec"]["groups"] for r in g["rules"] if "alert" in r) >= 9


# --- tests: how the objects fit together -------------------------------------------------------------


def selects(selector: Obj, labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_objects_refer_to_each_other(trial: list[Obj]) -> None:
    deployment, service = one(trial, "Deployment", "toposched"), one(trial, "Service", "toposched")
    pod = deployment["spec"]["template"]
    labels, spec = pod["metadata"]["labels"], pod["spec"]
    (container,) = spec["containers"]
    assert deployment["spec"]["replicas"] >= 2
    assert selects(deployment["spec"]["selector"], labels) and selects(
        {"matchLabels": service["spec"]["selector"]}, labels
    )
    assert selects(one(trial, "PodDisruptionBudget")["spec"]["selector"], labels)
    assert one(trial, "PodDisruptionBudget")["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    assert spec["serviceAccountName"] == one(trial, "ServiceAccount")["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is False  # toposched reads nothing from the API server
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {container[p]["httpGet"]["port"] for p in ("startupProbe", "livenessProbe", "readinessProbe")} <= set(ports)
    # every ConfigMap the pod reads is rendered (kustomize renamed the references to the hashed names)
    config_maps = {o["metadata"]["name"] for o in trial if o["kind"] == "ConfigMap"}
    used = {v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v}
    used |= {
        e["valueFrom"]["configMapKeyRef"]["name"]
        for e in container["env"]
        if "configMapKeyRef" in e.get("valueFrom", {})
    }
    assert used and used <= config_maps
    # the ServiceMonitor scrapes this Service's port with the Secret the pod reads its token from
    monitor = one(trial, "ServiceMonitor")
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    # ... with the read token (it may only GET), the Secret mounted where --read-token-file reads
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secrets = {v["secret"]["secretName"]: v for v in spec["volumes"] if "secret" in v}
    read = secrets["toposched-read-token"]
    assert endpoint["authorization"]["credentials"] == {
        "name": "toposched-read-token",
        "key": read["secret"]["items"][0]["key"],
    }
    assert f"--read-token-file={mounts[read['name']]}/{read['secret']['items'][0]['path']}" in container["args"]
    # the NetworkPolicies: toposched's pods take Prometheus, the scheduler and clients; etcd only toposched
    for policy in (o for o in trial if o["kind"] == "NetworkPolicy"):
        target = one(trial, "StatefulSet") if "etcd" in policy["metadata"]["name"] else deployment
        target_pod = target["spec"]["template"]
        assert selects(policy["spec"]["podSelector"], target_pod["metadata"]["labels"])
        named = {p["name"] for c in target_pod["spec"]["containers"] for p in c["ports"]}
        assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} <= named
    etcd_policy = one(trial, "NetworkPolicy", "toposched-etcd")
    assert selects(etcd_policy["spec"]["ingress"][0]["from"][0]["podSelector"], labels)


def test_containers_are_locked_down(trial: list[Obj]) -> None:
    seen = list(ours(trial))
    assert {c["name"] for _t, c in seen} == {"toposched", "etcd"}
    for template, container in seen:
        pod_security = template["spec"]["securityContext"]
        assert pod_security["runAsNonRoot"] is True and pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert_locked(container)


def assert_locked(container: Obj) -> None:
    name, security = container["name"], container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False, name
    assert security["readOnlyRootFilesystem"] is True, name
    assert security["runAsNonRoot"] is True, name
    assert security["capabilities"] == {"drop": ["ALL"]}, name
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
    resources = container["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}, name
    # no secret as a literal: tokens come from a file or a secretKeyRef
    for var in container.get("env", []):
        if re.search("TOKEN|PASSWORD|SECRET", var["name"]):
            assert "secretKeyRef" in var.get("valueFrom", {}), f"{name}: {var['name']} is not from a Secret"
    token_files = ("--token-file=", "--report-token-file=", "--read-token-file=")
    assert not [a for a in container.get("args", []) if "token" in a.lower() and not a.startswith(token_files)]


def test_image_matches_the_manifests(base: list[Obj]) -> None:
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    (arg,) = [line for line in lines if line.startswith("ARG PYTHON_IMAGE=")]
    assert arg.split("=", 1)[1].startswith("python:3.11-slim")
    assert [line for line in lines if line.startswith("FROM")] == [
        "FROM ${PYTHON_IMAGE} AS build",
        "FROM ${PYTHON_IMAGE}",
    ]
    (user,) = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert lines[-2:] == ['ENTRYPOINT ["toposched"]', 'CMD ["--help"]']
    copied = [w for line in lines if line.startswith("COPY ") and "--from" not in line for w in line.split()[1:-1]]
    assert copied and all((REPO / c).exists() for c in copied)
    ignore = (REPO / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    assert {line[1:].rstrip("/") for line in ignore if line.startswith("!")} == set(copied)
    pod = one(base, "Deployment")["spec"]["template"]["spec"]
    assert user == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    sidecar = yaml.safe_load((SIDECAR / "deployment-patch.yaml").read_text())[0]["value"]
    assert user == f"{sidecar['securityContext']['runAsUser']}:{sidecar['securityContext']['runAsGroup']}"
    images = {c["image"] for _t, c in ours(base)}
    assert images == {IMAGE}


# --- tests: the args run -----------------------------------------------------------------------------


def test_service_args_run_the_real_cli(
    base: list[Obj], run_cli: RunCli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from toposched.cli import serve as serve_cli

    started: list[Any] = []
    monkeypatch.setattr(serve_cli, "run", lambda config, **_kw: started.append(config))
    monkeypatch.delenv("TOPOSCHED_API_TOKEN", raising=False)
    deployment = one(base, "Deployment")
    template = deployment["spec"]["template"]
    pod = Pod(base, template, template["spec"]["containers"][0], tmp_path)
    argv = pod.argv()
    assert argv[0] == "serve"
    result = run_cli(*argv)
    assert result.exit_code == 0, result.stderr
    (config,) = started
    state = next(o for o in base if o["kind"] == "ConfigMap" and "state" in o["data"])["data"]["state"]
    assert (config.token, config.state, config.replica) == (TOKEN, state, pod.name)
    assert (config.report_token, config.read_token) == (REPORT_TOKEN, READ_TOKEN)
    assert config.state.startswith("etcd:") and config.open_extender is True
    assert (config.host, config.port) == ("0.0.0.0", template["spec"]["containers"][0]["ports"][0]["containerPort"])
    cluster = load_source(config.source).cluster  # the example cluster spec in the ConfigMap loads
    assert len(cluster.nodes) >= 2


def test_trial_overlay_serves_on_its_etcd(trial: list[Obj], tmp_path: Path) -> None:
    """etcd with the StatefulSet's flags, then `toposched serve` with the Deployment's args (loopback only)."""
    etcd_binary = shutil.which("etcd") or "/usr/bin/etcd"
    if not Path(etcd_binary).exists():
        pytest.fail("etcd is not installed: `apt-get install -y etcd-server` (make system-deps)", pytrace=False)
    statefulset = one(trial, "StatefulSet", "toposched-etcd")
    etcd = statefulset["spec"]["template"]["spec"]["containers"][0]
    known = subprocess.run([etcd_binary, "--help"], capture_output=True, text=True, check=False).stdout
    flags = set(re.findall(r"^\s+(--[a-z0-9-]+)", known, re.M))
    assert len(flags) > 50 and [a for a in etcd["args"] if a.split("=")[0] not in flags] == []
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    moves = {"http://0.0.0.0:2379": client, "http://toposched-etcd:2379": client, "http://127.0.0.1:2380": peer}
    moves["/var/lib/etcd/"] = f"{tmp_path}/etcd/"
    etcd_args = [_move(a, moves) for a in etcd["args"]]
    template = one(trial, "Deployment")["spec"]["template"]
    pod = Pod(trial, template, template["spec"]["containers"][0], tmp_path / "pod")
    moves = {"--host=0.0.0.0": "--host=127.0.0.1", "--port=8080": f"--port={free_port()}"}
    moves["http://toposched-etcd:2379"] = client
    argv = [_move(a, moves) for a in pod.argv()]
    assert argv != pod.argv() and "toposched-etcd" not in " ".join(argv)
    port = int(next(a for a in argv if a.startswith("--port="))[7:])
    env = {k: v for k, v in os.environ.items() if k != "TOPOSCHED_API_TOKEN"}
    with _Process([etcd_binary, *etcd_args], tmp_path / "etcd.log", env) as etcd_process:
        _wait(client + etcd["readinessProbe"]["httpGet"]["path"], etcd_process)
        with _Process([sys.executable, "-m", "toposched.cli.main", *argv], tmp_path / "serve.log", env) as server:
            _check_service(f"http://127.0.0.1:{port}", trial, template["spec"]["containers"][0], server)


def _check_service(url: str, trial: list[Obj], container: Obj, server: _Process) -> None:
    """The probes answer, the ServiceMonitor's scrape works (401 without the token), the extender is open."""
    ready = container["readinessProbe"]["httpGet"]["path"]
    _wait(f"{url}{ready}", server)
    assert httpx.get(url + container["livenessProbe"]["httpGet"]["path"], timeout=5).status_code == 200
    monitor = one(trial, "ServiceMonitor")["spec"]["endpoints"][0]
    secret = monitor["authorization"]["credentials"]
    token = SECRETS[secret["name"]][secret["key"]]
    metrics = httpx.get(url + monitor["path"], headers={"Authorization": f"Bearer {token}"}, timeout=5)
    assert metrics.status_code == 200
    assert [s for s in SIGNAL_NAMES if f"# TYPE {s} gauge" not in metrics.text] == []
    assert httpx.get(url + monitor["path"], timeout=5).status_code == 401
    # the scrape's token may only read: booking with it is refused
    body = {"model": "llama-3.1-8b"}
    booking = httpx.post(f"{url}/v1/placements", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=5)
    assert booking.status_code == 403
    # --open-extender: kube-scheduler's call needs no token
    args = {"Pod": {"metadata": {"name": "p"}, "spec": {"containers": []}}, "NodeNames": ["gpu-node-00"]}
    assert httpx.post(f"{url}/v1/extender/filter", json=args, timeout=5).json()["NodeNames"] == ["gpu-node-00"]


def _move(text: str, moves: Mapping[str, str]) -> str:
    for old, new in moves.items():
        text = text.replace(old, new)
    return text


class _Process:
    """A child process with its output in a log file; ended (SIGTERM, then SIGKILL) on leaving."""

    def __init__(self, argv: list[str], log: Path, env: Mapping[str, str]) -> None:
        self.argv, self.log, self.env = argv, log, env

    def __enter__(self) -> _Process:
        self.out = open(self.log, "wb")  # closed in __exit__
        self.proc = subprocess.Popen(self.argv, stdout=self.out, stderr=subprocess.STDOUT, env=dict(self.env))
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


def _wait(url: str, server: _Process, limit_s: float = 60) -> None:
    """Until ``url`` answers 200; fails at once when the server exits or answers anything but 200 or 503."""
    deadline = time.monotonic() + limit_s
    status: int | None = None
    while time.monotonic() < deadline and server.proc.poll() is None and status in (None, 503):
        try:
            status = httpx.get(url, timeout=1).status_code
            if status == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    output = server.log.read_text(errors="replace")[-2000:]
    pytest.fail(f"{url} answered {status} (exit code {server.proc.poll()}): {output}", pytrace=False)


# --- tests: the sidecar component --------------------------------------------------------------------


def test_sidecar_patches_add_the_same_container() -> None:
    deployment_ops = yaml.safe_load((SIDECAR / "deployment-patch.yaml").read_text())
    lws_ops = yaml.safe_load((SIDECAR / "leaderworkerset-patch.yaml").read_text())
    moved = [
        {**op, "path": op["path"].replace("/spec/template/", f"/spec/leaderWorkerTemplate/{t}/")}
        for t in ("leaderTemplate", "workerTemplate")
        for op in deployment_ops
    ]
    assert lws_ops == moved


@pytest.mark.parametrize(("model", "kind"), [("llama-3.1-8b", "Deployment"), ("llama-3.1-405b", "LeaderWorkerSet")])
def test_sidecar_component_on_launched_engines(
    model: str, kind: str, run_cli: RunCli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`launch k8s` objects + the component, rendered; each sidecar's args run the real `toposched sidecar`."""
    (tmp_path / "cluster.yaml").write_text(
        yaml.safe_dump({"name": "t", "nodes": [{"name": "gpu-node-{i:02d}", "count": 2, "preset": "hgx-h100"}]})
    )
    extra = ["--tp", "4", "--replicas", "2"] if kind == "Deployment" else []
    planned = run_cli("plan", "--cluster", str(tmp_path / "cluster.yaml"), "--model", model, *extra, "--json")
    assert planned.exit_code == 0, planned.stderr
    (tmp_path / "plan.json").write_text(planned.stdout)
    doc = load_plan(tmp_path / "plan.json")
    (tmp_path / "engines.yaml").write_text(yaml.safe_dump_all(k8s_objects(doc), sort_keys=False))
    # no patches: `launch k8s` writes the placement annotation the sidecar reads (docs/kubernetes.md)
    kustomization = {
        "resources": ["engines.yaml"],
        "components": [os.path.relpath(SIDECAR, tmp_path)],
        "configMapGenerator": [
            {"name": "toposched-plan", "files": ["plan.json"], "options": {"disableNameSuffixHash": True}}
        ],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    objects = kustomize(tmp_path)

    workloads = [o for o in objects if o["kind"] == kind]
    assert len(workloads) == len(doc.placements) >= 1
    sidecar = yaml.safe_load((SIDECAR / "deployment-patch.yaml").read_text())[0]["value"]
    served: list[int] = []
    monkeypatch.setattr("prometheus_client.start_http_server", lambda port, **_kw: served.append(port))
    runs = 0
    for workload in workloads:
        for template in pod_templates(workload):
            containers = {c["name"]: c for c in template["spec"]["containers"]}
            assert containers[SIDECAR_NAME] == {**sidecar, "image": IMAGE}
            assert_locked(containers[SIDECAR_NAME])
            problems = validate(workload) if kind == "Deployment" else validate(_as_pod_template(template))
            assert problems == []
            pod = Pod(objects, template, containers[SIDECAR_NAME], tmp_path / f"pod{runs}", node=node_of(template))
            argv = pod.argv()
            assert argv[0] == "sidecar"
            # the sidecar holds the report token, never the API token (which books and releases GPUs)
            env = pod.env()
            assert env["TOPOSCHED_REPORT_TOKEN"] == REPORT_TOKEN and "TOPOSCHED_API_TOKEN" not in env
            result = run_cli(*argv, "--fake", "steady", "--iterations", "1")
            assert result.exit_code == 0, result.stderr
            (check,) = [e for e in map(yaml.safe_load, result.stdout.splitlines()) if e["event"] == "check"]
            assert (check["placement"], check["node"]) == (
                template["metadata"]["annotations"][PLACEMENT_ANNOTATION],
                pod.node,
            )
            runs += 1
    assert served == [sidecar["ports"][0]["containerPort"]] * runs and runs >= 2
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    assert validate(monitor) == []
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == {p["name"] for p in sidecar["ports"]}
    assert all(
        selects(monitor["spec"]["selector"], t["metadata"]["labels"]) for w in workloads for t in pod_templates(w)
    )


def _as_pod_template(template: Obj) -> Obj:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}


if __name__ == "__main__":
    write_prometheus_rule()
    print(f"wrote {BASE / 'prometheusrule.yaml'}")
