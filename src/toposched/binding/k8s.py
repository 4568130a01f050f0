"""Kubernetes objects for a plan: Deployments, LeaderWorkerSets, RoleBasedGroups, a kubelet config.

Every function returns plain dicts (one per object) built only from fields that the real schemas
define: built-in kinds from the Kubernetes API (checked in tests with ``kubernetes-validate``),
``LeaderWorkerSet`` (``leaderworkerset.x-k8s.io/v1``), ``RoleBasedGroup`` and ``CoordinatedPolicy``
(``workloads.x-k8s.io/v1alpha2``) and ``KubeletConfiguration`` from the field lists in
reference/engines.md sections 3-5.

* A single-node placement becomes a ``Deployment`` with one replica (it is pinned to specific GPUs,
  so it uses the ``Recreate`` strategy: a surge pod would wait for the same GPUs forever).
* A multi-node placement becomes a ``LeaderWorkerSet`` of ``size`` = nodes; the leader runs the
  node of rank 0 and the workers the others; the engine reaches the leader at ``$LWS_LEADER_ADDRESS``.
* Node affinity pins ``kubernetes.io/hostname`` to the planned node(s) and requires the GPU Feature
  Discovery labels ``nvidia.com/gpu.product`` (and ``nvidia.com/gpu.clique`` for multi-node
  NVLink), the request's node selector, racks and zones. ``node_requirements`` (``k8s_affinity.py``) is the one
  place that decides these, so ``lint_nodes`` checks exactly what the scheduler will.
* GPUs are pinned through Dynamic Resource Allocation whenever the plan knows real bus ids or UUIDs
  (``k8s_dra.py``: a ``ResourceClaimTemplate`` per pod template, one request per rank); otherwise,
  or with ``gpu_request="device-plugin"``, pods ask for ``nvidia.com/gpu: N`` and a warning says the
  plan is only preferred there (presets and ``nvidia-smi topo -m`` captures have no real ids).
* Multi-node pods get what NCCL over RDMA needs: ``IPC_LOCK``, the cluster's RDMA resource
  (``fabric.rdma_resource``) and, if asked, the host network (``fabric.host_network``).
* The container runs ``/bin/sh -c ENTRYPOINT`` (``k8s_entrypoint.py``): the script finds the planned GPUs
  among those the container sees by PCI bus id or UUID (``nvidia-smi --query-gpu=pci.bus_id,uuid``), never by
  ``nvidia-smi`` index (seed 003 section 3.2), exports ``CUDA_VISIBLE_DEVICES`` as their UUIDs in rank
  order with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, then execs the plan's command (with ``numactl`` when the
  plan binds NUMA). Every value is shell-quoted and every ``$`` doubled for the kubelet's ``$(VAR)``
  expansion, so a model path cannot run anything.
* A prefill/decode disaggregated plan is one RoleBasedGroup with its router and stores (``k8s_pd.py``);
  ``render_objects`` and ``render_roles`` refuse it.
* TensorRT-LLM: the entrypoint first writes the launch's options YAML under ``FILES_DIR`` with a
  quoted here-document, and ``--config`` names it there. A multi-node placement is a LeaderWorkerSet
  whose leader starts every rank with Open MPI's ``mpirun`` (``trtllm-llmapi-launch trtllm-serve``, as
  ``launch trtllm``): each worker pod selects its GPUs, writes a rank wrapper (its environment,
  ``CUDA_VISIBLE_DEVICES`` and ``numactl``) and runs an ``sshd`` that takes the key pair of a Secret
  (``K8sOptions.mpi_ssh_secret``); the leader asks each worker over ssh which node it runs on, writes
  the hostfile in the plan's node order from the LWS addresses (``$LWS_LEADER_ADDRESS`` with the worker
  index added to its pod name) and runs ``mpirun`` with ``G`` ranks per node (``mpi_entrypoint``).

``K8sOptions`` and the objects' names and labels are ``k8s_options.py``, the pod template ``k8s_pod.py``, the
RoleBasedGroup and CoordinatedPolicy objects ``k8s_rbg.py``; this module turns a plan into its objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

# ``node_setup`` is what ``build_launches`` gives each node (GPUs, NCCL variables, numactl): an mpirun launch carries
# it only inside its argv, and the pods of a multi-node TensorRT-LLM instance need it per node.
from toposched.binding.engines import build_launches, node_setup
from toposched.binding.k8s_affinity import node_requirements
from toposched.binding.k8s_compute_domain import claim_channel, compute_domain, spans_one_clique
from toposched.binding.k8s_configmap import entrypoints_to_configmap
from toposched.binding.k8s_dra import (
    GpuIds,
    choose_gpu_request,
    claim_template,
    claim_warning,
    nodes_text,
    repeated_uuids,
    under_one_pcie_root,
)
from toposched.binding.k8s_dra import normalise_bus_id as normalise_bus_id  # re-exported
from toposched.binding.k8s_entrypoint import MPI_RANK_COMMAND, is_mpi, launch_gpu_ids, mpi_ssh_port
from toposched.binding.k8s_options import (
    LABEL_PLACEMENT,
    K8sOptions,
    Obj,
    check_k8s_node_names,
    dns_name,
    object_metadata,
)
from toposched.binding.k8s_pod import pod_template
from toposched.binding.k8s_rbg import coordinated_policy, role_based_group_object, standalone_role
from toposched.binding.k8s_schedulers import apply_scheduler
from toposched.binding.node_launch import NodeLaunch, plain_file_name
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError
from toposched.solver.layout import node_blocks
from toposched.solver.request import Placement
from toposched.topology.domains import build_domain_map


def _launches(doc: PlanDoc, opts: K8sOptions) -> dict[str, list[NodeLaunch]]:
    """The plan's launches by placement id (a disaggregated plan's router under its own id)."""
    launches = build_launches(
        doc.placements, doc.request, doc.cluster, opts.engine, model_path=opts.model_path,
        disaggregation=doc.disaggregation, stores=doc.stores if opts.engine == "sglang" else (),
    )  # fmt: skip
    by_placement: dict[str, list[NodeLaunch]] = {}
    for launch in launches:
        by_placement.setdefault(launch.placement, []).extend(_mpi_nodes(doc, launch) if is_mpi(launch) else [launch])
    return by_placement


def _mpi_nodes(doc: PlanDoc, head: NodeLaunch) -> list[NodeLaunch]:
    """A multi-node TensorRT-LLM launch (one mpirun on the head) as one launch per node, for the pods: each
    with its node's GPUs and variables (as ``build_launches`` sets them up) and, as its argv, what a rank
    runs there: the node's ``numactl`` and the ranks' command, the same on every node. The options YAML
    stays with the head; the hostfile is written by the leader pod from the pods' addresses."""
    p = next(x for x in doc.placements if x.id == head.placement)
    start = head.argv.index(MPI_RANK_COMMAND)
    end = head.argv.index(":", start) if ":" in head.argv[start:] else len(head.argv)  # MPMD: the first context's
    ranks = head.argv[start:end]
    dmap = build_domain_map(doc.cluster)
    uuids = all(n.source == "nvml" for n in doc.cluster.nodes)  # as build_launches decides
    files = {k: v for k, v in head.files.items() if k != plain_file_name(head.placement, ".hostfile")}
    nodes: list[NodeLaunch] = []
    for rank, (node, gpus) in enumerate(node_blocks(p.ranks)):
        setup = node_setup(doc.cluster, dmap, node, gpus, True, uuids)
        update = {
            "node": node, "node_rank": rank, "env": setup.env, "argv": [*setup.prefix, *ranks], "gpus": setup.gpus,
            "gpu_ids": setup.ids, "numa_nodes": setup.numa_nodes, "files": files if rank == 0 else {},
            "srun_argv": None,
        }  # fmt: skip
        nodes.append(head.model_copy(update=update))
    return nodes


