"""Launch commands for vLLM and SGLang, with GPU selection, NUMA binding and NCCL settings.

Only flags and variables that exist in the pinned engines are emitted (../shared/reference/engines.md:
vLLM 0.33.0, SGLang 0.5.23, NCCL 2.30); ``VLLM_FLAGS`` / ``SGLANG_FLAGS`` / ``ENV_VARS`` list them
and a test fails on anything else.

* GPUs: ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA's numbering is the PCI order that ``nvidia-smi``
  uses, and ``CUDA_VISIBLE_DEVICES`` listing the node's GPUs in rank order (vLLM's worker *i* and
  SGLang's rank *i* take visible device *i*). UUIDs are used when the topology came from NVML.
* NUMA: when all of a node's GPUs sit in one NUMA node the command runs under
  ``numactl --cpunodebind=N --membind=N``; when they span several, vLLM binds each worker with
  ``--numa-bind --numa-bind-nodes`` (one NUMA node per rank) and SGLang runs unbound.
* NCCL: ``NCCL_IB_HCA`` lists (exactly, ``=``) the RDMA devices nearest the GPUs, only for
  multi-node instances; ``NCCL_SOCKET_IFNAME`` where the cluster spec names an interface;
  ``NCCL_CROSS_NIC=0`` on rail-optimised fabrics; ``NCCL_NET_GDR_LEVEL=PXB`` when every GPU has a NIC
  behind PCIe switches only (GPUDirect RDMA helps there), never the non-existent ``SYS_GUID``.
* Multi-node: vLLM ``--nnodes/--node-rank/--master-addr/--master-port`` with ``--headless`` on the
  others; SGLang ``--nnodes/--node-rank/--dist-init-addr``. The head is the node of rank 0; its
  name is used as the address unless one is given.

Scripts are safe to run whatever the plan said: ids and node names are checked by the rules of
``toposched.names`` (the plan reader and the topology model check them first; ``NodeLaunch`` checks
again), every value in a script is ``shlex``-quoted, and the one comment line carries only checked
names and numbers, never a raw newline.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from toposched.errors import InputError
from toposched.names import NodeName, PlacementId, check_node_name, node_name_problem, placement_id_problem
from toposched.solver.layout import layout_problem, node_blocks
from toposched.solver.request import Placement, PlacementRequest
from toposched.topology.domains import DomainMap, build_domain_map, gpu_ref
from toposched.topology.model import Cluster, LinkKind
from toposched.workload import resolve_model

Engine = Literal["vllm", "sglang"]

# Flags the emitter may use, each listed in reference/engines.md (section 1.1 for vLLM, section 2 and
# the LWS SGLang example for SGLang; --host/--port appear in the verbatim LWS examples).
VLLM_FLAGS = frozenset(
    {
        "--tensor-parallel-size", "--pipeline-parallel-size", "--enable-expert-parallel", "--nnodes",
        "--node-rank", "--master-addr", "--master-port", "--headless", "--numa-bind", "--numa-bind-nodes",
        "--gpu-memory-utilization", "--max-model-len", "--kv-cache-dtype", "--quantization",
        "--distributed-executor-backend", "--host", "--port",
    }
)  # fmt: skip
SGLANG_FLAGS = frozenset(
    {
        "--model-path", "--tp-size", "--pp-size", "--ep-size", "--nnodes", "--node-rank", "--dist-init-addr",
        "--kv-cache-dtype", "--host", "--port",
    }
)  # fmt: skip
ENV_VARS = frozenset(
    {
        "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_CROSS_NIC",
        "NCCL_NET_GDR_LEVEL", "VLLM_HOST_IP", "VLLM_RAY_BUNDLE_INDICES",
    }
)  # fmt: skip

# KV dtypes toposched plans with -> engine values (vLLM CacheDType; SGLang fields/model.py choices).
_VLLM_KV = {"auto": "auto", "fp8": "fp8", "int8": "int8_per_token_head", "int4": "int4_per_token_head"}
_SGLANG_KV = {"auto": "auto", "fp8": "fp8_e4m3"}
VLLM_MASTER_PORT = 29501  # vLLM's --master-port default (engines.md 1.1)
SGLANG_DIST_PORT = 20000  # the port of the LWS SGLang example (engines.md section 2)


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
    port: int


MAX_MODEL_ARG = 4096
"""Longest model name or path written into a launch (PATH_MAX on Linux)."""


def check_model_arg(value: str, what: str = "model") -> str:
    """``value`` if it can be the engine's model argument: printable text (no newline, no NUL), not too long."""
    if len(value) > MAX_MODEL_ARG or not value.isprintable():
        shown = repr(value[:40]) + ("..." if len(value) > 40 else "")
        raise InputError(
            f"{what} {shown} is not a catalog name or a path: "
            + (
                f"longer than {MAX_MODEL_ARG} characters" if len(value) > MAX_MODEL_ARG else "it has control characters"
            ),
            fix="use a catalog model name or the path of a config.json",
        )
    return value


def engine_model_id(ref: str) -> str:
    """What the engine loads: the Hugging Face id of a catalog model, or the folder of a config.json."""
    check_model_arg(ref)
    path = Path(ref).expanduser()
    try:
        if path.exists():
            return str(path.parent if path.is_file() else path)
    except OSError as exc:
        raise InputError(f"model path {ref[:60]!r} cannot be read: {exc.strerror}") from None
    return resolve_model(ref).hf_id or ref


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


