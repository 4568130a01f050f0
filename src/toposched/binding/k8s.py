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
  NVLink), the request's node selector, racks and zones. ``node_requirements`` is the one place that
  decides these, so ``lint_nodes`` checks exactly what the scheduler will.
* GPUs are pinned through Dynamic Resource Allocation whenever the plan knows real bus ids or UUIDs
  (``k8s_dra.py``: a ``ResourceClaimTemplate`` per pod template, one request per rank); otherwise,
  or with ``gpu_request="device-plugin"``, pods ask for ``nvidia.com/gpu: N`` and a warning says the
  plan is only preferred there (presets and ``nvidia-smi topo -m`` captures have no real ids).
* Multi-node pods get what NCCL over RDMA needs: ``IPC_LOCK``, the cluster's RDMA resource
  (``fabric.rdma_resource``) and, if asked, the host network (``fabric.host_network``).
* The container runs ``/bin/sh -c ENTRYPOINT``: the script finds the planned GPUs among those the
  container sees by PCI bus id or UUID (``nvidia-smi --query-gpu=pci.bus_id,uuid``), never by
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
"""

from __future__ import annotations

import hashlib
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

# ``node_setup`` is what ``build_launches`` gives each node (GPUs, NCCL variables, numactl): an mpirun launch carries
# it only inside its argv, and the pods of a multi-node TensorRT-LLM instance need it per node.
from toposched.binding.engine_args import POD_GRACE_S
from toposched.binding.engines import Engine, NodeLaunch, build_launches, is_file_arg, node_setup, plain_file_name
from toposched.binding.k8s_dra import (
    GPU_REQUESTS,
    GpuIds,
    GpuRequest,
    choose_gpu_request,
    claim_template,
    claim_warning,
    gpu_ids,
    nodes_text,
    pod_claim,
    repeated_uuids,
    under_one_pcie_root,
)
from toposched.binding.k8s_dra import normalise_bus_id as normalise_bus_id  # re-exported
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError, first_problem
from toposched.solver.layout import node_blocks
from toposched.solver.request import Placement
from toposched.topology.domains import build_domain_map
from toposched.topology.model import Cluster, ResourceName

Obj = dict[str, Any]

# The vLLM image tag follows the `vllm/vllm-openai:v0.8.5` form of the LWS example (engines.md 4),
# pinned to the engine version whose flags the emitter uses (vLLM 0.33.0, engines.md 1).
DEFAULT_IMAGES: dict[Engine, str | None] = {"vllm": "vllm/vllm-openai:v0.33.0", "sglang": None, "trtllm": None}
FILES_DIR = "/tmp/toposched"
"""Where a pod's entrypoint writes the files its command reads (TensorRT-LLM's options YAML)."""
_HEREDOC_END = "TOPOSCHED_EOF"
HOSTNAME = "kubernetes.io/hostname"
ZONE = "topology.kubernetes.io/zone"
GPU_PRODUCT = "nvidia.com/gpu.product"
GPU_CLIQUE = "nvidia.com/gpu.clique"
GPU_RESOURCE = "nvidia.com/gpu"
# Kubernetes has no well-known rack label; this is toposched's own, overridable with --rack-label.
DEFAULT_RACK_LABEL = "toposched.io/rack"
LABEL_PLACEMENT = "toposched.io/placement"
ANNOTATION_PLACEMENT = "toposched.io/placement"
"""The pod annotation holding the exact placement id (labels hold a DNS-1123 name derived from it)."""
LABEL_REQUEST = "toposched.io/request"
MANAGED_BY = {"app.kubernetes.io/managed-by": "toposched"}
CONTAINER = "engine"
_GFD_CLIQUE = re.compile(r"^[0-9a-fA-F-]{36}[./]\d+$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MPI_RANK_COMMAND = "trtllm-llmapi-launch"
"""The first word of what every rank of a multi-node TensorRT-LLM instance runs (after ``numactl``)."""
MPI_SSH_PORT = 2222
"""The workers' sshd port for the first multi-node TensorRT-LLM placement of a plan, one more for each next
one (pods on the host network share their node's ports); not 22, which a host's own sshd may hold."""
MPI_SSH_DIR = "/etc/toposched/mpi-ssh"
"""Where the Secret's key pair is mounted (the leader gets ``ssh-privatekey``, the workers ``ssh-publickey``)."""
MPI_WAIT_S = 600
"""How long the leader waits for each worker's sshd before it gives up (image pulls take minutes)."""


@dataclass(frozen=True)
class K8sOptions:
    """How to render a plan for Kubernetes."""

    engine: Engine = "vllm"
    image: str | None = None
    """Container image; None takes the engine's pinned default (vLLM only)."""
    namespace: str = "default"
    name_prefix: str = "toposched"
    model_path: str | None = None
    """Model path/id inside the container (default: the request's model)."""
    rack_label: str = DEFAULT_RACK_LABEL
    shm_size: str | None = None
    """sizeLimit of the /dev/shm emptyDir (memory-backed; counts against the pod's memory)."""
    cpu: str | None = None
    """CPU request = limit (Guaranteed QoS, needed for exclusive CPUs under the static CPU manager)."""
    memory: str | None = None
    """Memory request = limit."""
    gpu_request: GpuRequest = "auto"
    """How pods get their GPUs: DRA claims, ``nvidia.com/gpu`` from the device plugin, or auto (DRA when pinnable)."""
    rdma_resource: str | None = None
    """RDMA resource of a disaggregated plan's pods (None: the fabric's, else ``rdma/hca_shared_devices_a``)."""
    mpi_ssh_secret: str | None = None
    """Secret with ``ssh-privatekey`` and ``ssh-publickey`` through which a multi-node TensorRT-LLM leader's
    mpirun reaches the worker pods (None: ``NAME_PREFIX-mpi-ssh``)."""

    def __post_init__(self) -> None:
        if self.gpu_request not in GPU_REQUESTS:
            raise InputError(f"--gpu-request {self.gpu_request!r} is not one of {', '.join(GPU_REQUESTS)}")
        if self.mpi_ssh_secret is not None and not (
            len(self.mpi_ssh_secret) <= 253 and _DNS_SUBDOMAIN.match(self.mpi_ssh_secret)
        ):
            raise InputError(
                f"--ssh-secret {self.mpi_ssh_secret[:80]!r} is not a Secret name",
                fix="use lower-case letters, digits, '-' and '.' (a DNS subdomain), e.g. llm-mpi-ssh",
            )
        if self.rdma_resource is not None:
            try:
                TypeAdapter(ResourceName).validate_python(self.rdma_resource)
            except ValidationError as exc:
                raise InputError(f"--rdma-resource: {first_problem(exc).msg}") from None

    def ssh_secret(self) -> str:
        """The Secret a multi-node TensorRT-LLM instance's pods take their ssh key pair from."""
        return self.mpi_ssh_secret or dns_name(self.name_prefix, "mpi-ssh", limit=253)

    def resolved_image(self) -> str:
        image = self.image or DEFAULT_IMAGES[self.engine]
        if not image:
            raise InputError(f"no default image for {self.engine}", fix="pass --image with a pinned tag")
        return image


@dataclass(frozen=True)
class Requirement:
    """One node-affinity match expression."""

    key: str
    operator: Literal["In", "Exists"]
    values: tuple[str, ...] = ()

    def expression(self) -> Obj:
        expr: Obj = {"key": self.key, "operator": self.operator}
        if self.operator == "In":
            expr["values"] = list(self.values)
        return expr

    def check(self, labels: Mapping[str, str]) -> str | None:
        """Why a node with these labels fails this requirement, or None."""
        if self.key not in labels:
            return f"no label {self.key}"
        if self.operator == "In" and labels[self.key] not in self.values:
            return f"{self.key}={labels[self.key]} is not one of {', '.join(self.values)}"
        return None


def dns_name(*parts: str, limit: int = 52) -> str:
    """A DNS-1123 label from free text (LWS appends group and worker indices, so keep it short). A text longer
    than ``limit`` is cut and ends with 8 hex digits of a hash of the whole text, so two ids that differ only
    after the cut still name two objects."""
    joined = "-".join(parts)
    text = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]+", "-", joined.lower())).strip("-")
    if len(text) > limit:
        digest = hashlib.sha256(joined.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        text = text[: limit - 9].rstrip("-") + "-" + digest
    if not text:
        raise InputError(f"cannot make a Kubernetes name from {parts!r}")
    return text


def label_value(text: str) -> str:
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63].strip("-_.")
    return value or "none"


