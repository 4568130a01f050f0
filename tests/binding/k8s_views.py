"""The launch tests' view of the Kubernetes output: the workloads, with each pod's entrypoint script at hand.

Since issue 36 every entrypoint lives in the plan's ConfigMap (``binding/k8s_configmap.py``) and the pods run
it from there. Most tests look at the workloads and at what a pod's script does, so these wrappers return the
real objects of ``binding/k8s.py`` and ``binding/k8s_pd.py`` without the ConfigMap and remember its files;
``script_of(template)`` reads a pod's script back from the files of the last render. The tests that check
the manifests as applied (schemas, the ConfigMap itself) call the real functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from toposched.binding import k8s as _k8s
from toposched.binding import k8s_pd as _k8s_pd
from toposched.binding.k8s_configmap import ENTRYPOINT_DIR, unescape
from toposched.binding.k8s_options import K8sOptions
from toposched.binding.plan_doc import PlanDoc

Obj = dict[str, Any]
FILES: dict[str, str] = {}
"""Entrypoint files of the ConfigMaps rendered through these wrappers (key -> script), latest first."""


def _keep(objects: list[Obj]) -> list[Obj]:
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            FILES.update(obj["data"])
    return [o for o in objects if o["kind"] != "ConfigMap"]


def _output(out: _k8s.K8sOutput) -> _k8s.K8sOutput:
    return dataclasses.replace(out, objects=_keep(out.objects))


def k8s_objects(doc: PlanDoc, opts: K8sOptions | None = None) -> list[Obj]:
    return _keep(_k8s.k8s_objects(doc, opts))


def render_objects(doc: PlanDoc, opts: K8sOptions | None = None) -> _k8s.K8sOutput:
    return _output(_k8s.render_objects(doc, opts))


def render_roles(roles: Mapping[str, PlanDoc], name: str, opts: K8sOptions | None = None) -> _k8s.K8sOutput:
    return _output(_k8s.render_roles(roles, name, opts))


def role_based_group(roles: Mapping[str, PlanDoc], name: str, opts: K8sOptions | None = None) -> list[Obj]:
    return _keep(_k8s.role_based_group(roles, name, opts))


def render_pd(doc: PlanDoc, group_name: str = "pd", opts: K8sOptions | None = None) -> _k8s.K8sOutput:
    return _output(_k8s_pd.render_pd(doc, group_name, opts))


def command_script(container: Obj) -> str:
    """The script a container runs: its ConfigMap file, or an inline ``/bin/sh -c`` one."""
    command = container["command"]
    if command[:2] == ["/bin/sh", "-c"]:
        return unescape(command[2])
    assert command[0] == "/bin/sh" and command[1].startswith(ENTRYPOINT_DIR + "/"), command
    return FILES[command[1].removeprefix(ENTRYPOINT_DIR + "/")]


def script_of(template: Obj) -> str:
    """The script the ``engine`` container of a pod template runs."""
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == "engine"]
    return command_script(container)


def runnable_command(container: Obj, directory: Path) -> list[str]:
    """The container's command as this machine can run it: its ConfigMap file written under ``directory``
    (mounted at ``ENTRYPOINT_DIR`` in the pod), or the inline command unescaped."""
    command = container["command"]
    if command[:2] == ["/bin/sh", "-c"]:
        return ["/bin/sh", "-c", unescape(command[2])]
    path = directory / "entrypoint" / command[1].removeprefix(ENTRYPOINT_DIR + "/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(command_script(container))
    return ["/bin/sh", str(path)]