def mpi_warning(doc: PlanDoc, placement: str, opts: K8sOptions) -> str:
    """What a multi-node TensorRT-LLM LeaderWorkerSet needs that toposched does not create."""
    secret = opts.ssh_secret()
    return (
        f"placement {placement}: its leader starts the ranks in the worker pods with mpirun over ssh (port "
        f"{mpi_ssh_port(doc, placement)}); create the Secret first (`ssh-keygen -t ed25519 -N '' -f key && kubectl "
        f"-n {opts.namespace} create secret generic {secret} --from-file=ssh-privatekey=key "
        f"--from-file=ssh-publickey=key.pub`), and use an image with Open MPI's mpirun, sshd and ssh-keygen, run "
        "as root"
    )


def deployment(
    doc: PlanDoc,
    placement: Placement,
    launch: NodeLaunch,
    opts: K8sOptions,
    *,
    claim: str | None = None,
    ids: GpuIds | None = None,
) -> Obj:
    name = dns_name(opts.name_prefix, placement.id)
    template = pod_template(
        doc, placement, [launch], name, opts, lws=False, claim=claim, ids=None if ids is None else [ids]
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_metadata(name, opts, doc),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {LABEL_PLACEMENT: name}},
            "template": template,
        },
    }


def leader_worker_set(
    doc: PlanDoc,
    placement: Placement,
    launches: Sequence[NodeLaunch],
    opts: K8sOptions,
    *,
    claims: tuple[str | None, str | None] = (None, None),
    ids: Sequence[GpuIds] | None = None,
) -> Obj:
    """A LeaderWorkerSet; ``claims`` names the leader's and the workers' claim templates (DRA).

    ``launches`` (and ``ids``, one per launch) must be in node-rank order.
    """
    name = dns_name(opts.name_prefix, placement.id)
    ids = ids or launch_gpu_ids(doc, launches)
    leader = pod_template(doc, placement, launches[:1], name, opts, lws=True, claim=claims[0], ids=ids[:1])
    worker = pod_template(doc, placement, launches[1:], name, opts, lws=True, claim=claims[1], ids=ids[1:])
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": object_metadata(name, opts, doc),
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {
                "size": len(launches),
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


@dataclass(frozen=True)
class K8sOutput:
    """The objects for a plan, in apply order, and what the user must be told about them."""

    objects: list[Obj]
    warnings: list[str]
    gpu_request: Literal["dra", "device-plugin"]
    """How the pods get their GPUs."""

    def __post_init__(self) -> None:
        """Two objects of one kind and name would replace each other when applied: refused."""
        seen: dict[tuple[str, str], int] = {}
        for n, obj in enumerate(self.objects):
            key = (str(obj.get("kind")), str(obj.get("metadata", {}).get("name")))
            if key in seen:
                raise InputError(
                    f"two {key[0]} objects would both be named {key[1]!r} (objects {seen[key] + 1} and {n + 1}): "
                    "applying them, the second would replace the first",
                    fix="give the placements ids that differ in their first 40 characters, or launch each plan "
                    "with its own --name-prefix",
                )
            seen[key] = n


def ordered_launches(doc: PlanDoc, opts: K8sOptions) -> dict[str, tuple[list[NodeLaunch], list[GpuIds]]]:
    """Per placement: its launches in node-rank order and their GPU ids."""
    repeated = repeated_uuids(doc.cluster)
    out: dict[str, tuple[list[NodeLaunch], list[GpuIds]]] = {}
    for placement, launches in _launches(doc, opts).items():
        ordered = sorted(launches, key=lambda x: x.node_rank)
        out[placement] = (ordered, launch_gpu_ids(doc, ordered, repeated))
    return out


def claim_for(doc: PlanDoc, opts: K8sOptions, name: str, pods: Sequence[GpuIds]) -> Obj:
    """The ResourceClaimTemplate ``name`` for pods with these GPUs (one pod per node)."""
    root = all(under_one_pcie_root(doc.cluster.node(x.node), x.gpus) for x in pods)
    return claim_template(name, object_metadata(name, opts, doc), pods, pcie_root=root, driver=opts.driver)


def placement_warnings(
    doc: PlanDoc, placement: Placement, pods: Sequence[GpuIds], mode: str, *, rdma: bool = False
) -> list[str]:
    """Device-plugin pods that do not take a whole node; multi-node pods without RDMA (``rdma``: the caller's
    pods request an RDMA device whatever the fabric says, as a disaggregated plan's do)."""
    warnings: list[str] = []
    partial = [x for x in pods if x.pinned and len(x.gpus) < len(doc.cluster.node(x.node).gpus)]
    if mode == "device-plugin" and partial:
        x, where = partial[0], nodes_text([y.node for y in partial])
        warnings.append(
            f"device-plugin mode: placement {placement.id} uses {len(x.gpus)} of the "
            f"{len(doc.cluster.node(x.node).gpus)} GPUs of {where}; the device plugin picks which without knowing "
            "the plan, so a pod given other GPUs stops at start and, as the kubelet keeps a pod's devices across "
            "restarts, crash-loops until it is deleted (--gpu-request dra pins them through the NVIDIA DRA driver)"
        )
    fabric = doc.cluster.fabric
    nodes = {r.node for r in placement.ranks}
    one_clique = any(nodes <= set(c.nodes) for c in doc.cluster.cliques)
    rdma = rdma or (
        fabric is not None and bool(fabric.kind == "ETHERNET" or fabric.rdma_resource or fabric.host_network)
    )
    if len(nodes) > 1 and not one_clique and not rdma:
        warnings.append(
            f"placement {placement.id} spans {len(nodes)} nodes but its pods request no RDMA device: set "
            "fabric.rdma_resource (e.g. rdma/ib, nvidia.com/hostdev) or fabric.host_network: true in the cluster "
            "spec; without either NCCL finds no InfiniBand/RoCE device in the pods and falls back to TCP sockets"
        )
    return warnings


def render_objects(doc: PlanDoc, opts: K8sOptions | None = None) -> K8sOutput:
    """Claim templates (DRA), then one Deployment per single-node placement and one LeaderWorkerSet per
    multi-node placement; with the warnings to print."""
    opts = opts or K8sOptions()
    _check_plain(doc)
    ordered = ordered_launches(doc, opts)
    mode, warnings = choose_gpu_request(opts.gpu_request, [i for _, ids in ordered.values() for i in ids], opts.driver)
    claims: list[Obj] = []
    objects: list[Obj] = []
    for p in doc.placements:
        launches, ids = ordered[p.id]
        name = dns_name(opts.name_prefix, p.id)
        if len(launches) == 1:
            claim = f"{name}-gpus" if mode == "dra" else None
            if claim:
                claims.append(claim_for(doc, opts, claim, ids))
            objects.append(deployment(doc, p, launches[0], opts, claim=claim, ids=ids[0]))
        else:
            pair: tuple[str | None, str | None] = (None, None)
            if mode == "dra":
                pair = (f"{name}-leader-gpus", f"{name}-worker-gpus")
                claims += [claim_for(doc, opts, pair[0], ids[:1]), claim_for(doc, opts, pair[1], ids[1:])]
                warning = claim_warning(p.id, ids[1:])
                warnings += [warning] if warning else []
            lws = leader_worker_set(doc, p, launches, opts, claims=pair, ids=ids)
            if spans_one_clique(doc, p):  # TP across trays of one NVLink domain: an IMEX channel per pod
                claims.append(compute_domain(name, opts, doc))
                lwt = lws["spec"]["leaderWorkerTemplate"]
                for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
                    claim_channel(template, name)
            objects.append(lws)
            warnings += [mpi_warning(doc, p.id, opts)] if is_mpi(launches[0]) else []
        warnings += placement_warnings(doc, p, ids, mode)
    objects = apply_scheduler(claims + objects, doc, opts)
    objects = entrypoints_to_configmap(objects, doc, opts, doc.request.id)
    return K8sOutput(objects, warnings, mode)


def _check_plain(doc: PlanDoc) -> None:
    """Deployments, LWS and ``--roles`` groups run plain instances; a disaggregated plan has its own group."""
    check_k8s_node_names(doc)
    if doc.disaggregation is not None:
        raise InputError(
            "this is a prefill/decode disaggregated plan: its instances, router and stores go into one "
            "RoleBasedGroup (binding/k8s_pd.py render_pd)",
            fix="run `toposched launch k8s --plan PD.json --engine sglang` without --roles",
        )


def k8s_objects(doc: PlanDoc, opts: K8sOptions | None = None) -> list[Obj]:
    """The objects of :func:`render_objects`, without the warnings."""
    return render_objects(doc, opts).objects


# --- RoleBasedGroup and CoordinatedPolicy (engines.md section 3) ---------------------------------


def role_based_group(roles: Mapping[str, PlanDoc], name: str, opts: K8sOptions | None = None) -> list[Obj]:
    """The objects of :func:`render_roles`, without the warnings."""
    return render_roles(roles, name, opts).objects


def render_roles(roles: Mapping[str, PlanDoc], name: str, opts: K8sOptions | None = None) -> K8sOutput:
    """A ``RoleBasedGroup`` with one role per placement, and a ``CoordinatedPolicy`` rolling them together.

    A role's pods are pinned to their placement's GPUs, so a plan with several placements gives one
    role per placement (``decode-0``, ``decode-1``); each role has one replica and rolls out with
    ``maxSurge: 0``. Multi-node placements are not supported here (use ``k8s_objects``: LWS). With
    DRA, each role's claim template comes first.
    """
    opts = opts or K8sOptions()
    group = dns_name(opts.name_prefix, name)
    for doc in roles.values():
        _check_plain(doc)
    launched = {role: ordered_launches(doc, opts) for role, doc in roles.items()}
    everyone = [i for ordered in launched.values() for _, ids in ordered.values() for i in ids]
    mode, warnings = choose_gpu_request(opts.gpu_request, everyone, opts.driver)
    role_specs: list[Obj] = []
    claims: list[Obj] = []
    for role, doc in roles.items():
        for i, p in enumerate(doc.placements):
            launches, ids = launched[role][p.id]
            if len(launches) > 1:
                raise InputError(
                    f"role {role}: placement {p.id} spans {len(launches)} nodes; RoleBasedGroup output covers "
                    "single-node placements only",
                    fix="launch it with `toposched launch k8s --plan` (a LeaderWorkerSet)",
                )
            role_name = dns_name(role if len(doc.placements) == 1 else f"{role}-{i}", limit=40)
            pod_name = dns_name(group, role_name, limit=63)
            claim = f"{pod_name}-gpus" if mode == "dra" else None
            if claim:
                claims.append(claim_for(doc, opts, claim, ids))
            template = pod_template(doc, p, launches, pod_name, opts, lws=False, claim=claim, ids=ids)
            warnings += placement_warnings(doc, p, ids, mode)
            role_specs.append(standalone_role(role_name, template))
    first = next(iter(roles.values()))
    names = [r["name"] for r in role_specs]
    rbg = role_based_group_object(group, role_specs, opts, first)
    # one gang for the whole group: its placements come from every role's plan (on one cluster)
    together = dataclasses.replace(first, placements=tuple(p for d in roles.values() for p in d.placements))
    objects = apply_scheduler([*claims, rbg, coordinated_policy(group, names, opts, first)], together, opts)
    objects = entrypoints_to_configmap(objects, first, opts, group)
    return K8sOutput(objects, warnings, mode)


# --- Checking real nodes against the affinity (seed 003 section 3.1) -----------------------------


@dataclass(frozen=True)
class LintFinding:
    placement: str
    node: str
    problem: str


def lint_nodes(doc: PlanDoc, nodes_json: Any, opts: K8sOptions | None = None) -> list[LintFinding]:
    """Every planned node that is missing from ``kubectl get nodes -o json`` or fails its pod's affinity."""
    opts = opts or K8sOptions()
    if not isinstance(nodes_json, dict):
        raise InputError("the nodes file is not `kubectl get nodes -o json` output (not an object)")
    items = nodes_json.get("items", [nodes_json])
    if not isinstance(items, list):
        raise InputError("the nodes file's 'items' is not a list", fix="use kubectl get nodes -o json")
    labels_of: dict[str, dict[str, str]] = {}
    for k, item in enumerate(items):
        meta = item.get("metadata", {}) if isinstance(item, dict) else {}
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            raise InputError(f"the nodes file's items.{k} has no metadata.name")
        labels = meta.get("labels") or {}
        if not isinstance(labels, dict):
            raise InputError(f"the nodes file's items.{k}.metadata.labels is not an object")
        labels_of[meta["name"]] = {str(key): str(value) for key, value in labels.items()}
    findings: list[LintFinding] = []
    by_placement = _launches(doc, opts)
    for p in doc.placements:
        ordered = sorted(by_placement[p.id], key=lambda x: x.node_rank)
        templates = [ordered] if len(ordered) == 1 else [ordered[:1], ordered[1:]]
        for launches in templates:
            nodes = [launch.node for launch in launches]
            reqs = node_requirements(doc, p, nodes, opts)
            for node in nodes:
                if node not in labels_of:
                    findings.append(LintFinding(p.id, node, "node not found in the nodes file"))
                    continue
                for req in reqs:
                    problem = req.check(labels_of[node])
                    if problem:
                        findings.append(LintFinding(p.id, node, problem))
    return findings
