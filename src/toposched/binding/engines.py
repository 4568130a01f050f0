"""Launches for vLLM and SGLang: per node, the command, the GPUs, NUMA binding, NCCL settings and ports.

What each engine is told to serve (model, degrees, memory plan, dtypes) is ``engine_args.py``; this
module adds what depends on where the ranks run. Only variables that exist in the pinned engines and
NCCL 2.30 are set (``ENV_VARS``, each in ../shared/reference/engines.md).

* **GPUs**: ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA's numbering is the PCI order that ``nvidia-smi``
  uses, and ``CUDA_VISIBLE_DEVICES`` listing the node's GPUs in rank order (vLLM's worker *i* and
  SGLang's rank *i* take visible device *i*). UUIDs are used when the topology came from NVML.
* **NUMA**: when all of a node's GPUs sit in one NUMA node the command runs under
  ``numactl --cpunodebind=N --membind=N``; when they span several, vLLM binds each worker with
  ``--numa-bind --numa-bind-nodes`` (one NUMA node per rank) and SGLang runs unbound.
* **NCCL**: ``NCCL_IB_HCA`` lists (exactly, ``=``) the RDMA devices nearest the GPUs, only for
  multi-node instances; ``NCCL_SOCKET_IFNAME`` is the cluster spec's value as written (NCCL's own
  syntax: ``eth`` prefix, ``=eth0`` exact, ``^docker,lo`` exclude); ``NCCL_CROSS_NIC=0`` on
  rail-optimised fabrics. ``NCCL_NET_GDR_LEVEL`` is left to NCCL (see ``_nccl_env``).
* **Multi-node**: vLLM ``--nnodes/--node-rank/--master-addr/--master-port`` with ``--headless`` on
  the others; SGLang ``--nnodes/--node-rank/--dist-init-addr``. The head is the node of rank 0; its
  name is used as the address unless one is given.
* **Ports**: every port an instance binds (the server's ``--port``, the rendezvous port of a
  multi-node instance) is unique on each of its nodes across the whole plan (``PortBook``), so two
  instances whose heads share a node, or pods on the host network, never collide.

Scripts are safe to run whatever the plan said: ids and node names are checked by the rules of
``toposched.names`` (the plan reader and the topology model check them first; ``NodeLaunch`` checks
again), every value in a script is quoted (environment values always, in single quotes), and the one
comment line carries only checked names and numbers, never a raw newline.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from toposched.binding.engine_args import (
    SGLANG_FLAGS,
    VLLM_FLAGS,
    Engine,
    check_model_arg,
    checkpoint_of,
    serve_settings,
    served_model,
    sglang_serve_argv,
    vllm_serve_argv,
)
from toposched.errors import InputError
from toposched.names import NodeName, PlacementId, check_node_name, node_name_problem, placement_id_problem
from toposched.solver.layout import layout_problem, node_blocks
from toposched.solver.request import Placement, PlacementRequest
from toposched.topology.domains import DomainMap, build_domain_map, gpu_ref
from toposched.topology.model import Cluster

__all__ = ["ENV_VARS", "SGLANG_FLAGS", "VLLM_FLAGS", "Engine", "NodeLaunch", "build_launches", "shell_script"]

ENV_VARS = frozenset(
    {
        "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_CROSS_NIC",
        "VLLM_HOST_IP", "VLLM_RAY_BUNDLE_INDICES",
    }
)  # fmt: skip

VLLM_MASTER_PORT = 29501  # vLLM's --master-port default (engines.md 1.1): the first one tried
SGLANG_DIST_PORT = 20000  # the port of the LWS SGLang example (engines.md section 2): the first one tried
MAX_PORT = 65535


class NodeLaunch(BaseModel):
    """What runs on one node for one placement; the placement id and node name are checked names."""

    model_config = ConfigDict(frozen=True)

    placement: PlacementId
    node: NodeName
    engine: Engine
    node_rank: int
    nnodes: int
    env: dict[str, str]
    argv: list[str] = Field(description="the full command, including any numactl prefix")
    gpus: list[int] = Field(description="GPU indices on this node, in rank order")
    gpu_ids: list[str] = Field(description="what CUDA_VISIBLE_DEVICES lists (indices or UUIDs)")
    numa_nodes: list[int | None]
    port: int = Field(description="the server's --port (bound on the head node)")
    dist_port: int | None = Field(
        default=None, description="the multi-node rendezvous port (vLLM --master-port, SGLang --dist-init-addr)"
    )


def _node_groups(p: Placement) -> list[tuple[str, list[int]]]:
    """Nodes in rank order with their GPUs in rank order; the layout must be one engines can launch."""
    problem = placement_id_problem(p.id)
    if problem:
        raise InputError(problem, fix="placement ids come from the request id: letters, digits, '.', '_', '-'")
    for r in p.ranks:
        check_node_name(r.node, source=f"placement {p.id}")
    if p.tp < 1 or p.pp < 1 or len(p.ranks) != p.tp * p.pp:
        raise InputError(f"placement {p.id}: {len(p.ranks)} ranks for tp={p.tp} x pp={p.pp}")
    problem = layout_problem(p.ranks, p.tp)
    if problem:
        raise InputError(f"placement {p.id}: {problem}")
    return node_blocks(p.ranks)


class PortBook:
    """Ports taken on each node by the launches of one plan: each new port is free on all its nodes.

    A port is booked on every node of the instance that takes it, not only the head that binds it: a
    LeaderWorkerSet pod on the host network (or an engine that starts its server on another rank) then
    still finds it free.
    """

    def __init__(self) -> None:
        self._used: dict[str, set[int]] = {}

    def take(self, nodes: Sequence[str], first: int, what: str) -> int:
        port = first
        while any(port in self._used.get(n, ()) for n in nodes):
            port += 1
        if not 1 <= port <= MAX_PORT:
            raise InputError(
                f"no free {what} port from {first} to {MAX_PORT} on {', '.join(nodes[:3])}",
                fix="pass a lower --port" if what == "server" else "launch fewer instances on these nodes",
            )
        for n in nodes:
            self._used.setdefault(n, set()).add(port)
        return port


def _nccl_env(cluster: Cluster, dmap: DomainMap, node: str, gpus: Sequence[int], multi_node: bool) -> dict[str, str]:
    env: dict[str, str] = {}
    n = cluster.node(node)
    fabric = cluster.fabric
    if fabric is not None and fabric.socket_ifname:
        # The operator's NCCL syntax as written (topology/model.py checks it): a prefix here must stay a
        # prefix and '^docker,lo' an exclusion, which an added '=' would turn into exact names.
        env["NCCL_SOCKET_IFNAME"] = fabric.socket_ifname
    if not multi_node:
        return env
    device_of = {nic.name: nic.device for nic in n.nics}
    nearest = [nic for g in gpus for nic in dmap.nearest_nics.get(gpu_ref(node, g), ())]
    devices = list(dict.fromkeys(d for nic in nearest if (d := device_of.get(nic))))
    # A nearest NIC without a device name (a capture whose NIC legend was cut) would drop out of the
    # list; a short NCCL_IB_HCA silently narrows NCCL to a subset of the rails, so set none and let
    # NCCL use every HCA (the parser warned about the missing legend entries).
    unnamed = any(not device_of.get(nic) for nic in nearest)
    if devices and not unnamed and (fabric is None or fabric.kind in ("IB", "ROCE")):
        env["NCCL_IB_HCA"] = "=" + ",".join(devices)
    # NCCL_NET_GDR_LEVEL is left to NCCL: PXB is NCCL's own default distance for GPUDirect RDMA on PCIe
    # hosts, so setting it gains nothing there, and on Grace hosts (GB200) the GPU reaches the NIC over
    # C2C, a path NCCL ranks beyond PXB (engines.md section 7: LOC, NVL, NVB, C2C, PIX, PXB, P2C, ...;
    # NCCL_NET_GDR_C2C defaults to 1 since 2.27), so PXB would turn GPUDirect RDMA off there.
    if fabric is not None and fabric.rail_optimized:
        env["NCCL_CROSS_NIC"] = "0"
    return env


def build_launches(
    doc_placements: Sequence[Placement],
    request: PlacementRequest,
    cluster: Cluster,
    engine: Engine,
    *,
    model_path: str | None = None,
    master_addr: str | None = None,
    base_port: int = 8000,
    use_uuids: bool | None = None,
) -> list[NodeLaunch]:
    """One ``NodeLaunch`` per placement and node."""
    if not 1 <= base_port <= MAX_PORT:
        raise InputError(f"--port {base_port} is not a port (1 to {MAX_PORT})")
    dmap = build_domain_map(cluster)
    nodes = {n.name: n for n in cluster.nodes}
    model = check_model_arg(model_path, "--model-path") if model_path else served_model(request.model)
    checkpoint = checkpoint_of(request, model_path)
    if use_uuids is None:
        use_uuids = all(n.source == "nvml" for n in cluster.nodes)
    launches: list[NodeLaunch] = []
    ports = PortBook()
    for p in doc_placements:
        groups = _node_groups(p)
        settings = serve_settings(p, request, model, checkpoint)
        core = vllm_serve_argv(settings) if engine == "vllm" else sglang_serve_argv(settings)
        head = master_addr or groups[0][0]
        group_nodes = [n for n, _ in groups]
        port = ports.take(group_nodes, base_port, "server")
        dist_port = None
        if len(groups) > 1:
            first = VLLM_MASTER_PORT if engine == "vllm" else SGLANG_DIST_PORT
            dist_port = ports.take(group_nodes, first, "rendezvous")
        for node_rank, (node, gpus) in enumerate(groups):
            numas = [nodes[node].gpu(g).numa_node for g in gpus]
            ids = [nodes[node].gpu(g).uuid or str(g) if use_uuids else str(g) for g in gpus]
            env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(ids)}
            env.update(_nccl_env(cluster, dmap, node, gpus, len(groups) > 1))
            single_numa = numas[0] if len(set(numas)) == 1 and numas[0] is not None else None
            prefix = (
                ["numactl", f"--cpunodebind={single_numa}", f"--membind={single_numa}"]
                if single_numa is not None
                else []
            )
            argv = list(core)
            if engine == "vllm":
                if single_numa is None and all(n is not None for n in numas) and len(set(numas)) > 1:
                    argv += ["--numa-bind", "--numa-bind-nodes", *[str(n) for n in numas]]
                if dist_port is not None:
                    argv += ["--nnodes", str(len(groups)), "--node-rank", str(node_rank), "--master-addr", head]
                    argv += ["--master-port", str(dist_port)]
                    if node_rank > 0:
                        argv.append("--headless")
            elif dist_port is not None:
                argv += ["--nnodes", str(len(groups)), "--node-rank", str(node_rank)]
                argv += ["--dist-init-addr", f"{head}:{dist_port}"]
            argv += ["--host", "0.0.0.0", "--port", str(port)]
            launches.append(
                NodeLaunch(
                    placement=p.id, node=node, engine=engine, node_rank=node_rank, nnodes=len(groups), env=env,
                    argv=prefix + argv, gpus=gpus, gpu_ids=ids, numa_nodes=numas, port=port, dist_port=dist_port,
                )
            )  # fmt: skip
    return launches


def vllm_ray_argv(
    p: Placement, request: PlacementRequest, *, model_path: str | None = None, port: int = 8000
) -> list[str]:
    """The one driver command of vLLM's Ray executor: the placement group chooses the GPUs, so there is
    no numactl, no per-rank NUMA binding and none of the mp backend's multi-node flags."""
    model = check_model_arg(model_path, "--model-path") if model_path else served_model(request.model)
    settings = serve_settings(p, request, model, checkpoint_of(request, model_path))
    return [
        *vllm_serve_argv(settings),
        "--distributed-executor-backend",
        "ray",
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
    ]


