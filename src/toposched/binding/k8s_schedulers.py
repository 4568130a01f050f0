"""The plan handed to the cluster's own scheduler: KAI Scheduler, Kueue or Volcano (``launch k8s --scheduler``;
issue 36).

toposched decides which GPUs each instance gets and pins its pods there (node affinity, DRA claims); the
cluster's scheduler keeps what it is for: gang admission, queues, quotas and preemption. Each instance is one
gang, never admitted in part: all pods of a Deployment, a LeaderWorkerSet group (every rank of a TP x PP
group), or a whole RoleBasedGroup (a prefill/decode set). Each gang also carries the topology level all its
pods share (one node, one multi-node NVLink clique, one rack, one zone), so the scheduler's topology check
agrees with the plan instead of fighting it. What each scheduler reads (``tests/data/reference/k8s/``,
reference/k8s/README.md summary 1):

* ``kai``: a ``PodGroup`` (``scheduling.run.ai/v2alpha2``) per gang, ``minMember`` = its pods, ``queue``, and
  ``topologyConstraint`` {``topology``: the cluster's ``Topology`` object, ``requiredTopologyLevel``: the
  node label of the shared level}; the pods carry ``schedulerName: kai-scheduler``, the label
  ``kai.scheduler/queue`` and the annotation ``pod-group-name`` that joins them to the PodGroup. The
  ``Topology`` (cluster-scoped, the administrator's) must list the label as a level (docs/kubernetes.md has
  one that matches toposched's labels).
* ``kueue`` (Topology Aware Scheduling): the label ``kueue.x-k8s.io/queue-name`` on the Deployment or
  LeaderWorkerSet, and on each pod template ``kueue.x-k8s.io/podset-required-topology`` = the shared level
  (a LeaderWorkerSet's leader and workers also share ``kueue.x-k8s.io/podset-group-name``, so they are fitted
  into one domain together). Kueue has no RoleBasedGroup integration: such output is refused.
* ``volcano``: a ``PodGroup`` (``scheduling.volcano.sh/v1beta1``) per gang with ``minMember``, ``queue`` and
  ``networkTopology`` {``mode: hard``, ``highestTierAllowed``: 1 inside a rack, 2 inside a zone; none on one
  node}, HyperNode tiers as Volcano's guide builds them (tier 1 the rack's switch); the pods carry
  ``schedulerName: volcano`` and the annotation ``scheduling.k8s.io/group-name``.
"""

from __future__ import annotations

from collections.abc import Iterator

from toposched.binding.k8s_affinity import GPU_CLIQUE, HOSTNAME, ZONE
from toposched.binding.k8s_options import (
    ANNOTATION_PLACEMENT,
    SCHEDULER_NAMES,
    K8sOptions,
    Obj,
    dns_name,
    object_metadata,
)
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError

SCHEDULERS = SCHEDULER_NAMES
DEFAULT_QUEUES: dict[str, str] = {"kai": "default-queue", "kueue": "user-queue", "volcano": "default"}
"""The queue a gang joins when ``--queue`` is not given: KAI's quickstart queue, Kueue's LocalQueue of its
examples, Volcano's default queue."""
KAI_TOPOLOGY = "cluster-topology"
"""The KAI ``Topology`` object the PodGroups name (``--scheduler-topology``), as in KAI's topology guide."""
KAI_SCHEDULER, VOLCANO_SCHEDULER = "kai-scheduler", "volcano"
KAI_QUEUE_LABEL, KAI_GROUP_ANNOTATION = "kai.scheduler/queue", "pod-group-name"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_REQUIRED = "kueue.x-k8s.io/podset-required-topology"
KUEUE_GROUP = "kueue.x-k8s.io/podset-group-name"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
WORKLOADS = ("Deployment", "LeaderWorkerSet", "RoleBasedGroup")


