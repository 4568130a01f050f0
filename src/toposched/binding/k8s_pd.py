"""Kubernetes objects for a prefill/decode disaggregated plan: one RoleBasedGroup (seed 003).

A disaggregated plan (``solver/pd.py``) becomes, in apply order:

* the DRA ``ResourceClaimTemplate`` of every prefill and decode pod (when the plan has real GPU ids);
* one ``Service`` per prefill and decode instance (its HTTP port, and a prefill instance's bootstrap
  port) and one for the router: the router's ``--prefill``/``--decode`` URLs name these Services
  instead of node names, which pods on the pod network cannot reach at the servers' ports;
* one ``RoleBasedGroup`` (``workloads.x-k8s.io/v1alpha2``) with a role per prefill instance
  (``prefill``, or ``prefill-0`` ...), per decode instance, per store (``store``, or ``store-0`` ...)
  and the ``router``. Each instance is its own role because its pod is pinned to its planned node
  and GPUs exactly as a plain plan's Deployment is (``k8s_pod.pod_template``: node affinity on
  ``kubernetes.io/hostname``, DRA claims or ``nvidia.com/gpu``, the GPU-selecting entrypoint that
  runs the SGLang command ``build_launches`` made for it);
* a ``CoordinatedPolicy`` that rolls the prefill and store roles together (seed 003 section 1.4: their
  transfer engines must run the same version), when the plan has stores.

A store's pod runs the same two processes as ``launch sglang``'s store scripts (``mooncake.py``): the
``mooncake_master`` container and the store service (the ``engine`` container, with the RDMA device), and a
Service per store (``rpc``, ``metrics`` and ``http`` ports) through which instances and the store service reach
its master: ``master_server_address`` in each instance's HiCache configuration and ``MOONCAKE_MASTER`` name the
Service. The Mooncake transfer engines reach each other at the address they register, the pod's IP
(``MOONCAKE_LOCAL_HOSTNAME`` from ``status.podIP``, which SGLang and the store service prefer to the plan's node
name); the engines then move KV between pod IPs, so the pods should run on the host network (the fabric's
``host_network``) for RDMA.

Every prefill, decode and store pod asks for one RDMA device (``K8sOptions.rdma_resource``, else the
fabric's ``rdma_resource``, else ``rdma/hca_shared_devices_a``, the shared-HCA device plugin's
example name) and gets ``IPC_LOCK``. Each decode pod has a required pod affinity to its rack's store
on the rack label (``--rack-label``; ``kubernetes.io/hostname`` for a node without a rack, which is
its own rack) and depends on that store role, so RBG creates it after the store.

Host memory: the plan binds each rank's host memory to its GPU's NUMA node (``host_numa``); the
command does it with ``numactl`` where the launch has it, and the pod carries the NUMA nodes and KV
NICs as annotations. Kubernetes itself can only align a Guaranteed pod's CPUs and memory with the
devices it allocates (Topology Manager ``single-numa-node`` with the Memory Manager's ``Static``
policy); it cannot be told which NUMA node, and GPUs claimed through DRA give it no NUMA hint. A
warning says so when ``--cpu``/``--memory`` are not given (the pods are then not Guaranteed).

An instance that spans nodes (a 405B model at TP8 x PP2, say) is a role with RBG's ``leaderWorkerPattern``
(``size`` = its nodes; ``restartPolicy: RecreateRoleInstanceOnPodRestart``: its ranks cannot outlive one
pod). Every pod of it runs the one entrypoint of a multi-node LeaderWorkerSet pod (``k8s_pod.pod_template``): it
finds its node (``$NODE_NAME``) among the instance's and runs that node's SGLang command from
``build_launches``, with its ``--nnodes`` and ``--node-rank``. The two patches pin the pods: the leader
(``leaderTemplatePatch``, labelled ``toposched.io/leader``) to the node of rank 0, the workers
(``workerTemplatePatch``) to the other nodes, with a pod anti-affinity that keeps two pods of the instance off
one node; with DRA each side has its own claim template, as a LeaderWorkerSet's leader and workers do. Both
patches hold only maps and whole lists (node selector terms, resource claims), so they read the same as a
JSON merge patch or a strategic merge patch. The instance's Service is headless
(``clusterIP: None``, ``publishNotReadyAddresses``) and selects the leader only, so its name resolves to the
leader pod's own address before the server is up: ``--dist-init-addr`` names it (SGLang binds its
rendezvous and scheduler sockets and runs a prefill instance's bootstrap server at that host, and the
workers connect there), and so does the router. RBG's own variables for the leader's address are not used:
the RBG source was not at hand to say what it injects (``checks/engines/crd_schemas.py`` transcribes its
types, not its controller).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from toposched.binding import mooncake
from toposched.binding.k8s import K8sOutput, claim_for, ordered_launches, placement_warnings
from toposched.binding.k8s_affinity import HOSTNAME, Requirement, node_requirements
from toposched.binding.k8s_compute_domain import (
    CHANNEL_CLAIM,
    channel_template_name,
    claim_channel,
    compute_domain,
    spans_one_clique,
)
from toposched.binding.k8s_configmap import entrypoints_to_configmap
from toposched.binding.k8s_dra import CLAIM, GpuIds, choose_gpu_request, claim_warning
from toposched.binding.k8s_entrypoint import exec_line, kubelet_escape
from toposched.binding.k8s_options import (
    LABEL_PLACEMENT,
    LABEL_REQUEST,
    MANAGED_BY,
    K8sOptions,
    Obj,
    check_k8s_node_names,
    dns_name,
    label_value,
    object_metadata,
)
from toposched.binding.k8s_pod import CONTAINER, container_resources, pod_template
from toposched.binding.k8s_rbg import coordinated_policy, role_based_group_object, standalone_role
from toposched.binding.k8s_schedulers import apply_scheduler
from toposched.binding.node_launch import NodeLaunch, PortBook
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError
from toposched.solver.request import Placement

DEFAULT_RDMA_RESOURCE = "rdma/hca_shared_devices_a"
"""The resource name of the k8s-rdma-shared-dev-plugin's example config; ``--rdma-resource`` overrides it."""
MASTER_CONTAINER = "mooncake-master"
EXTRA_CONFIG_FLAG = "--hicache-storage-backend-extra-config"
DIST_INIT_FLAG = "--dist-init-addr"

