"""The pod template of a placement's pods: the container and its entrypoint, GPUs (a DRA claim or the device
plugin), RDMA, node affinity, spreading, and the ssh key of a multi-node TensorRT-LLM pod."""

from __future__ import annotations

from collections.abc import Sequence

from toposched.binding.engine_args import POD_GRACE_S
from toposched.binding.k8s_affinity import HOSTNAME, node_requirements
from toposched.binding.k8s_dra import GpuIds, pod_claim
from toposched.binding.k8s_entrypoint import MPI_SSH_DIR, entrypoint, is_mpi, kubelet_escape, mpi_ssh_port, shared_env
from toposched.binding.k8s_options import (
    ANNOTATION_PLACEMENT,
    LABEL_PLACEMENT,
    LABEL_REQUEST,
    MANAGED_BY,
    MODEL_CACHE_DIR,
    K8sOptions,
    Obj,
    hf_token_env,
    label_value,
    model_cache_volume,
)
from toposched.binding.node_launch import NodeLaunch
from toposched.binding.plan_doc import PlanDoc
from toposched.solver.request import Placement

GPU_RESOURCE = "nvidia.com/gpu"
CONTAINER = "engine"
HEALTH_PATH = "/health"
"""The health route of all three engines' servers (vLLM ``entrypoints/serve/instrumentator/health.py``, SGLang
``srt/entrypoints/http_server.py``, ``trtllm-serve``): 200 once the model is loaded and the engine is alive."""
STARTUP_PERIOD_S, STARTUP_FAILURES = 10, 360
"""The startup probe gives the engine an hour to download (or read) its weights and capture CUDA graphs
(405B in FP8: ~400 GB); liveness and readiness start only after it succeeds."""


def probes(port_name: str = "http") -> Obj:
    """Startup, readiness and liveness probes on the engine's health route (issue 36)."""

    def get(period: int, failures: int, timeout: int) -> Obj:
        return {
            "httpGet": {"path": HEALTH_PATH, "port": port_name},
            "periodSeconds": period,
            "failureThreshold": failures,
            "timeoutSeconds": timeout,
        }

    return {
        "startupProbe": get(STARTUP_PERIOD_S, STARTUP_FAILURES, 5),
        "readinessProbe": get(10, 3, 5),
        # generous: a busy engine answers /health late; a restart reloads the weights
        "livenessProbe": get(30, 5, 10),
    }


def _pod_labels(doc: PlanDoc, name: str) -> dict[str, str]:
    return {**MANAGED_BY, LABEL_REQUEST: label_value(doc.request.id), LABEL_PLACEMENT: name}


def _multi_node(placement: Placement) -> bool:
    return len({r.node for r in placement.ranks}) > 1


def pod_template(
    doc: PlanDoc,
    placement: Placement,
    launches: Sequence[NodeLaunch],
    name: str,
    opts: K8sOptions,
    *,
    lws: bool,
    claim: str | None = None,
    ids: Sequence[GpuIds] | None = None,
    rdma: str | None = None,
) -> Obj:
    """A PodTemplateSpec that runs ``launches`` (all with the same GPU count) on their nodes.

    With ``claim`` (the name of a ``ResourceClaimTemplate``) the pod gets its GPUs through DRA,
    else it asks the device plugin for ``nvidia.com/gpu``. ``rdma`` names the RDMA resource a
    single-node pod needs too (KV transfer of a disaggregated plan); multi-node pods take the fabric's.
    Pods that use RDMA get ``IPC_LOCK`` and, with ``fabric.host_network``, the host network.
    """
    nodes = [launch.node for launch in launches]
    gpus = len(launches[0].gpus)
    env: list[Obj] = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    env += [{"name": k, "value": v} for k, v in sorted(shared_env(launches).items()) if k != "CUDA_VISIBLE_DEVICES"]
    env.append(hf_token_env(opts))
    if opts.model_cache:
        env.append({"name": "HF_HOME", "value": MODEL_CACHE_DIR})
    resources: dict[str, str] = {} if claim else {GPU_RESOURCE: str(gpus)}
    fabric = doc.cluster.fabric
    multi = _multi_node(placement)
    uses_rdma = multi or rdma is not None
    rdma = rdma or (fabric.rdma_resource if multi and fabric is not None else None)
    if rdma:
        resources[rdma] = str(fabric.rdma_per_pod if fabric is not None else 1)
    container: Obj = {
        "name": CONTAINER,
        "image": opts.resolved_image(),
        "command": ["/bin/sh", "-c", kubelet_escape(entrypoint(doc, launches, lws=lws, ids=ids))],
        "env": env,
        "ports": [_container_port(doc, launches[0])],
        "resources": container_resources(resources, opts),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    cpus = None if opts.cpu else numa_cpu_share(doc, launches)
    if cpus is not None:  # a request only (Burstable): the scheduler keeps the plan's CPU share free for the pod
        container["resources"].setdefault("requests", {})["cpu"] = str(cpus)
    serves = launches[0].node_rank == 0  # the leader's (or the only) pod serves HTTP; workers do not
    if serves:
        container.update(probes())
    if opts.model_cache:
        container["volumeMounts"].append({"name": "model-cache", "mountPath": MODEL_CACHE_DIR})
    if uses_rdma:  # RDMA registers (pins) memory: NCCL or a KV transfer over InfiniBand/RoCE needs CAP_IPC_LOCK
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    empty_dir: Obj = {"medium": "Memory"}
    if opts.shm_size:
        empty_dir["sizeLimit"] = opts.shm_size
    labels = _pod_labels(doc, name)
    affinity: Obj = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [r.expression() for r in node_requirements(doc, placement, nodes, opts)]}
                ]
            }
        }
    }
    spec: Obj = {
        "affinity": affinity,
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": empty_dir}]
        + ([model_cache_volume(opts.model_cache)] if opts.model_cache else []),
        "terminationGracePeriodSeconds": POD_GRACE_S,  # the engine drains its requests (engine_args.DRAIN_S)
    }
    if is_mpi(launches[0]):
        _mount_ssh_key(spec, container, opts, leader=launches[0].node_rank == 0)
    if claim:
        pod_claim(spec, container, claim)
    if uses_rdma and fabric is not None and fabric.host_network:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"  # keep cluster DNS: the leader is found by name
    # Pods of one group (LWS) or replicas the request wants spread never share a node.
    spread_key = LABEL_PLACEMENT if lws else (LABEL_REQUEST if doc.request.spread_replicas else None)
    if spread_key is not None:
        match = {spread_key: labels[spread_key]}

        def selector() -> Obj:  # a fresh dict each time: YAML output must not need anchors
            return {"matchLabels": dict(match)}

        affinity["podAntiAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": selector(), "topologyKey": HOSTNAME}]
        }
        spec["topologySpreadConstraints"] = [
            {"maxSkew": 1, "topologyKey": HOSTNAME, "whenUnsatisfiable": "DoNotSchedule", "labelSelector": selector()}
        ]
    # The placement id itself (the label holds a DNS name made from it): the scheduler extender and the
    # sidecar (downward API) read this annotation.
    annotations = {ANNOTATION_PLACEMENT: placement.id}
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": spec}


