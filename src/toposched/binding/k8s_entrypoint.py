"""The ``/bin/sh -c`` entrypoint of a pod: it selects the planned GPUs by PCI bus id or UUID, exports the node's
variables, writes the launch's files and execs the plan's command; the pods of a multi-node TensorRT-LLM
instance run the leader's ``mpirun`` over ssh or a worker's ``sshd`` (``mpi_entrypoint``)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from toposched.binding.k8s_dra import GpuIds, gpu_ids, repeated_uuids
from toposched.binding.launch_script import is_file_arg
from toposched.binding.node_launch import NodeLaunch, plain_file_name
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError

FILES_DIR = "/tmp/toposched"
"""Where a pod's entrypoint writes the files its command reads (TensorRT-LLM's options YAML)."""
_HEREDOC_END = "TOPOSCHED_EOF"
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
    for launch, pod_ids in zip(launches, ids or launch_gpu_ids(doc, launches), strict=True):
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
    for launch, pod_ids in zip(launches, ids or launch_gpu_ids(doc, launches), strict=True):
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


def launch_gpu_ids(
    doc: PlanDoc, launches: Sequence[NodeLaunch], repeated: frozenset[str] | None = None
) -> list[GpuIds]:
    """The GPU ids of each launch (``repeated``: the cluster's repeated UUIDs, found here when not given)."""
    seen = repeated_uuids(doc.cluster) if repeated is None else repeated
    return [gpu_ids(doc.cluster.node(launch.node), launch.gpus, seen) for launch in launches]