LABEL_ROLE = "toposched.io/role"
LABEL_LEADER = "toposched.io/leader"
"""On the leader pod of a multi-node instance (node rank 0), which its Service selects."""
ANNOTATION_KV_NICS = "toposched.io/kv-nics"
ANNOTATION_HOST_NUMA = "toposched.io/host-numa"


def _pod_ip_env() -> Obj:
    """The address a pod's Mooncake transfer engine registers (read by SGLang's store client and the store service)."""
    return {"name": "MOONCAKE_LOCAL_HOSTNAME", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def rdma_resource(doc: PlanDoc, opts: K8sOptions) -> str:
    """The RDMA resource every KV-moving pod asks for: the option's, the fabric's, or the shared-HCA default."""
    fabric = doc.cluster.fabric
    return opts.rdma_resource or (fabric.rdma_resource if fabric is not None else None) or DEFAULT_RDMA_RESOURCE


def _rack_key(doc: PlanDoc, node: str, opts: K8sOptions) -> tuple[str, str]:
    """(topology key, value) of the node's rack: a node without a rack label is its own rack."""
    rack = doc.cluster.node(node).rack
    return (opts.rack_label, rack) if rack is not None else (HOSTNAME, node)


def _store_of(doc: PlanDoc, node: str, opts: K8sOptions) -> int:
    """The index of the store in the rack of ``node`` (the planner puts one in every rack decode uses)."""
    want = _rack_key(doc, node, opts)
    for i, store in enumerate(doc.stores):
        if _rack_key(doc, store.node, opts) == want:
            return i
    raise InputError(f"no KV-cache store in the rack of decode node {node}; the plan's stores do not match its decode")


def _role_names(prefix: str, count: int) -> list[str]:
    """``prefill`` for one instance, ``prefill-0`` ... for several (as ``render_roles`` names them)."""
    return [prefix] if count == 1 else [f"{prefix}-{i}" for i in range(count)]


def _service(
    name: str, ports: Sequence[tuple[str, int]], opts: K8sOptions, doc: PlanDoc, *, leader: bool = False
) -> Obj:
    """A ClusterIP Service named as the pod it selects (by its ``toposched.io/placement`` label); with ``leader``,
    a headless one for the leader pod of a multi-node instance: its name resolves to that pod's address, ready
    or not, which SGLang binds its rendezvous sockets to."""
    if not name[0].isalpha():  # a Service name is a DNS-1035 label
        raise InputError(f"Service name {name!r} must start with a letter", fix="use a --name-prefix that does")
    spec: Obj = {
        "selector": {LABEL_PLACEMENT: name, **({LABEL_LEADER: "true"} if leader else {})},
        "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports],
    }
    if leader:
        spec = {"clusterIP": "None", "publishNotReadyAddresses": True, **spec}
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_metadata(name, opts, doc), "spec": spec}


