"""JSON schemas of the custom resources toposched emits: LeaderWorkerSet, RoleBasedGroup, CoordinatedPolicy,
and from their vendored CRDs (``crd_schema``) ComputeDomain, KAI's and Volcano's PodGroups, and the
Topology / ResourceFlavor samples of docs/kubernetes.md.

kubernetes-validate bundles only Kubernetes' own types, and no package registry ships these CRDs'
OpenAPI documents, so the schemas are written here from the Go types that
``tests/data/reference/engines.md`` records (section 4: ``kubernetes-sigs/lws``
``api/leaderworkerset/v1/leaderworkerset_types.go``; section 3: ``sigs.k8s.io/rbgs``
``api/workloads/v1alpha2/rolebasedgroup_types.go`` and ``coordinatedpolicy_types.go``): every field
with its type, the enums, the required fields, and no other field (a CRD's structural schema prunes
or rejects unknown fields). The pod templates they embed are checked separately, as the template of a
core ``v1`` ``PodTemplate``, by kubernetes-validate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

Schema = dict[str, Any]

INT_OR_STRING: Schema = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
POD_TEMPLATE: Schema = {"type": "object"}
"""A ``PodTemplateSpec``: checked by kubernetes-validate, not here."""
METADATA: Schema = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}},
}


def _object(properties: dict[str, Schema], required: tuple[str, ...] = ()) -> Schema:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def _resource(api_version: str, kind: str, spec: Schema) -> Schema:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
    }


LEADER_WORKER_SET = _resource(
    "leaderworkerset.x-k8s.io/v1",
    "LeaderWorkerSet",
    _object(
        {
            "replicas": {"type": "integer", "minimum": 0},
            "leaderWorkerTemplate": _object(
                {
                    "leaderTemplate": POD_TEMPLATE,
                    "workerTemplate": POD_TEMPLATE,
                    "size": {"type": "integer", "minimum": 1},
                    "restartPolicy": {
                        "enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]
                    },
                    "subGroupPolicy": _object(
                        {
                            "subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]},
                            "subGroupSize": {"type": "integer", "minimum": 1},
                        }
                    ),
                    "volumeClaimTemplates": {"type": "array", "items": {"type": "object"}},
                    "persistentVolumeClaimRetentionPolicy": {"type": "object"},
                },
                ("workerTemplate",),
            ),
            "rolloutStrategy": _object(
                {
                    "type": {"enum": ["RollingUpdate"]},
                    "rollingUpdateConfiguration": _object(
                        {"partition": {"type": "integer"}, "maxUnavailable": INT_OR_STRING, "maxSurge": INT_OR_STRING}
                    ),
                }
            ),
            "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
            "networkConfig": _object({"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}),
        },
        ("leaderWorkerTemplate",),
    ),
)

_TEMPLATE_REF = _object({"name": {"type": "string"}, "patch": {"type": "object"}}, ("name",))
_RESTART_CONFIG = _object(
    {"type": {"type": "string"}, "baseDelaySeconds": {"type": "integer"}, "maxDelaySeconds": {"type": "integer"}}
)
_ROLE = _object(
    {
        "name": {"type": "string", "minLength": 1},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        "replicas": {"type": "integer", "minimum": 0},
        "rolloutStrategy": _object(
            {
                "type": {"enum": ["RollingUpdate"]},
                "rollingUpdate": _object(
                    {
                        "type": {"enum": ["RecreatePod", "InPlaceIfPossible", "InPlaceOnly"]},
                        "partition": INT_OR_STRING,
                        "maxUnavailable": INT_OR_STRING,
                        "maxSurge": INT_OR_STRING,
                        "paused": {"type": "boolean"},
                        "inPlaceUpdateStrategy": _object({"gracePeriodSeconds": {"type": "integer"}}),
                    }
                ),
            }
        ),
        "dependencies": {"type": "array", "items": {"type": "string"}},
        "standalonePattern": {
            **_object({"template": POD_TEMPLATE, "templateRef": _TEMPLATE_REF}),
            "oneOf": [{"required": ["template"]}, {"required": ["templateRef"]}],
        },
        "leaderWorkerPattern": _object(
            {
                "size": {"type": "integer", "minimum": 1},
                "template": POD_TEMPLATE,
                "templateRef": _TEMPLATE_REF,
                "leaderTemplatePatch": {"type": "object"},
                "workerTemplatePatch": {"type": "object"},
                "sharedServiceSelection": {"enum": ["All", "LeaderOnly"]},
                "restartPolicy": {"enum": ["None", "RecreateRoleInstanceOnPodRestart"]},
                "restartPolicyConfig": _RESTART_CONFIG,
            }
        ),
        "customComponentsPattern": _object(
            {
                "components": {"type": "array", "items": {"type": "object"}},
                "restartPolicy": {"type": "string"},
                "restartPolicyConfig": _RESTART_CONFIG,
            }
        ),
        "servicePorts": {"type": "array", "items": {"type": "object"}},
        "engineRuntimes": {"type": "array", "items": {"type": "object"}},
        "scalingAdapter": _object({"enable": {"type": "boolean"}, "labels": STRING_MAP}),
        "minReadySeconds": {"type": "integer", "minimum": 0},
        "podManagementPolicy": {"type": "string"},
    },
    ("name", "replicas"),
)
# Exactly one workload pattern per role (engines.md section 3: "inline pattern: exactly one of").
_ROLE["oneOf"] = [
    {"required": ["standalonePattern"]},
    {"required": ["leaderWorkerPattern"]},
    {"required": ["customComponentsPattern"]},
]

ROLE_BASED_GROUP = _resource(
    "workloads.x-k8s.io/v1alpha2",
    "RoleBasedGroup",
    _object(
        {
            "roles": {"type": "array", "minItems": 1, "items": _ROLE},
            "roleTemplates": {
                "type": "array",
                "items": _object({"name": {"type": "string"}, "template": POD_TEMPLATE}, ("name", "template")),
            },
        },
        ("roles",),
    ),
)

COORDINATED_POLICY = _resource(
    "workloads.x-k8s.io/v1alpha2",
    "CoordinatedPolicy",
    _object(
        {
            "policies": {
                "type": "array",
                "items": _object(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "roles": {"type": "array", "minItems": 1, "items": {"type": "string"}},
                        "strategy": _object(
                            {
                                "rollingUpdate": _object(
                                    {
                                        "maxSkew": INT_OR_STRING,
                                        "partition": INT_OR_STRING,
                                        "maxUnavailable": INT_OR_STRING,
                                    }
                                ),
                                "scaling": _object(
                                    {
                                        "maxSkew": INT_OR_STRING,
                                        "progression": {"enum": ["OrderScheduled", "OrderReady"]},
                                    }
                                ),
                            }
                        ),
                    },
                    ("name", "roles"),
                ),
            }
        },
        ("policies",),
    ),
)

CRDS = Path(__file__).resolve().parents[2] / "tests" / "data" / "reference" / "k8s"
"""CRDs vendored from their repositories (tests/data/README.md names each file's origin)."""


def _structural(schema: Any) -> Any:
    """An ``openAPIV3Schema`` as JSON Schema: objects with ``properties`` take no other field (the API server
    prunes unknown fields of a structural schema; a toposched object must not rely on that), except where
    the CRD says ``x-kubernetes-preserve-unknown-fields``; the ``x-kubernetes-*`` keywords are dropped."""
    if isinstance(schema, list):
        return [_structural(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _structural(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def crd_schema(path: Path, version: str) -> Schema:
    """The JSON Schema of ``version`` of the CRD in ``path`` (``metadata`` left to the API server's own checks)."""
    crd = yaml.safe_load(path.read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _structural(served["schema"]["openAPIV3Schema"])
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema["properties"]["apiVersion"] = {"const": f"{group}/{version}"}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"]["metadata"] = METADATA
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


COMPUTE_DOMAIN = crd_schema(
    CRDS / "nvidia-dra-driver-gpu" / "crds" / "resource.nvidia.com_computedomains.yaml", "v1beta1"
)
KAI_POD_GROUP = crd_schema(CRDS / "kai-scheduler" / "crds" / "scheduling.run.ai_podgroups.yaml", "v2alpha2")
KAI_TOPOLOGY = crd_schema(CRDS / "kai-scheduler" / "crds" / "kai.scheduler_topologies.yaml", "v1alpha1")
VOLCANO_POD_GROUP = crd_schema(CRDS / "volcano" / "crds" / "scheduling.volcano.sh_podgroups.yaml", "v1beta1")
KUEUE_TOPOLOGY = crd_schema(CRDS / "kueue" / "crds" / "kueue.x-k8s.io_topologies.yaml", "v1beta2")
KUEUE_FLAVOR = crd_schema(CRDS / "kueue" / "crds" / "kueue.x-k8s.io_resourceflavors.yaml", "v1beta2")

SCHEMAS: dict[tuple[str, str], Schema] = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): LEADER_WORKER_SET,
    ("workloads.x-k8s.io/v1alpha2", "RoleBasedGroup"): ROLE_BASED_GROUP,
    ("workloads.x-k8s.io/v1alpha2", "CoordinatedPolicy"): COORDINATED_POLICY,
    ("resource.nvidia.com/v1beta1", "ComputeDomain"): COMPUTE_DOMAIN,
    ("scheduling.run.ai/v2alpha2", "PodGroup"): KAI_POD_GROUP,
    ("kai.scheduler/v1alpha1", "Topology"): KAI_TOPOLOGY,
    ("scheduling.volcano.sh/v1beta1", "PodGroup"): VOLCANO_POD_GROUP,
    ("kueue.x-k8s.io/v1beta2", "Topology"): KUEUE_TOPOLOGY,
    ("kueue.x-k8s.io/v1beta2", "ResourceFlavor"): KUEUE_FLAVOR,
}


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The pod templates a custom resource embeds, with where they sit."""
    spec = obj.get("spec", {})
    if obj.get("kind") == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate", {})
        return [(f"leaderWorkerTemplate.{k}", lwt[k]) for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    if obj.get("kind") == "RoleBasedGroup":
        found = []
        for i, role in enumerate(spec.get("roles", [])):
            for pattern in ("standalonePattern", "leaderWorkerPattern"):
                if "template" in role.get(pattern, {}):
                    found.append((f"roles[{i}].{pattern}.template", role[pattern]["template"]))
        found += [(f"roleTemplates[{i}].template", t["template"]) for i, t in enumerate(spec.get("roleTemplates", []))]
        return found
    return []