def _templates(obj: Obj) -> Iterator[tuple[Obj, int]]:
    """The pod templates of a workload and how many pods each makes."""
    spec = obj["spec"]
    if obj["kind"] == "Deployment":
        yield spec["template"], int(spec.get("replicas", 1))
    elif obj["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        groups = int(spec.get("replicas", 1))
        yield lwt["leaderTemplate"], groups
        yield lwt["workerTemplate"], groups * (int(lwt["size"]) - 1)
    else:  # RoleBasedGroup
        for role in spec["roles"]:
            replicas = int(role.get("replicas", 1))
            if "standalonePattern" in role:
                yield role["standalonePattern"]["template"], replicas
            else:
                pattern = role["leaderWorkerPattern"]
                yield pattern["template"], replicas * int(pattern["size"])


def shared_level(doc: PlanDoc, nodes: set[str], opts: K8sOptions) -> tuple[str | None, int | None]:
    """(node label, Volcano tier) of the smallest topology level holding all ``nodes``; (None, None) if none."""
    if len(nodes) == 1:
        return HOSTNAME, None
    if any(nodes <= set(c.nodes) for c in doc.cluster.cliques):
        return GPU_CLIQUE, 1
    known = [doc.cluster.node(n) for n in nodes]
    if all(n.rack for n in known) and len({n.rack for n in known}) == 1:
        return opts.rack_label, 1
    if all(n.zone for n in known) and len({n.zone for n in known}) == 1:
        return ZONE, 2
    return None, None


def _gang_nodes(doc: PlanDoc, obj: Obj) -> set[str]:
    ids = {t["metadata"].get("annotations", {}).get(ANNOTATION_PLACEMENT) for t, _ in _templates(obj)}
    return {r.node for p in doc.placements if p.id in ids for r in p.ranks}


def apply_scheduler(objects: list[Obj], doc: PlanDoc, opts: K8sOptions) -> list[Obj]:
    """``objects`` with what ``opts.scheduler`` reads: gang objects first, fields on the workloads' pods."""
    scheduler = opts.scheduler
    if scheduler == "default":
        return objects
    queue = opts.queue or DEFAULT_QUEUES[scheduler]
    groups: list[Obj] = []
    for obj in objects:
        if obj["kind"] not in WORKLOADS:
            continue
        pods = sum(n for _, n in _templates(obj))
        label, tier = shared_level(doc, _gang_nodes(doc, obj), opts)
        name = dns_name(str(obj["metadata"]["name"]), "gang", limit=253)
        if scheduler == "kueue":
            if obj["kind"] == "RoleBasedGroup":
                raise InputError(
                    "Kueue has no RoleBasedGroup integration: a prefill/decode set or --roles output cannot be "
                    "queued by Kueue as one gang",
                    fix="use --scheduler kai or --scheduler volcano, or launch the instances as separate plans",
                )
            obj["metadata"].setdefault("labels", {})[KUEUE_QUEUE_LABEL] = queue
        for template, _count in _templates(obj):
            meta, spec = template["metadata"], template["spec"]
            annotations = meta.setdefault("annotations", {})
            if scheduler == "kai":
                spec["schedulerName"] = KAI_SCHEDULER
                meta.setdefault("labels", {})[KAI_QUEUE_LABEL] = queue
                annotations[KAI_GROUP_ANNOTATION] = name
            elif scheduler == "volcano":
                spec["schedulerName"] = VOLCANO_SCHEDULER
                annotations[VOLCANO_GROUP_ANNOTATION] = name
            else:
                if label is not None:
                    annotations[KUEUE_REQUIRED] = label
                if obj["kind"] == "LeaderWorkerSet":
                    annotations[KUEUE_GROUP] = name
        if scheduler == "kai":
            kai_spec: Obj = {"minMember": pods, "queue": queue}
            if label is not None:
                kai_spec["topologyConstraint"] = {"topology": opts.scheduler_topology, "requiredTopologyLevel": label}
            groups.append(_group("scheduling.run.ai/v2alpha2", name, opts, doc, kai_spec))
        elif scheduler == "volcano":
            vc_spec: Obj = {"minMember": pods, "queue": queue}
            if tier is not None:
                vc_spec["networkTopology"] = {"mode": "hard", "highestTierAllowed": tier}
            groups.append(_group("scheduling.volcano.sh/v1beta1", name, opts, doc, vc_spec))
    return [*groups, *objects]


def _group(api: str, name: str, opts: K8sOptions, doc: PlanDoc, spec: Obj) -> Obj:
    return {"apiVersion": api, "kind": "PodGroup", "metadata": object_metadata(name, opts, doc), "spec": spec}


__all__ = ["SCHEDULERS", "apply_scheduler", "shared_level"]