def _annotate_kv(template: Obj, p: Placement) -> None:
    """The plan's KV NICs and host NUMA nodes, rank order, for the sidecar and for people reading the pod."""
    notes = template["metadata"]["annotations"]
    notes[ANNOTATION_KV_NICS] = ",".join(p.kv_nics)
    notes[ANNOTATION_HOST_NUMA] = ",".join("" if n is None else str(n) for n in p.host_numa)


def _require(template: Obj, key: str, value: str) -> None:
    """Add ``key In (value)`` to the template's required node affinity (a missing label then says why)."""
    terms = template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    expressions = terms["nodeSelectorTerms"][0]["matchExpressions"]
    if not any(e["key"] == key for e in expressions):
        expressions.append(Requirement(key, "In", (value,)).expression())


def _plain_template(
    doc: PlanDoc,
    name: str,
    role: str,
    node: str,
    argv: Sequence[str],
    opts: K8sOptions,
    *,
    rdma: str | None,
    port: int | None = None,
) -> Obj:
    """A pod template without GPUs (router, store) pinned to its planned node."""
    container: Obj = {
        "name": CONTAINER,
        "image": opts.resolved_image(),
        "command": ["/bin/sh", "-c", kubelet_escape(exec_line(argv, None) + "\n")],
        "resources": container_resources({rdma: "1"} if rdma else {}, opts),
    }
    if port is not None:
        container["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    if rdma:
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    requirement = Requirement(HOSTNAME, "In", (node,)).expression()
    spec: Obj = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [requirement]}]
                }
            }
        },
        "containers": [container],
    }
    fabric = doc.cluster.fabric
    if rdma and fabric is not None and fabric.host_network:  # as the GPU pods (k8s_pod.pod_template)
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    return {
        "metadata": {
            "labels": {
                **MANAGED_BY,
                LABEL_REQUEST: label_value(doc.request.id),
                LABEL_PLACEMENT: name,
                LABEL_ROLE: role,
            },
            "annotations": {},  # not a placement: no ``toposched.io/placement`` for the extender or sidecar
        },
        "spec": spec,
    }


def _router(launched: dict[str, tuple[list[NodeLaunch], list[GpuIds]]], doc: PlanDoc) -> NodeLaunch:
    """The one launch that belongs to no placement and no store: the router ``build_launches`` adds."""
    ids = {p.id for p in doc.placements}
    extra = [
        launches
        for key, (launches, _) in launched.items()
        if key not in ids and not all(x.role == "store" for x in launches)
    ]
    if len(extra) != 1 or len(extra[0]) != 1 or extra[0][0].role != "router":
        raise InputError("the disaggregated plan's launches have no single router")
    return extra[0][0]


def _router_argv(router: NodeLaunch, services: dict[str, str]) -> list[str]:
    """The router's argv with every server URL (``http://NODE:PORT``) replaced by its Service's."""
    argv = [services.get(arg, arg) for arg in router.argv]
    left = [a for a in argv if a.startswith("http://") and a not in services.values()]
    if left:
        raise InputError(f"the router URL {left[0]} is not one of the plan's prefill or decode instances")
    return argv


