"""RoleBasedGroup and CoordinatedPolicy objects (``workloads.x-k8s.io/v1alpha2``, engines.md section 3): a role of
one pinned pod, the group of such roles, and the policy that rolls them together."""

from __future__ import annotations

from collections.abc import Sequence

from toposched.binding.k8s_options import K8sOptions, Obj, dns_name, object_metadata
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError

RBG_API = "workloads.x-k8s.io/v1alpha2"


def standalone_role(name: str, template: Obj, dependencies: Sequence[str] = ()) -> Obj:
    """One RBG role of one pinned pod: it rolls with ``maxSurge: 0`` (a surge pod would wait for the same
    GPUs forever); ``dependencies`` are roles RBG creates it after."""
    template["metadata"]["labels"]["role"] = name
    role: Obj = {
        "name": name,
        "replicas": 1,
        "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
    }
    if dependencies:
        role["dependencies"] = list(dependencies)
    role["standalonePattern"] = {"template": template}
    return role


def role_based_group_object(group: str, roles: Sequence[Obj], opts: K8sOptions, doc: PlanDoc) -> Obj:
    """The ``RoleBasedGroup`` of these role specs (their names must differ)."""
    names = [r["name"] for r in roles]
    if len(set(names)) != len(names):
        raise InputError(f"role names repeat: {', '.join(names)}")
    return {
        "apiVersion": RBG_API,
        "kind": "RoleBasedGroup",
        "metadata": object_metadata(group, opts, doc),
        "spec": {"roles": list(roles)},
    }


def coordinated_policy(group: str, roles: Sequence[str], opts: K8sOptions, doc: PlanDoc) -> Obj:
    """A ``CoordinatedPolicy`` that rolls ``roles`` of the group together."""
    return {
        "apiVersion": RBG_API,
        "kind": "CoordinatedPolicy",
        "metadata": object_metadata(group, opts, doc),
        "spec": {
            "policies": [
                {
                    "name": dns_name(group, "rollout", limit=63),
                    "roles": list(roles),
                    # maxSkew 0%: the roles' updated fractions never drift apart (seed 003 section 1.4).
                    "strategy": {"rollingUpdate": {"maxSkew": "0%", "maxUnavailable": 1}},
                }
            ]
        },
    }
