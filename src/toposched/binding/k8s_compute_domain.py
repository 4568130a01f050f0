"""ComputeDomains for TP (or EP) groups across the trays of one multi-node NVLink domain (GB200 NVL72; issue 36).

NCCL uses multi-node NVLink between pods only inside a working IMEX domain. In Kubernetes the NVIDIA DRA
driver makes one per ``ComputeDomain`` (``resource.nvidia.com/v1beta1``; ``tests/data/reference/k8s/``
has the CRD): its controller runs an IMEX daemon on every node a pod of the domain lands on, and generates
the ``ResourceClaimTemplate`` named in ``spec.channel.resourceClaimTemplate.name``; a pod that claims a
channel from it gets ``/dev/nvidia-caps-imex-channels`` and does not start before its node's daemon is
ready (reference/k8s/README.md, summary 3). So a placement whose ranks span several nodes of one clique
gets one ComputeDomain, and each of its pods claims the channel beside its GPUs (a DRA claim or the
device plugin's ``nvidia.com/gpu``); the pods keep the ``nvidia.com/gpu.clique`` node affinity
(``k8s_affinity.py``). ``numNodes`` is 0, the value the driver recommends with its default
``IMEXDaemonsWithDNSNames`` feature gate (the field is deprecated). The driver must run with
``resources.computeDomains.enabled`` (its default) on NVIDIA driver 570.158.01 or later.
"""

from __future__ import annotations

from toposched.binding.k8s_options import K8sOptions, Obj, dns_name, object_metadata
from toposched.binding.plan_doc import PlanDoc
from toposched.solver.request import Placement

API = "resource.nvidia.com/v1beta1"
CHANNEL_CLAIM = "imex-channel"
"""The channel's name in a pod's ``spec.resourceClaims`` and its container's ``resources.claims``."""


def spans_one_clique(doc: PlanDoc, placement: Placement) -> bool:
    """The placement's ranks sit on several nodes, all of one multi-node NVLink clique."""
    nodes = {r.node for r in placement.ranks}
    return len(nodes) > 1 and any(nodes <= set(c.nodes) for c in doc.cluster.cliques)


def channel_template_name(name: str) -> str:
    return dns_name(name, "imex-channel", limit=253)


def compute_domain(name: str, opts: K8sOptions, doc: PlanDoc) -> Obj:
    """The ComputeDomain of the instance called ``name``."""
    return {
        "apiVersion": API,
        "kind": "ComputeDomain",
        "metadata": object_metadata(dns_name(name, "compute-domain", limit=253), opts, doc),
        "spec": {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": channel_template_name(name)}}},
    }


def claim_channel(template: Obj, name: str) -> None:
    """Make the pods of ``template`` claim the IMEX channel of the ComputeDomain of ``name``."""
    spec = template["spec"]
    spec.setdefault("resourceClaims", []).append(
        {"name": CHANNEL_CLAIM, "resourceClaimTemplateName": channel_template_name(name)}
    )
    for container in spec["containers"]:
        if container["name"] == "engine":
            container.setdefault("resources", {}).setdefault("claims", []).append({"name": CHANNEL_CLAIM})


__all__ = ["API", "CHANNEL_CLAIM", "claim_channel", "compute_domain", "spans_one_clique"]