def render_pd(doc: PlanDoc, group_name: str = "pd", opts: K8sOptions | None = None) -> K8sOutput:
    """Claim templates, Services, the RoleBasedGroup and the CoordinatedPolicy of a disaggregated plan."""
    opts = opts or K8sOptions(engine="sglang")
    if doc.disaggregation is None:
        raise InputError(
            "not a prefill/decode disaggregated plan", fix="make one with `toposched plan --pd-prefill N --pd-decode M`"
        )
    if opts.engine != "sglang":
        raise InputError(f"disaggregated plans run with SGLang only, not {opts.engine}", fix="pass --engine sglang")
    check_k8s_node_names(doc)
    group = dns_name(opts.name_prefix, group_name)
    rdma = rdma_resource(doc, opts)
    launched = ordered_launches(doc, opts)
    router = _router(launched, doc)
    mode, warnings = choose_gpu_request(
        opts.gpu_request, [i for p in doc.placements for i in launched[p.id][1]], opts.driver
    )
    names: dict[str, str] = {}
    for kind in ("prefill", "decode"):
        ids_of = [p.id for p in doc.placements if p.role == kind]
        names.update(zip(ids_of, _role_names(kind, len(ids_of)), strict=True))
    stores = _role_names("store", len(doc.stores))
    claims: list[Obj] = []
    services: list[Obj] = []
    roles: list[Obj] = []
    urls: dict[str, str] = {}
    endpoints = mooncake.book_stores(doc.stores, PortBook())  # as build_launches books them: before any instance
    masters: dict[str, str] = {}
    for e, role in zip(endpoints, stores, strict=True):
        pod = dns_name(group, role, limit=63)
        masters[e.master_address] = f"{pod}.{opts.namespace}.svc:{e.rpc_port}"
        ports = [("rpc", e.rpc_port), ("metrics", e.metrics_port), ("http", e.http_port)]
        services.append(_service(pod, ports, opts, doc))
    for p in doc.placements:
        launches, ids = launched[p.id]
        role = names[p.id]
        pod = dns_name(group, role, limit=63)
        address = f"{pod}.{opts.namespace}.svc"
        multi = len(launches) > 1
        launches = [_via_services(x, masters) for x in launches]
        if multi:
            launches = [_rendezvous_at(x, launches[0].node, address) for x in launches]
            warning = claim_warning(p.id, ids[1:]) if mode == "dra" else None
            warnings += [warning] if warning else []
        roles.append(_gpu_role(doc, p, launches, ids, group, role, opts, mode, rdma, claims, stores))
        # every pod here asks for an RDMA device (``rdma``), whatever the fabric says: not the plain plan's warning
        warnings += placement_warnings(doc, p, ids, mode, rdma=True)  # every pod here asks for an RDMA device
        head = launches[0]
        ports = [("http", head.port)] + ([("bootstrap", head.bootstrap_port)] if head.bootstrap_port else [])
        ports += [("rendezvous", head.dist_port)] if multi and head.dist_port else []
        services.append(_service(pod, ports, opts, doc, leader=multi))
        urls[f"http://{head.node}:{head.port}"] = f"http://{address}:{head.port}"
    runs = mooncake.store_launches(doc.request.id, endpoints)
    for i, e in enumerate(endpoints):
        roles.append(_store_role(doc, e, runs[2 * i : 2 * i + 2], stores[i], group, opts, rdma, masters))
    router_pod = dns_name(group, "router", limit=63)
    template = _plain_template(
        doc, router_pod, "router", router.node, _router_argv(router, urls), opts, rdma=None, port=router.port
    )
    roles.append(standalone_role("router", template))
    services.append(_service(router_pod, [("http", router.port)], opts, doc))
    objects = [*claims, *services, role_based_group_object(group, roles, opts, doc)]
    if stores:
        together = [names[p.id] for p in doc.placements if p.role == "prefill"]
        objects.append(coordinated_policy(group, [*together, *stores], opts, doc))
    if not (opts.cpu and opts.memory):
        warnings.append(
            "the pods have no --cpu and --memory (requests = limits), so they are not Guaranteed QoS: the kubelet's "
            "Topology Manager and Memory Manager align CPUs and memory with a NUMA node only for Guaranteed pods"
        )
    objects = apply_scheduler(objects, doc, opts)
    return K8sOutput(entrypoints_to_configmap(objects, doc, opts, group), warnings, mode)