def gfd_product(model: str) -> str:
    """The ``nvidia.com/gpu.product`` value GFD writes for a GPU name (spaces become '-', engines.md 6.1)."""
    return "-".join(model.split())


def _node_clique(cluster: Cluster, node: str) -> tuple[str, str | None] | None:
    """(clique id, GFD label value or None when unknown) for a node in a multi-node NVLink clique."""
    labels = cluster.node(node).labels
    for clique in cluster.cliques:
        if node in clique.nodes:
            if GPU_CLIQUE in labels:
                return clique.id, labels[GPU_CLIQUE]
            if _GFD_CLIQUE.match(clique.id):
                return clique.id, clique.id.replace("/", ".")
            return clique.id, None
    return None


def node_requirements(doc: PlanDoc, placement: Placement, nodes: Sequence[str], opts: K8sOptions) -> list[Requirement]:
    """The node-affinity expressions of a pod template that may run on any of ``nodes``."""
    cluster, request = doc.cluster, doc.request
    reqs = [Requirement(HOSTNAME, "In", tuple(nodes))]
    models = sorted({cluster.node(r.node).gpu(r.gpu).model or "" for r in placement.ranks if r.node in nodes} - {""})
    if models:
        reqs.append(Requirement(GPU_PRODUCT, "In", tuple(gfd_product(m) for m in models)))
    placement_nodes = {r.node for r in placement.ranks}
    cliques = {_node_clique(cluster, n) for n in placement_nodes}
    clique = next(iter(cliques)) if len(placement_nodes) > 1 and len(cliques) == 1 else None
    if clique is not None:
        value = clique[1]
        reqs.append(Requirement(GPU_CLIQUE, "In", (value,)) if value else Requirement(GPU_CLIQUE, "Exists"))
    for key, value in sorted(request.node_selector.items()):
        reqs.append(Requirement(key, "In", (value,)))
    for label, wanted, attr in ((opts.rack_label, request.racks, "rack"), (ZONE, request.zones, "zone")):
        if wanted:
            have = sorted({getattr(cluster.node(n), attr) for n in nodes} - {None})
            reqs.append(Requirement(label, "In", tuple(have or wanted)))
    return reqs