def _quoted(value: str) -> str:
    """``value`` in single quotes, always (``shlex.quote`` leaves ``=mlx5_0`` bare, which shellcheck
    reads as a mistyped ``==``, SC1097)."""
    return "'" + value.replace("'", "'\"'\"'") + "'"


def shell_script(launch: NodeLaunch) -> str:
    """A script for one node; every value is shell-quoted, so nothing in a plan or a model path can execute.

    The comment line names the placement and node, which ``NodeLaunch`` has checked (no newline, no
    shell syntax); they are checked again here so a hand-built launch cannot slip a line in.
    """
    problem = placement_id_problem(launch.placement) or node_name_problem(launch.node)
    if problem:
        raise InputError(f"launch script: {problem}")
    bad = sorted(k for k in launch.env if k not in ENV_VARS)
    if bad:
        raise InputError(f"launch script: environment variable {bad[0]!r} is not one toposched writes")
    lines = [
        "#!/usr/bin/env bash",
        f"# toposched launch: placement {shlex.quote(launch.placement)}, node {shlex.quote(launch.node)} "
        f"(rank {int(launch.node_rank)} of {int(launch.nnodes)}), engine {shlex.quote(launch.engine)}",
        "set -euo pipefail",
    ]
    lines += [f"export {k}={_quoted(v)}" for k, v in launch.env.items()]
    lines.append("exec " + " ".join(shlex.quote(a) for a in launch.argv))
    return "\n".join(lines) + "\n"