def _gpu_role(
    doc: PlanDoc,
    p: Placement,
    launches: list[NodeLaunch],
    ids: list[GpuIds],
    group: str,
    role: str,
    opts: K8sOptions,
    mode: str,
    rdma: str,
    claims: list[Obj],
    stores: list[str],
) -> Obj:
    """The role of one prefill or decode instance; a decode pod needs its rack's store (pod affinity). An
    instance over several nodes is a leader/worker role (:func:`_leader_worker_role`)."""
    pod = dns_name(group, role, limit=63)
    multi = len(launches) > 1
    claim = (f"{pod}-leader-gpus" if multi else f"{pod}-gpus") if mode == "dra" else None
    if claim:
        claims.append(claim_for(doc, opts, claim, ids[:1] if multi else ids))
    template = pod_template(doc, p, launches, pod, opts, lws=False, claim=claim, ids=ids, rdma=rdma)
    template["metadata"]["labels"][LABEL_ROLE] = str(p.role)
    if any(EXTRA_CONFIG_FLAG in x.argv for x in launches):
        template["spec"]["containers"][0]["env"].append(_pod_ip_env())
    _annotate_kv(template, p)
    node = launches[0].node
    key, value = _rack_key(doc, node, opts)
    store = stores[_store_of(doc, node, opts)] if p.role == "decode" and doc.stores else None
    near = None
    if store is not None:
        near = {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {LABEL_PLACEMENT: dns_name(group, store, limit=63)}},
                    "topologyKey": key,
                }
            ]
        }
    dependencies = [store] if store is not None else []
    if multi:
        worker_claim = f"{pod}-worker-gpus" if mode == "dra" else None
        if worker_claim:
            claims.append(claim_for(doc, opts, worker_claim, ids[1:]))
        out = _leader_worker_role(
            doc, p, launches, role, template, opts, near, (key, value), worker_claim, dependencies
        )
        if spans_one_clique(doc, p):  # across trays of one NVLink domain: every pod claims an IMEX channel
            claims.append(compute_domain(pod, opts, doc))
            pattern = out["leaderWorkerPattern"]
            claim_channel(pattern["template"], pod)
            patched = pattern["workerTemplatePatch"]["spec"].get("resourceClaims")
            if patched is not None:  # the workers' patch replaces the list: the channel goes in it too
                patched.append({"name": CHANNEL_CLAIM, "resourceClaimTemplateName": channel_template_name(pod)})
        return out
    _require(template, key, value)
    if near is not None:
        template["spec"]["affinity"]["podAffinity"] = near
    return standalone_role(role, template, dependencies=dependencies)


def _node_affinity(doc: PlanDoc, p: Placement, nodes: Sequence[str], opts: K8sOptions) -> Obj:
    """Required node affinity for pods of ``p`` on ``nodes``: ``k8s_affinity.node_requirements`` and their racks."""
    expressions = [r.expression() for r in node_requirements(doc, p, nodes, opts)]
    racks = [doc.cluster.node(n).rack for n in nodes]
    if all(racks) and not any(e["key"] == opts.rack_label for e in expressions):
        expressions.append(Requirement(opts.rack_label, "In", tuple(sorted({str(r) for r in racks}))).expression())
    return {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": expressions}]}
    }


def _leader_worker_role(
    doc: PlanDoc,
    p: Placement,
    launches: Sequence[NodeLaunch],
    role: str,
    template: Obj,
    opts: K8sOptions,
    near: Obj | None,
    rack: tuple[str, str],
    worker_claim: str | None,
    dependencies: Sequence[str],
) -> Obj:
    """A role of RBG's ``leaderWorkerPattern``: ``template`` (every node's command, chosen by ``$NODE_NAME``) and
    patches that pin the leader to the node of rank 0 and the workers to the others. The store's pod affinity
    (``near``) goes to each side whose nodes all share the store's rack (the leader's always does)."""
    nodes = [x.node for x in launches]
    labels = template["metadata"]["labels"]
    template["spec"]["affinity"].setdefault(  # no two pods of the instance on one node
        "podAntiAffinity",
        {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {LABEL_PLACEMENT: labels[LABEL_PLACEMENT]}}, "topologyKey": HOSTNAME}
            ]
        },
    )
    leader: Obj = {"nodeAffinity": _node_affinity(doc, p, nodes[:1], opts)}
    worker: Obj = {"nodeAffinity": _node_affinity(doc, p, nodes[1:], opts)}
    if near is not None:
        leader["podAffinity"] = json.loads(json.dumps(near))  # a copy: YAML output must not need anchors
        if all(_rack_key(doc, n, opts) == rack for n in nodes[1:]):
            worker["podAffinity"] = json.loads(json.dumps(near))
    worker_spec: Obj = {"affinity": worker}
    if worker_claim is not None:
        worker_spec["resourceClaims"] = [{"name": CLAIM, "resourceClaimTemplateName": worker_claim}]
    out = standalone_role(role, template, dependencies=dependencies)
    del out["standalonePattern"]
    out["leaderWorkerPattern"] = {
        "size": len(launches),
        "restartPolicy": "RecreateRoleInstanceOnPodRestart",
        "template": template,
        "leaderTemplatePatch": {"metadata": {"labels": {LABEL_LEADER: "true"}}, "spec": {"affinity": leader}},
        "workerTemplatePatch": {"spec": worker_spec},
    }
    return out


