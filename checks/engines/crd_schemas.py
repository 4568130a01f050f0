"""JSON schemas of the custom resources toposched emits: LeaderWorkerSet, RoleBasedGroup, CoordinatedPolicy.

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

from typing import Any

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

SCHEMAS: dict[tuple[str, str], Schema] = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): LEADER_WORKER_SET,
    ("workloads.x-k8s.io/v1alpha2", "RoleBasedGroup"): ROLE_BASED_GROUP,
    ("workloads.x-k8s.io/v1alpha2", "CoordinatedPolicy"): COORDINATED_POLICY,
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