def _nccl_env(cluster: Cluster, dmap: DomainMap, node: str, gpus: Sequence[int], multi_node: bool) -> dict[str, str]:
    env: dict[str, str] = {}
    n = next(x for x in cluster.nodes if x.name == node)
    fabric = cluster.fabric
    if fabric is not None and fabric.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = "=" + fabric.socket_ifname
    if not multi_node:
        return env
    device_of = {nic.name: nic.device for nic in n.nics}
    nearest = [nic for g in gpus for nic in dmap.nearest_nics.get(gpu_ref(node, g), ())]
    devices = list(dict.fromkeys(device_of[nic] for nic in nearest if device_of.get(nic)))
    # A nearest NIC without a device name (a capture whose NIC legend was cut) would drop out of the
    # list; a short NCCL_IB_HCA silently narrows NCCL to a subset of the rails, so set none and let
    # NCCL use every HCA (the parser warned about the missing legend entries).
    unnamed = any(not device_of.get(nic) for nic in nearest)
    if devices and not unnamed and (fabric is None or fabric.kind in ("IB", "ROCE")):
        env["NCCL_IB_HCA"] = "=" + ",".join(devices)
        kinds = [min((nl.kind.rank for nl in n.nic_links if nl.gpu == g), default=LinkKind.SYS.rank) for g in gpus]
        if kinds and max(kinds) <= LinkKind.PXB.rank:
            env["NCCL_NET_GDR_LEVEL"] = "PXB"
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
    dmap = build_domain_map(cluster)
    nodes = {n.name: n for n in cluster.nodes}
    model = check_model_arg(model_path, "--model-path") if model_path else engine_model_id(request.model)
    if use_uuids is None:
        use_uuids = all(n.source == "nvml" for n in cluster.nodes)
    launches: list[NodeLaunch] = []
    ports: dict[str, int] = {}
    for p in doc_placements:
        groups = _node_groups(p)
        head = master_addr or groups[0][0]
        port = max((ports.get(n, base_port) for n, _ in groups), default=base_port)
        for n, _ in groups:
            ports[n] = port + 1
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
            if engine == "vllm":
                argv = _vllm(p, request, model, len(groups), node_rank, head, numas, single_numa, port)
            else:
                argv = _sglang(p, request, model, len(groups), node_rank, head, port)
            launches.append(
                NodeLaunch(
                    placement=p.id, node=node, engine=engine, node_rank=node_rank, nnodes=len(groups), env=env,
                    argv=prefix + argv, gpus=gpus, gpu_ids=ids, numa_nodes=numas, port=port,
                )
            )  # fmt: skip
    return launches


def _vllm(
    p: Placement,
    request: PlacementRequest,
    model: str,
    nnodes: int,
    node_rank: int,
    head: str,
    numas: list[int | None],
    single_numa: int | None,
    port: int,
) -> list[str]:
    argv = _vllm_core(p, request, model)
    if single_numa is None and all(n is not None for n in numas) and len(set(numas)) > 1:
        argv += ["--numa-bind", "--numa-bind-nodes", *[str(n) for n in numas]]
    if nnodes > 1:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", head]
        argv += ["--master-port", str(VLLM_MASTER_PORT)]
        if node_rank > 0:
            argv.append("--headless")
    argv += ["--host", "0.0.0.0", "--port", str(port)]
    return argv


def _vllm_core(p: Placement, request: PlacementRequest, model: str) -> list[str]:
    """``vllm serve`` with the degrees, context and dtypes: what every executor's command shares."""
    argv = ["vllm", "serve", model, "--tensor-parallel-size", str(p.tp), "--pipeline-parallel-size", str(p.pp)]
    if p.ep > 1:
        argv.append("--enable-expert-parallel")
    argv += ["--max-model-len", str(request.max_model_len), "--gpu-memory-utilization", "0.92"]
    if p.kv_dtype != "auto":
        argv += ["--kv-cache-dtype", _VLLM_KV[p.kv_dtype]]
    if request.weight_dtype == "fp8":
        argv += ["--quantization", "fp8"]
    return argv


def vllm_ray_argv(
    p: Placement, request: PlacementRequest, *, model_path: str | None = None, port: int = 8000
) -> list[str]:
    """The one driver command of vLLM's Ray executor: the placement group chooses the GPUs, so there is
    no numactl, no per-rank NUMA binding and none of the mp backend's multi-node flags."""
    model = check_model_arg(model_path, "--model-path") if model_path else engine_model_id(request.model)
    return [
        *_vllm_core(p, request, model),
        "--distributed-executor-backend",
        "ray",
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
    ]


def _sglang(
    p: Placement, request: PlacementRequest, model: str, nnodes: int, node_rank: int, head: str, port: int
) -> list[str]:
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", model]
    argv += ["--tp-size", str(p.tp), "--pp-size", str(p.pp)]
    if p.ep > 1:
        argv += ["--ep-size", str(p.ep)]
    if p.kv_dtype != "auto":
        if p.kv_dtype not in _SGLANG_KV:
            raise InputError(
                f"placement {p.id} needs a {p.kv_dtype} KV cache, which SGLang 0.5.23 does not offer",
                fix="plan with --kv-dtype fp8 or use --engine vllm",
            )
        argv += ["--kv-cache-dtype", _SGLANG_KV[p.kv_dtype]]
    if nnodes > 1:
        argv += [
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node_rank),
            "--dist-init-addr",
            f"{head}:{SGLANG_DIST_PORT}",
        ]
    argv += ["--host", "0.0.0.0", "--port", str(port)]
    return argv


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
    lines += [f"export {k}={shlex.quote(v)}" for k, v in launch.env.items()]
    lines.append("exec " + " ".join(shlex.quote(a) for a in launch.argv))
    return "\n".join(lines) + "\n"