def _sh(value: str) -> str:
    return shlex.quote(value)


def exec_line(argv: Sequence[str], leader_flag: str | None, files: Mapping[str, str] | None = None) -> str:
    """The exec line; the value after ``leader_flag`` becomes the LWS leader address, and a file of the
    launch its path under ``FILES_DIR``."""
    return "exec " + _words(argv, leader_flag, files)


def _words(argv: Sequence[str], leader_flag: str | None, files: Mapping[str, str] | None) -> str:
    """``argv`` as shell words (see :func:`exec_line`)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if files and is_file_arg(arg, argv[i - 1] if i else "", files):
            out.append(_sh(f"{FILES_DIR}/{arg}"))
        elif leader_flag and i > 0 and argv[i - 1] == leader_flag:
            port = arg.rsplit(":", 1)[1] if ":" in arg else None
            out.append('"$LWS_LEADER_ADDRESS' + (f":{int(port)}" if port else "") + '"')
        else:
            out.append(_sh(arg))
    return " ".join(out)


def _file_lines(files: Mapping[str, str], *, mkdir: bool = True) -> list[str]:
    """Shell lines that write the launch's files under ``FILES_DIR`` (quoted here-documents: no expansion).

    The files come from serialisers fed with numbers, fixed words and checked names; a line equal to the
    end marker could still end the document early, so it is refused.
    """
    if not files:
        return []
    lines = [f"    mkdir -p {FILES_DIR}"] if mkdir else []
    for name, text in files.items():
        if _HEREDOC_END in text.splitlines() or "$" in text:
            raise InputError(f"file {name[:60]!r} of the launch cannot be written by the pod's entrypoint")
        lines += [f"    cat > {_sh(f'{FILES_DIR}/{name}')} <<'{_HEREDOC_END}'", *text.splitlines(), _HEREDOC_END]
    return lines


_SELECT = r"""select_gpus() {
  kind=$1; shift; sel=""
  seen=$(nvidia-smi --query-gpu=pci.bus_id,uuid --format=csv,noheader)
  for want in "$@"; do
    got=$(printf '%s\n' "$seen" | awk -F', *' -v k="$kind" -v w="$want" \
      '(k == "bus" && toupper($1) == toupper(w)) || (k == "uuid" && $2 == w) { print $2; exit }')
    if [ -z "$got" ]; then
      echo "toposched: planned GPU $want ($kind) is not visible in this container; visible: $seen" >&2
      exit 1
    fi
    sel="${sel:+$sel,}$got"
  done
  CUDA_VISIBLE_DEVICES=$sel
  export CUDA_VISIBLE_DEVICES
}"""


_UNPINNED = (
    "echo 'toposched: the plan has no real GPU ids for this node (a preset or an nvidia-smi topo -m capture): "
    "running on the GPUs the device plugin gave, without the NUMA binding of the plan unless it has the whole node' >&2"
)


def unpinned_argv(doc: PlanDoc, launch: NodeLaunch, ids: GpuIds) -> list[str]:
    """The launch's command for a pod: as planned, except that a pod whose GPUs cannot be pinned (no real
    ids) and that takes only part of its node runs without the plan's NUMA binding (``numactl``, vLLM's
    ``--numa-bind``): the device plugin may give it GPUs of the other socket."""
    argv = list(launch.argv)
    if ids.pinned or len(launch.gpus) >= len(doc.cluster.node(launch.node).gpus):
        return argv
    if argv and argv[0] == "numactl":
        argv = argv[next(i for i, a in enumerate(argv) if i > 0 and not a.startswith("--")) :]
    if "--numa-bind-nodes" in argv:
        at = argv.index("--numa-bind-nodes")
        end = next((i for i in range(at + 1, len(argv)) if argv[i].startswith("--")), len(argv))
        del argv[at:end]
    return [a for a in argv if a != "--numa-bind"]


def _select_line(ids: GpuIds) -> str:
    """How the entrypoint picks the planned GPUs: by UUID, by bus id, or (no real ids) not at all."""
    if ids.uuids is not None:
        return "select_gpus uuid " + " ".join(_sh(i) for i in ids.uuids)
    if ids.bus_ids is not None:
        return "select_gpus bus " + " ".join(_sh(i) for i in ids.bus_ids)
    return _UNPINNED


def shared_env(launches: Sequence[NodeLaunch]) -> dict[str, str]:
    """The variables every one of ``launches`` sets to the same value (they go into the container's ``env``)."""
    return {k: v for k, v in launches[0].env.items() if all(x.env.get(k) == v for x in launches)}


def _node_exports(launch: NodeLaunch, shared: Mapping[str, str]) -> list[str]:
    """``export`` lines for the variables only this node's launch has (e.g. its own ``NCCL_IB_HCA``), each
    value in single quotes (``shlex.quote`` leaves ``=mlx5_0`` bare, which shellcheck reads as ``==``)."""
    own = {k: v for k, v in launch.env.items() if k not in shared and k != "CUDA_VISIBLE_DEVICES"}  # selected here
    bad = next((k for k in own if not _ENV_NAME.match(k)), None)
    if bad is not None:
        raise InputError(f"launch for node {launch.node}: {bad[:60]!r} is not an environment variable name")
    return [f"    export {k}='" + v.replace("'", "'\"'\"'") + "'" for k, v in own.items()]


def entrypoint(doc: PlanDoc, launches: Sequence[NodeLaunch], *, lws: bool, ids: Sequence[GpuIds] | None = None) -> str:
    """The ``/bin/sh -c`` script (before kubelet escaping) for pods that may run on these nodes.

    ``ids`` are the launches' GPU ids (:func:`gpu_ids`), computed here when not given.
    """
    if is_mpi(launches[0]):
        return mpi_entrypoint(doc, launches, ids=ids)
    lines = ["set -eu", "export CUDA_DEVICE_ORDER=PCI_BUS_ID", _SELECT, 'case "$NODE_NAME" in']
    shared = shared_env(launches)
    for launch, pod_ids in zip(launches, ids or _ids(doc, launches), strict=True):
        leader_flag = None
        if lws:
            leader_flag = "--master-addr" if launch.engine == "vllm" else "--dist-init-addr"
        lines += [
            f"  {_sh(launch.node)})",
            f"    {_select_line(pod_ids)}",
            *_node_exports(launch, shared),
            *_file_lines(launch.files),
            f"    {exec_line(unpinned_argv(doc, launch, pod_ids), leader_flag, launch.files)}",
            "    ;;",
        ]
    return "\n".join(_node_case(launches, lines)) + "\n"


def _node_case(launches: Sequence[NodeLaunch], lines: list[str]) -> list[str]:
    """``lines`` (from ``set -eu`` to the last node's branch) with ``planned=`` and the other-node branch."""
    planned = _sh(" ".join(launch.node for launch in launches))
    return [
        lines[0],
        f"planned={planned}",
        *lines[1:],
        '  *) echo "toposched: node $NODE_NAME is not one this pod was planned for ($planned)" >&2; exit 1 ;;',
        "esac",
    ]


# --- TensorRT-LLM over several pods: mpirun over ssh ----------------------------------------------


def is_mpi(launch: NodeLaunch) -> bool:
    """Whether ``launch`` is one node of a multi-node TensorRT-LLM instance (its ranks started by mpirun)."""
    return launch.engine == "trtllm" and bool(launch.hosts)


def mpi_ssh_port(doc: PlanDoc, placement: str) -> int:
    """The workers' sshd port of ``placement``: one per placement of the plan, from ``MPI_SSH_PORT``."""
    return MPI_SSH_PORT + [p.id for p in doc.placements].index(placement)


def _rank_wrapper(launch: NodeLaunch) -> list[str]:
    """Shell lines that write ``FILES_DIR/rank``: what mpirun starts on this node for each rank.

    Ranks that mpirun starts over ssh do not inherit the pod's environment, so the wrapper reads it
    back (``pod.env``, written by ``export -p`` once the GPUs are selected) and runs the rank under the
    node's ``numactl``.
    """
    prefix = launch.argv[: launch.argv.index(MPI_RANK_COMMAND)]
    run = " ".join(["exec", *(_sh(a) for a in prefix), '"$@"'])
    return [
        f"    cat > {FILES_DIR}/rank <<'{_HEREDOC_END}'",
        "#!/bin/sh",
        f". {FILES_DIR}/pod.env",
        run,
        _HEREDOC_END,
    ]


def _mpi_worker_tail(port: int) -> list[str]:
    """A worker pod: publish its node name and environment, then run sshd in the foreground for mpirun."""
    ssh = f"{FILES_DIR}/ssh"
    return [
        'if [ "$(id -u)" != 0 ]; then',
        '  echo "toposched: an MPI worker runs sshd as root; this container runs as uid $(id -u)" >&2',
        "  exit 1",
        "fi",
        f"printf '%s\\n' \"$NODE_NAME\" > {FILES_DIR}/node",
        f"export -p > {FILES_DIR}/pod.env",
        f"chmod 755 {FILES_DIR}/rank",
        "sshd=/usr/sbin/sshd",
        "if command -v sshd > /dev/null 2>&1; then sshd=$(command -v sshd); fi",
        'if [ ! -x "$sshd" ]; then',
        '  echo "toposched: the image has no sshd: mpirun on the leader starts the ranks of this pod over ssh; '
        'use an image with openssh-server" >&2',
        "  exit 1",
        "fi",
        f"mkdir -p {ssh} /run/sshd",
        f"chmod 700 {ssh}",
        f"rm -f {ssh}/host_ed25519 {ssh}/host_ed25519.pub",
        f"ssh-keygen -q -t ed25519 -N '' -f {ssh}/host_ed25519",
        f"cat > {ssh}/sshd_config <<'{_HEREDOC_END}'",
        f"Port {int(port)}",
        f"HostKey {ssh}/host_ed25519",
        f"AuthorizedKeysFile {MPI_SSH_DIR}/ssh-publickey",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        "StrictModes no",
        "UsePAM no",
        f"PidFile {ssh}/sshd.pid",
        _HEREDOC_END,
        f'exec "$sshd" -D -e -f {ssh}/sshd_config',
    ]


def _mpi_leader_tail(launch: NodeLaunch, port: int) -> list[str]:
    """The leader pod: find each worker pod's node over ssh, write the hostfile in the plan's node order,
    and start every rank with mpirun (``G`` per node, the leader's first)."""
    ssh = f"{FILES_DIR}/ssh"
    g, nodes = len(launch.gpus), launch.hosts
    hostfile = f"{FILES_DIR}/{plain_file_name(launch.placement, '.hostfile')}"
    ranks = launch.argv[launch.argv.index(MPI_RANK_COMMAND) :]
    mpirun = [
        '"$mpirun"', "--allow-run-as-root", "--prefix", '"${mpirun%/bin/*}"', "-np", str(g * len(nodes)),
        "--hostfile", hostfile, "--map-by", f"ppr:{g}:node", "--bind-to", "none",
        "--mca", "plm_rsh_args", _sh(f"-F {ssh}/ssh_config"), f"{FILES_DIR}/rank", _words(ranks, None, launch.files),
    ]  # fmt: skip
    return [
        f"export -p > {FILES_DIR}/pod.env",
        f"chmod 755 {FILES_DIR}/rank",
        f"mkdir -p {ssh}",
        f"chmod 700 {ssh}",
        f"cat > {ssh}/ssh_config <<'{_HEREDOC_END}'",
        "Host *",
        f"  Port {int(port)}",
        f"  IdentityFile {MPI_SSH_DIR}/ssh-privatekey",
        "  IdentitiesOnly yes",
        "  StrictHostKeyChecking no",
        "  UserKnownHostsFile /dev/null",
        "  BatchMode yes",
        "  ConnectTimeout 5",
        "  LogLevel ERROR",
        _HEREDOC_END,
        f'if [ "${{LWS_GROUP_SIZE:-}}" != {len(nodes)} ]; then',
        f'  echo "toposched: this LeaderWorkerSet group has ${{LWS_GROUP_SIZE:-no}} pods; the plan has {len(nodes)} '
        'nodes" >&2',
        "  exit 1",
        "fi",
        # Workers are the pods NAME-GROUP-INDEX beside the leader NAME-GROUP in the same subdomain.
        "lead=${LWS_LEADER_ADDRESS%%.*}",
        "domain=${LWS_LEADER_ADDRESS#*.}",
        f": > {FILES_DIR}/workers",
        "i=1",
        f'while [ "$i" -lt {len(nodes)} ]; do',
        '  host="$lead-$i.$domain"',
        "  waited=0",
        f'  until node=$(ssh -F {ssh}/ssh_config "$host" cat {FILES_DIR}/node 2> /dev/null); do',
        f'    if [ "$waited" -ge {MPI_WAIT_S} ]; then',
        f'      echo "toposched: worker $host did not answer ssh on port {int(port)} in {MPI_WAIT_S} s: is its sshd '
        f'up, with the key pair of the same Secret?" >&2',
        "      exit 1",
        "    fi",
        "    sleep 5",
        "    waited=$((waited + 5))",
        "  done",
        # mpirun gets the pod's IP address: Open MPI cuts host names at the first dot, and the short name
        # of a worker pod does not resolve (its record is under the LWS subdomain, not in the search path).
        "  addr=$(getent hosts \"$host\" | awk '{ print $1; exit }')",
        f'  printf \'%s %s\\n\' "$node" "${{addr:-$host}}" >> {FILES_DIR}/workers',
        "  i=$((i + 1))",
        "done",
        "host_of() {",
        f"  host=$(awk -v n=\"$1\" '$1 == n {{ print $2; exit }}' {FILES_DIR}/workers)",
        '  if [ -z "$host" ]; then',
        f"    echo \"toposched: no worker pod runs on planned node $1; workers: $(tr '\\n' ' ' < "
        f'{FILES_DIR}/workers)" >&2',
        "    exit 1",
        "  fi",
        f'  echo "$host slots={g}"',
        "}",
        "{",
        f"  echo 'localhost slots={g}'",
        *(f"  host_of {_sh(n)}" for n in nodes[1:]),
        f"}} > {hostfile}",
        "if ! mpirun=$(command -v mpirun); then",
        '  echo "toposched: the image has no mpirun (Open MPI): the leader starts every rank with it" >&2',
        "  exit 1",
        "fi",
        "exec " + " ".join(mpirun),
    ]


def mpi_entrypoint(doc: PlanDoc, launches: Sequence[NodeLaunch], *, ids: Sequence[GpuIds] | None = None) -> str:
    """The script of a multi-node TensorRT-LLM pod: the leader's (``launches`` is the node of rank 0) or the
    workers' (the other nodes). Each node's branch selects its GPUs and writes its rank wrapper; the leader
    also writes the options YAML, then runs mpirun; a worker runs sshd."""
    lines = ["set -eu", "export CUDA_DEVICE_ORDER=PCI_BUS_ID", _SELECT, 'case "$NODE_NAME" in']
    shared = shared_env(launches)
    for launch, pod_ids in zip(launches, ids or _ids(doc, launches), strict=True):
        lines += [
            f"  {_sh(launch.node)})",
            f"    {_select_line(pod_ids)}",
            *_node_exports(launch, shared),
            f"    mkdir -p {FILES_DIR}",
            *_rank_wrapper(launch.model_copy(update={"argv": unpinned_argv(doc, launch, pod_ids)})),
            *_file_lines(launch.files, mkdir=False),
            "    ;;",
        ]
    lines = _node_case(launches, lines)
    port = mpi_ssh_port(doc, launches[0].placement)
    leader = launches[0].node_rank == 0
    lines += _mpi_leader_tail(launches[0], port) if leader else _mpi_worker_tail(port)
    return "\n".join(lines) + "\n"


def kubelet_escape(script: str) -> str:
    """Double every ``$`` so the kubelet's ``$(VAR)`` expansion of ``command`` leaves the script as is."""
    return script.replace("$", "$$")


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
        "volumes": [{"name": "dshm", "emptyDir": empty_dir}],
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


def object_metadata(name: str, opts: K8sOptions, doc: PlanDoc) -> Obj:
    return {
        "name": name,
        "namespace": opts.namespace,
        "labels": {**MANAGED_BY, LABEL_REQUEST: label_value(doc.request.id)},
    }


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
    ids = ids or _ids(doc, launches)
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


def _ids(doc: PlanDoc, launches: Sequence[NodeLaunch], repeated: frozenset[str] | None = None) -> list[GpuIds]:
    """The GPU ids of each launch (``repeated``: the cluster's repeated UUIDs, found here when not given)."""
    seen = repeated_uuids(doc.cluster) if repeated is None else repeated
    return [gpu_ids(doc.cluster.node(launch.node), launch.gpus, seen) for launch in launches]


def ordered_launches(doc: PlanDoc, opts: K8sOptions) -> dict[str, tuple[list[NodeLaunch], list[GpuIds]]]:
    """Per placement: its launches in node-rank order and their GPU ids."""
    repeated = repeated_uuids(doc.cluster)
    out: dict[str, tuple[list[NodeLaunch], list[GpuIds]]] = {}
    for placement, launches in _launches(doc, opts).items():
        ordered = sorted(launches, key=lambda x: x.node_rank)
        out[placement] = (ordered, _ids(doc, ordered, repeated))
    return out


def claim_for(doc: PlanDoc, opts: K8sOptions, name: str, pods: Sequence[GpuIds]) -> Obj:
    """The ResourceClaimTemplate ``name`` for pods with these GPUs (one pod per node)."""
    root = all(under_one_pcie_root(doc.cluster.node(x.node), x.gpus) for x in pods)
    return claim_template(name, object_metadata(name, opts, doc), pods, pcie_root=root)


def container_resources(resources: dict[str, str], opts: K8sOptions) -> Obj:
    """A container's ``resources``: ``resources`` (GPUs, RDMA devices) plus ``--cpu``/``--memory``, as equal
    limits and requests (a Guaranteed pod when both are given); empty when there is nothing to ask for."""
    wanted = {
        **resources,
        **({"cpu": opts.cpu} if opts.cpu else {}),
        **({"memory": opts.memory} if opts.memory else {}),
    }
    return {"limits": dict(wanted), "requests": dict(wanted)} if wanted else {}


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
    if len(nodes) > 1 and one_clique:
        warnings.append(
            f"placement {placement.id} spans {len(nodes)} nodes of one multi-node NVLink domain, but its pods get "
            "no IMEX channel: NCCL uses multi-node NVLink only inside a working IMEX domain (in Kubernetes a "
            "ComputeDomain of the NVIDIA DRA driver, whose channel claim the pods take); toposched does not emit "
            "one, so create a ComputeDomain and add its channel's resourceClaimTemplate to these pods, or NCCL "
            "falls back to the network between the trays"
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
    mode, warnings = choose_gpu_request(opts.gpu_request, [i for _, ids in ordered.values() for i in ids])
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
            objects.append(leader_worker_set(doc, p, launches, opts, claims=pair, ids=ids))
            warnings += [mpi_warning(doc, p.id, opts)] if is_mpi(launches[0]) else []
        warnings += placement_warnings(doc, p, ids, mode)
    return K8sOutput(claims + objects, warnings, mode)


def _check_plain(doc: PlanDoc) -> None:
    """Deployments, LWS and ``--roles`` groups run plain instances; a disaggregated plan has its own group."""
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
    mode, warnings = choose_gpu_request(opts.gpu_request, everyone)
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
    return K8sOutput([*claims, rbg, coordinated_policy(group, names, opts, first)], warnings, mode)


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