def _rendezvous_at(launch: NodeLaunch, head: str, address: str) -> NodeLaunch:
    """One node of a multi-node instance with ``--dist-init-addr`` at the leader's Service instead of the head
    node's name (pods on the pod network cannot reach each other by node name)."""
    argv = list(launch.argv)
    if DIST_INIT_FLAG not in argv[:-1]:
        raise InputError(f"placement {launch.placement}: the node {launch.node} launch has no {DIST_INIT_FLAG}")
    i = argv.index(DIST_INIT_FLAG) + 1
    host, _, port = argv[i].rpartition(":")
    if host != head:
        raise InputError(f"placement {launch.placement}: {DIST_INIT_FLAG} {argv[i]} is not its head node {head}")
    argv[i] = f"{address}:{port}"
    return launch.model_copy(update={"argv": argv})


def _via_services(launch: NodeLaunch, masters: Mapping[str, str]) -> NodeLaunch:
    """An instance's launch whose HiCache configuration names its store's master by the store's Service."""
    argv = list(launch.argv)
    for i, arg in enumerate(argv[:-1]):
        if arg == EXTRA_CONFIG_FLAG:
            config = json.loads(argv[i + 1])
            address = config["master_server_address"]
            if address not in masters:
                raise InputError(f"placement {launch.placement}: the Mooncake master {address} is none of the plan's")
            argv[i + 1] = json.dumps({**config, "master_server_address": masters[address]}, separators=(",", ":"))
    return launch.model_copy(update={"argv": argv})


def _store_role(
    doc: PlanDoc,
    endpoint: mooncake.StoreEndpoint,
    runs: Sequence[NodeLaunch],
    role: str,
    group: str,
    opts: K8sOptions,
    rdma: str,
    masters: Mapping[str, str],
) -> Obj:
    """The role of one KV-cache store: its master and store service on its planned node (host memory and RDMA
    NICs, no GPUs), the commands of ``launch sglang``'s store scripts."""
    master, service = runs
    store = endpoint.store
    pod = dns_name(group, role, limit=63)
    template = _plain_template(doc, pod, "store", store.node, service.argv, opts, rdma=rdma, port=service.port)
    _require(template, *_rack_key(doc, store.node, opts))
    template["metadata"]["annotations"][ANNOTATION_KV_NICS] = ",".join(store.nics)
    env = {**service.env, "MOONCAKE_MASTER": masters[service.env["MOONCAKE_MASTER"]]}
    del env["MOONCAKE_LOCAL_HOSTNAME"]
    engine = template["spec"]["containers"][0]
    engine["env"] = [{"name": k, "value": v} for k, v in env.items()] + [_pod_ip_env()]
    engine["ports"] = [{"name": "http", "containerPort": service.port, "protocol": "TCP"}]
    template["spec"]["containers"].append(
        {
            "name": MASTER_CONTAINER,
            "image": opts.resolved_image(),
            "command": ["/bin/sh", "-c", kubelet_escape(exec_line(master.argv, None) + "\n")],
            "ports": [
                {"name": "rpc", "containerPort": endpoint.rpc_port, "protocol": "TCP"},
                {"name": "metrics", "containerPort": endpoint.metrics_port, "protocol": "TCP"},
            ],
        },
    )
    return standalone_role(role, template)
