"""The engine entrypoints as files: one ConfigMap per plan, mounted into each pod and run from there (issue 36).

A pod's entrypoint (``k8s_entrypoint.py``: the GPU check, NCCL and NUMA settings, the engine command) used to
sit in the container's ``command`` as ``/bin/sh -c SCRIPT``, every ``$`` doubled so that the kubelet's
``$(VAR)`` expansion of ``command`` would leave it alone: forty escaped lines inside the YAML, unreadable in a
review. ``entrypoints_to_configmap`` moves every such script into one ConfigMap of the plan (a key per pod
template and container, the script exactly as the shell runs it: the kubelet expands nothing in a mounted
file), mounts it read-only at ``ENTRYPOINT_DIR`` and makes the container run ``/bin/sh ENTRYPOINT_DIR/KEY``.
The pod template carries the script's SHA-256 in an annotation, so applying a plan whose script changed
rolls the pods (a ConfigMap change alone restarts nothing).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from toposched.binding.k8s_options import K8sOptions, Obj, dns_name, object_metadata
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError

ENTRYPOINT_DIR = "/opt/toposched/entrypoint"
"""Where a pod's entrypoint is mounted (read-only; not under ``/etc/toposched``, where a multi-node
TensorRT-LLM pod mounts its ssh keys: a mount point inside a read-only ConfigMap volume cannot be made)."""
VOLUME = "toposched-entrypoint"
ANNOTATION_SHA = "toposched.io/entrypoint-sha256"
MAX_CONFIGMAP_BYTES = 1 << 20
"""The API server refuses a ConfigMap over 1 MiB."""


def _templates(node: object, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Obj]]:
    """Every pod template (``metadata`` and ``spec.containers``) under ``node``, with the names on its way."""
    if isinstance(node, dict):
        spec = node.get("spec")
        if isinstance(spec, dict) and isinstance(spec.get("containers"), list) and "metadata" in node:
            yield path, node
            return
        for key, value in node.items():
            step = {"leaderTemplate": "leader", "workerTemplate": "worker"}.get(key)
            yield from _templates(value, (*path, step) if step else path)
    elif isinstance(node, list):
        for item in node:
            name = item.get("name") if isinstance(item, dict) else None
            yield from _templates(item, (*path, name) if isinstance(name, str) and "containers" not in item else path)


def unescape(command: str) -> str:
    """The script a kubelet-escaped ``command`` (every ``$`` doubled) runs."""
    return command.replace("$$", "$")


def entrypoints_to_configmap(objects: list[Obj], doc: PlanDoc, opts: K8sOptions, name: str) -> list[Obj]:
    """``objects`` with every ``/bin/sh -c SCRIPT`` container running its script from one ConfigMap (first)."""
    cm_name = dns_name(opts.name_prefix, name, "entrypoints", limit=253)
    data: dict[str, str] = {}
    for obj in objects:
        base = str(obj.get("metadata", {}).get("name", "pod"))
        for path, template in _templates(obj.get("spec"), ()):
            items: list[Obj] = []
            digest = hashlib.sha256()
            for container in template["spec"]["containers"]:
                command = container.get("command")
                if not (isinstance(command, list) and len(command) == 3 and command[:2] == ["/bin/sh", "-c"]):
                    continue
                parts = [base, *path] + ([] if container["name"] == "engine" else [container["name"]])
                key = dns_name(*parts, limit=250) + ".sh"
                if key in data:
                    raise InputError(f"two pod templates would share the entrypoint file {key} in ConfigMap {cm_name}")
                script = unescape(command[2])
                data[key] = script
                digest.update(key.encode() + b"\0" + script.encode())
                container["command"] = ["/bin/sh", f"{ENTRYPOINT_DIR}/{key}"]
                mounts = container.setdefault("volumeMounts", [])
                mounts.append({"name": VOLUME, "mountPath": ENTRYPOINT_DIR, "readOnly": True})
                items.append({"key": key, "path": key})
            if items:
                volume = {"name": VOLUME, "configMap": {"name": cm_name, "items": items, "defaultMode": 0o555}}
                template["spec"].setdefault("volumes", []).append(volume)
                template["metadata"].setdefault("annotations", {})[ANNOTATION_SHA] = digest.hexdigest()
    if not data:
        return objects
    size = sum(len(k) + len(v.encode()) for k, v in data.items())
    if size > MAX_CONFIGMAP_BYTES:
        raise InputError(
            f"the plan's entrypoints come to {size:,} bytes, more than a ConfigMap holds (1 MiB)",
            fix="launch fewer placements per plan (split the request)",
        )
    configmap: Obj = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_metadata(cm_name, opts, doc),
        "data": dict(sorted(data.items())),
    }
    return [configmap, *objects]


def script_of(objects: list[Obj], template: Obj, container: str = "engine") -> str:
    """The script ``container`` of ``template`` runs: from the plan's ConfigMap (or inline, ``/bin/sh -c``)."""
    (c,) = [x for x in template["spec"]["containers"] if x["name"] == container]
    command = c["command"]
    if command[:2] == ["/bin/sh", "-c"]:
        return unescape(command[2])
    path = command[1]
    key = path.removeprefix(ENTRYPOINT_DIR + "/")
    for obj in objects:
        if obj.get("kind") == "ConfigMap" and key in obj.get("data", {}):
            return str(obj["data"][key])
    raise KeyError(f"no ConfigMap holds {path}")


__all__ = ["ANNOTATION_SHA", "ENTRYPOINT_DIR", "entrypoints_to_configmap", "script_of", "unescape"]