def _container_port(doc: PlanDoc, launch: NodeLaunch) -> Obj:
    """The server's port, or the sshd port of a multi-node TensorRT-LLM worker (which serves nothing)."""
    if is_mpi(launch) and launch.node_rank > 0:
        return {"name": "ssh", "containerPort": mpi_ssh_port(doc, launch.placement), "protocol": "TCP"}
    return {"name": "http", "containerPort": launch.port, "protocol": "TCP"}


def _mount_ssh_key(spec: Obj, container: Obj, opts: K8sOptions, *, leader: bool) -> None:
    """Mount the Secret's private key (leader: mpirun's ssh) or public key (workers: sshd), owner-read only."""
    key = "ssh-privatekey" if leader else "ssh-publickey"
    secret = {"secretName": opts.ssh_secret(), "items": [{"key": key, "path": key}], "defaultMode": 0o400}
    spec["volumes"].append({"name": "mpi-ssh", "secret": secret})
    container["volumeMounts"].append({"name": "mpi-ssh", "mountPath": MPI_SSH_DIR, "readOnly": True})


CPU_SHARE_RESERVE = 0.9
"""The share of its NUMA nodes' CPUs a pod requests when ``--cpu`` is not given: 10 % of each NUMA node is
left to the kubelet's reserved CPUs and the node's daemons, so the pods of one node all fit its allocatable
CPUs (an assumption; ``--cpu`` sets an exact request and limit)."""


def _cpu_count(cpulist: str) -> int:
    """CPUs in a list such as ``0-55,112-167``; 0 for text that is not one."""
    total = 0
    for part in cpulist.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return 0
        total += (int(high) - int(low) + 1) if high else 1
    return max(total, 0)


def numa_cpu_share(doc: PlanDoc, launches: Sequence[NodeLaunch]) -> int | None:
    """CPUs a pod of ``launches`` requests: its GPUs' share of their NUMA nodes' CPUs (``GPU.cpu_affinity``), times
    ``CPU_SHARE_RESERVE``, the smallest over the nodes it may run on; None when a GPU's affinity is unknown."""
    shares = []
    for launch in launches:
        node = doc.cluster.node(launch.node)
        everyone: dict[str, int] = {}
        for g in node.gpus:
            if g.cpu_affinity:
                everyone[g.cpu_affinity] = everyone.get(g.cpu_affinity, 0) + 1
        share = 0.0
        for index in launch.gpus:
            affinity = node.gpu(index).cpu_affinity
            cpus = _cpu_count(affinity) if affinity else 0
            if not cpus:
                return None
            share += cpus / everyone[str(affinity)]
        shares.append(share)
    return max(1, int(min(shares) * CPU_SHARE_RESERVE)) if shares else None


def container_resources(resources: dict[str, str], opts: K8sOptions) -> Obj:
    """A container's ``resources``: ``resources`` (GPUs, RDMA devices) plus ``--cpu``/``--memory``, as equal
    limits and requests (a Guaranteed pod when both are given); empty when there is nothing to ask for."""
    wanted = {
        **resources,
        **({"cpu": opts.cpu} if opts.cpu else {}),
        **({"memory": opts.memory} if opts.memory else {}),
    }
    return {"limits": dict(wanted), "requests": dict(wanted)} if wanted else {}
