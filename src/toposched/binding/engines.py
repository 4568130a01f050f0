"""Launches for vLLM, SGLang and TensorRT-LLM: per node, the command, the GPUs, NUMA binding, NCCL
settings and ports.

What each engine is told to serve (model, degrees, memory plan, dtypes) is ``engine_args.py``; this
module adds what depends on where the ranks run. Only variables that exist in the pinned engines and
NCCL 2.30 are set (``ENV_VARS``, each in tests/data/reference/engines.md).

* **GPUs**: ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA's numbering is the PCI order that ``nvidia-smi``
  uses, and ``CUDA_VISIBLE_DEVICES`` listing the node's GPUs in rank order (vLLM's worker *i* and
  SGLang's rank *i* take visible device *i*). UUIDs are used when the topology came from NVML.
* **NUMA**: when all of a node's GPUs sit in one NUMA node the command runs under
  ``numactl --cpunodebind=N --membind=N``; when they span several, vLLM binds each worker with
  ``--numa-bind --numa-bind-nodes`` (one NUMA node per rank) and SGLang and TensorRT-LLM run unbound.
* **NCCL**: ``NCCL_IB_HCA`` lists (exactly, ``=``) the RDMA devices nearest the GPUs, only for
  multi-node instances; ``NCCL_SOCKET_IFNAME`` is the cluster spec's value as written (NCCL's own
  syntax: ``eth`` prefix, ``=eth0`` exact, ``^docker,lo`` exclude); ``NCCL_CROSS_NIC=0`` on
  rail-optimised fabrics. ``NCCL_NET_GDR_LEVEL`` is left to NCCL (see ``_nccl_env``).
* **Multi-node**: vLLM ``--nnodes/--node-rank/--master-addr/--master-port`` with ``--headless`` on
  the others; SGLang ``--nnodes/--node-rank/--dist-init-addr``. The head is the node of rank 0; its
  name is used as the address unless one is given. TensorRT-LLM runs its ranks as MPI processes, so
  a multi-node instance is one command on the head (``_trtllm_launch``): ``mpirun`` over a hostfile of
  the plan's nodes (``NODE slots=G``, rank order), the node's variables exported and forwarded with
  ``-x``, ``trtllm-llmapi-launch trtllm-serve ... --gpus_per_node G``; when the nodes differ in GPUs,
  NUMA binding or NICs, one MPMD context per node (``-np G --host NODE:G -x VAR=VALUE ... :``). Every
  node holds the same number of ranks (``layout_problem``), as TensorRT-LLM needs: it puts rank r on
  local GPU r % gpus_per_node.
  Where the nodes are alike there is also an ``srun`` form for Slurm (``srun_argv``).
* **Files**: TensorRT-LLM reads an LLM-API options YAML (``--config``) and mpirun a hostfile; both
  are ``files`` of the launch, written next to its script and named in the argv by file name after
  ``--config`` / ``--hostfile`` (the script turns the name into a path beside itself).
* **Ports**: every port an instance binds (the server's ``--port``, the rendezvous port of a
  multi-node instance, a prefill instance's bootstrap port) is unique on each of its nodes across the
  whole plan (``PortBook``), so two instances whose heads share a node, or pods on the host network,
  never collide.
* **Prefill/decode disaggregation** (``solver/pd.py``), SGLang: each instance runs with
  ``--disaggregation-mode prefill|decode``, ``--disaggregation-transfer-backend mooncake`` and
  ``--disaggregation-ib-device`` from its ranks' ``kv_nics`` (one device when the node's ranks share
  it, else SGLang's per-GPU JSON mapping keyed by visible GPU index); prefill instances also get a
  ``--disaggregation-bootstrap-port`` (from SGLang's 8998, unique per node). One more launch runs
  ``sglang_router.launch_router --pd-disaggregation`` with every prefill URL and bootstrap port and
  every decode URL (``sglang_router_argv``), on the head node of the first prefill instance.
  vLLM: each instance gets ``--kv-transfer-config`` (``vllm_kv_transfer_config``): vLLM 0.33.0's
  ``MooncakeConnector`` (``kv_connector/v1/mooncake/mooncake_connector.py``), ``kv_producer`` or
  ``kv_consumer``, and in ``kv_connector_extra_config`` the RDMA protocol and ``device_name``, the node's
  ranks' ``kv_nics`` as a comma list: one vLLM process takes one config for all its workers, so a NIC per
  rank cannot be named; Mooncake's transfer engine picks among the listed devices per GPU. A prefill
  instance's bootstrap server port is ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (from vLLM's 8998, unique per
  node). vLLM 0.33.0 ships no PD proxy, so no router is emitted: the proxy that hands the decode
  instances each prefill's ``remote_bootstrap_addr`` is the deployer's (the ports are in the launches).
* **KV-cache stores** (a plan with ``stores``): each store runs Mooncake's master and store service on its
  node (two launches, role ``store``, after the router), and every prefill and decode instance uses the store
  of its rack (``mooncake.py``). SGLang: HiCache with the Mooncake backend, its KV NICs as the device. vLLM:
  ``--kv-transfer-config`` becomes vLLM's ``MultiConnector`` over the ``MooncakeConnector`` above and
  ``MooncakeStoreConnector`` (prefill: the store first, so a prefix found there is loaded; decode: the
  prefill's KV first, and ``save_decode_cache`` writes finished requests into the store, as SGLang's decode
  offload does), and the store's settings go into a JSON file beside the script
  (``PLACEMENT-NODE.mooncake.json``, a file of the launch) named by ``MOONCAKE_CONFIG_PATH``.

``NodeLaunch`` and ``PortBook`` are ``node_launch.py``; the shell scripts of the launches are ``launch_script.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from toposched.binding import mooncake
from toposched.binding.engine_args import (
    SGLANG_FLAGS,
    TRTLLM_FLAGS,
    VLLM_FLAGS,
    ServeSettings,
    serve_settings,
    sglang_serve_argv,
    trtllm_options,
    trtllm_serve_argv,
    vllm_serve_argv,
)
from toposched.binding.model_ref import check_model_arg, checkpoint_of, served_model
from toposched.binding.node_launch import MAX_PORT, Engine, NodeLaunch, PortBook, plain_file_name
from toposched.errors import InputError
from toposched.names import check_node_name, placement_id_problem
from toposched.solver.layout import layout_problem, node_blocks
from toposched.solver.pd import Disaggregation, KvStore
from toposched.solver.request import Placement, PlacementRequest
from toposched.topology.domains import DomainMap, build_domain_map, gpu_ref
from toposched.topology.model import Cluster

__all__ = [
    "ENV_VARS", "KV_ENV_SOURCES", "SGLANG_FLAGS", "TRTLLM_FLAGS", "VLLM_FLAGS", "build_launches",
    "sglang_ib_device", "sglang_router_argv", "vllm_kv_transfer_config",
]  # fmt: skip

ENV_VARS = frozenset(
    {
        "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_CROSS_NIC",
        "VLLM_HOST_IP", "VLLM_RAY_BUNDLE_INDICES",
    }
)  # fmt: skip
KV_ENV_SOURCES: dict[str, str] = {
    "VLLM_MOONCAKE_BOOTSTRAP_PORT": "vllm 0.33.0 vllm/envs.py (default 8998), read by "
    "kv_connector/v1/mooncake/mooncake_connector.py get_mooncake_bootstrap_addr",
    "MOONCAKE_CONFIG_PATH": "vllm 0.33.0 vllm/distributed/mooncake_store.py MooncakeStoreConfig.load_from_config",
    **mooncake.STORE_ENV_SOURCES,
}
"""Variables of the disaggregated launches that tests/data/reference/engines.md does not list, and the file
of the engine's wheel that reads each (as ``FLAG_SOURCES`` for flags)."""

VLLM_MASTER_PORT = 29501  # vLLM's --master-port default (engines.md 1.1): the first one tried
SGLANG_DIST_PORT = 20000  # the port of the LWS SGLang example (engines.md section 2): the first one tried
SGLANG_BOOTSTRAP_PORT = 8998  # SGLang 0.5.23 --disaggregation-bootstrap-port default (srt/arg_groups/fields/disagg.py)
SGLANG_TRANSFER_BACKEND = "mooncake"  # SGLang's default KV transfer backend, and the one that takes IB devices
VLLM_KV_CONNECTOR = "MooncakeConnector"  # vLLM 0.33.0 kv_connector/factory.py: Mooncake's RDMA transfer engine
VLLM_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}  # vllm/config/kv_transfer.py KVRole
VLLM_STORE_CONNECTOR = "MooncakeStoreConnector"  # vLLM 0.33.0 kv_connector/factory.py: the Mooncake store
VLLM_MULTI_CONNECTOR = "MultiConnector"  # vLLM 0.33.0 kv_connector/v1/multi_connector.py: several connectors
ROUTER_PORT = 30000  # sglang-router 0.3.2 --port default (sglang_router/router_args.py)
ROUTER_COMMAND = ("python3", "-m", "sglang_router.launch_router")


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


class _NodeSetup(BaseModel):
    """What one node of an instance needs whatever the engine: its GPUs, their ids, variables, numactl."""

    model_config = ConfigDict(frozen=True)

    node: str
    gpus: list[int]
    ids: list[str]
    numa_nodes: list[int | None]
    env: dict[str, str]
    prefix: list[str]
    """``numactl`` binding to the one NUMA node of all the node's GPUs, or nothing."""


def node_setup(cluster: Cluster, dmap: DomainMap, node: str, gpus: list[int], multi: bool, uuids: bool) -> _NodeSetup:
    """What one node's ranks get (their GPUs, NCCL variables, numactl prefix); ``multi``: the instance spans
    nodes; ``uuids``: name GPUs by UUID (an NVML-probed cluster). ``binding.k8s`` uses it per pod."""
    n = cluster.node(node)
    numas = [n.gpu(g).numa_node for g in gpus]
    ids = [n.gpu(g).uuid or str(g) if uuids else str(g) for g in gpus]
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(ids)}
    env.update(_nccl_env(cluster, dmap, node, gpus, multi))
    single = numas[0] if len(set(numas)) == 1 and numas[0] is not None else None
    prefix = ["numactl", f"--cpunodebind={single}", f"--membind={single}"] if single is not None else []
    return _NodeSetup(node=node, gpus=gpus, ids=ids, numa_nodes=numas, env=env, prefix=prefix)


def _trtllm_launch(placement: str, settings: ServeSettings, setups: list[_NodeSetup], port: int) -> NodeLaunch:
    """``trtllm-serve`` on one node, or ``mpirun`` (and ``srun``) over all of an instance's nodes from the head."""
    head = setups[0]
    config = plain_file_name(placement, ".trtllm.yaml")
    files = {config: yaml.safe_dump(trtllm_options(settings), sort_keys=False)}
    serve = trtllm_serve_argv(settings, config)
    common: dict[str, Any] = {
        "placement": placement, "node": head.node, "engine": "trtllm", "node_rank": 0, "nnodes": len(setups),
        "gpus": head.gpus, "gpu_ids": head.ids, "numa_nodes": head.numa_nodes, "port": port,
    }  # fmt: skip
    if len(setups) == 1:
        argv = [*head.prefix, *serve, "--host", "0.0.0.0", "--port", str(port)]
        return NodeLaunch(**common, env=head.env, argv=argv, files=files)
    g = len(head.gpus)  # the same on every node (layout_problem); TensorRT-LLM puts rank r on local GPU r % g
    serve += ["--gpus_per_node", str(g), "--host", "0.0.0.0", "--port", str(port)]
    hostfile = plain_file_name(placement, ".hostfile")
    files[hostfile] = "".join(f"{x.node} slots={g}\n" for x in setups)
    alike = all((x.ids, x.prefix, x.env) == (head.ids, head.prefix, head.env) for x in setups)
    ranks = ["trtllm-llmapi-launch", *serve]
    if alike:
        forward = [a for k in head.env for a in ("-x", k)]
        argv = ["mpirun", "-np", str(g * len(setups)), "--hostfile", hostfile, "--map-by", f"ppr:{g}:node"]
        argv += ["--bind-to", "none", *forward, *head.prefix, *ranks]
        srun = ["srun", "--nodes", str(len(setups)), "--ntasks", str(g * len(setups)), "--ntasks-per-node", str(g)]
        srun += ["--nodelist", ",".join(x.node for x in setups), "--mpi=pmix", "--cpu-bind=none", *head.prefix, *ranks]
        env: dict[str, str] = head.env
    else:  # one MPMD context per node, each with its own variables and binding
        argv, srun, env = ["mpirun", "--hostfile", hostfile, "--bind-to", "none"], None, {}
        for i, x in enumerate(setups):
            argv += [":"] if i else []
            exports = [a for k, v in x.env.items() for a in ("-x", f"{k}={v}")]
            argv += ["-np", str(g), "--host", f"{x.node}:{g}", *exports, *x.prefix, *ranks]
    return NodeLaunch(**common, env=env, argv=argv, files=files, hosts=[x.node for x in setups], srun_argv=srun)


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
    disaggregation: Disaggregation | None = None,
    stores: Sequence[KvStore] = (),
    store_settings: mooncake.MooncakeSettings | None = None,
) -> list[NodeLaunch]:
    """One ``NodeLaunch`` per placement and node (then the router of a disaggregated plan, then its stores).

    A plan whose placements have roles launches only with its ``disaggregation`` (the plan document's)
    and with SGLang or vLLM: otherwise each instance would start as a plain server that never hands its KV on.
    ``stores`` (the plan document's) are launched too, and their instances use them.
    """
    if not 1 <= base_port <= MAX_PORT:
        raise InputError(f"--port {base_port} is not a port (1 to {MAX_PORT})")
    _check_disaggregated(doc_placements, engine, disaggregation)
    dmap = build_domain_map(cluster)
    model = check_model_arg(model_path, "--model-path") if model_path else served_model(request.model)
    checkpoint = checkpoint_of(request, model_path)
    if use_uuids is None:
        use_uuids = all(n.source == "nvml" for n in cluster.nodes)
    launches: list[NodeLaunch] = []
    ports = PortBook()
    if stores and disaggregation is None:
        raise InputError("KV-cache stores were given for a plan without prefill/decode disaggregation")
    # booked first, so a store's ports do not depend on the instances (k8s_pd builds the same launches)
    endpoints = mooncake.book_stores(stores, ports)
    by_id = {p.id: p for p in doc_placements}
    for p in doc_placements:
        groups = _node_groups(p)
        settings = serve_settings(p, request, model, checkpoint)
        head = master_addr or groups[0][0]
        group_nodes = [n for n, _ in groups]
        port = ports.take(group_nodes, base_port, "server")
        setups = [node_setup(cluster, dmap, node, gpus, len(groups) > 1, use_uuids) for node, gpus in groups]
        if engine == "trtllm":
            launches.append(_trtllm_launch(p.id, settings, setups, port))
            continue
        core = vllm_serve_argv(settings) if engine == "vllm" else sglang_serve_argv(settings)
        dist_port = None
        if len(groups) > 1:
            first = VLLM_MASTER_PORT if engine == "vllm" else SGLANG_DIST_PORT
            dist_port = ports.take(group_nodes, first, "rendezvous")
        # SGLang's and vLLM's Mooncake bootstrap servers both default to 8998
        bootstrap = ports.take(group_nodes, SGLANG_BOOTSTRAP_PORT, "bootstrap") if p.role == "prefill" else None
        store = None
        if endpoints and p.role is not None and disaggregation is not None:
            store = mooncake.store_for(p, endpoints, cluster, by_id, disaggregation.pairs)
        for node_rank, setup in enumerate(setups):
            argv = list(core)
            if engine == "vllm":
                numas = setup.numa_nodes
                if not setup.prefix and all(n is not None for n in numas) and len(set(numas)) > 1:
                    argv += ["--numa-bind", "--numa-bind-nodes", *[str(n) for n in numas]]
                if dist_port is not None:
                    argv += ["--nnodes", str(len(groups)), "--node-rank", str(node_rank), "--master-addr", head]
                    argv += ["--master-port", str(dist_port)]
                    if node_rank > 0:
                        argv.append("--headless")
            elif dist_port is not None:
                argv += ["--nnodes", str(len(groups)), "--node-rank", str(node_rank)]
                argv += ["--dist-init-addr", f"[{head}]:{dist_port}" if ":" in head else f"{head}:{dist_port}"]
            env, files = setup.env, {}
            if p.role is not None and engine == "sglang":
                argv += _sglang_pd_args(p, setup, bootstrap)
                if store is not None:
                    argv += mooncake.hicache_args(p, setup.node, store, store_settings)
            elif p.role is not None:
                config = vllm_kv_transfer_config(p, setup.node, setup.gpus, store=store is not None)
                argv += ["--kv-transfer-config", config]
                if bootstrap is not None:
                    env = {**env, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)}
                if store is not None:
                    name = plain_file_name(f"{p.id}-{setup.node}", ".mooncake.json")
                    devices = ",".join(dict.fromkeys(_node_kv_nics(p, setup.node, setup.gpus)))
                    files = {name: mooncake.vllm_store_config(devices, store, store_settings)}
                    env = {**env, "MOONCAKE_CONFIG_PATH": name}
            argv += ["--host", "0.0.0.0", "--port", str(port)]
            launches.append(
                NodeLaunch(
                    placement=p.id, node=setup.node, engine=engine, role=p.role, node_rank=node_rank,
                    nnodes=len(groups), env=env, argv=setup.prefix + argv, gpus=setup.gpus, gpu_ids=setup.ids,
                    numa_nodes=setup.numa_nodes, port=port, dist_port=dist_port, bootstrap_port=bootstrap,
                    files=files,
                )
            )  # fmt: skip
    if disaggregation is not None and engine == "sglang":  # vLLM 0.33.0 ships no PD proxy (module docstring)
        launches.append(_router_launch(request.id, launches, ports))
    launches += mooncake.store_launches(request.id, endpoints, store_settings, "vllm" if engine == "vllm" else "sglang")
    return launches


def _check_disaggregated(placements: Sequence[Placement], engine: Engine, pd: Disaggregation | None) -> None:
    """A disaggregated plan launches with SGLang or vLLM and its ``disaggregation``; a plain one without."""
    role = next((p for p in placements if p.role is not None), None)
    if role is None:
        if pd is not None:
            raise InputError("a disaggregation was given for a plan whose placements have no prefill/decode roles")
        return
    if pd is None:
        raise InputError(
            f"placement {role.id} is a {role.role} instance of a prefill/decode disaggregated plan; this launcher "
            "starts plain instances only",
            fix="launch the plan with `toposched launch sglang --plan PLAN.json` (or `launch vllm`)",
        )
    if engine == "trtllm":
        raise InputError(
            f"placement {role.id} is a {role.role} instance: toposched launches disaggregated plans with SGLang or "
            f"vLLM only so far, not {engine}",
            fix="launch the plan with `toposched launch sglang` or `toposched launch vllm`",
        )


def _node_kv_nics(p: Placement, node: str, gpus: Sequence[int]) -> list[str]:
    """The KV NICs of the ranks of ``p`` on ``node``, in the order of ``gpus``."""
    if len(p.kv_nics) != len(p.ranks):
        raise InputError(f"placement {p.id} is a {p.role} instance without a KV NIC for each rank")
    nic_of = {(r.node, r.gpu): nic for r, nic in zip(p.ranks, p.kv_nics, strict=True)}
    return [nic_of[(node, g)] for g in gpus]


def sglang_ib_device(p: Placement, node: str, gpus: Sequence[int]) -> str:
    """``--disaggregation-ib-device`` for the ranks of ``p`` on ``node``: the one device they all use, or SGLang's
    per-GPU JSON mapping (keys: the GPU's index among ``CUDA_VISIBLE_DEVICES``, which lists ``gpus``)."""
    nics = _node_kv_nics(p, node, gpus)
    if len(set(nics)) == 1:
        return nics[0]
    return json.dumps({str(i): nic for i, nic in enumerate(nics)}, separators=(",", ":"))


def _sglang_pd_args(p: Placement, setup: _NodeSetup, bootstrap: int | None) -> list[str]:
    """SGLang's disaggregation flags of one node of a prefill or decode instance."""
    argv = ["--disaggregation-mode", str(p.role), "--disaggregation-transfer-backend", SGLANG_TRANSFER_BACKEND]
    argv += ["--disaggregation-ib-device", sglang_ib_device(p, setup.node, setup.gpus)]
    if bootstrap is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap)]
    return argv


def vllm_kv_transfer_config(p: Placement, node: str, gpus: Sequence[int], *, store: bool = False) -> str:
    """``--kv-transfer-config`` (vllm/config/kv_transfer.py ``KVTransferConfig``) for the ranks of ``p`` on ``node``.

    vLLM's MooncakeConnector reads ``mooncake_protocol`` and ``device_name`` from ``kv_connector_extra_config``
    and hands them to Mooncake's ``TransferEngine.initialize``. One vLLM process takes one config for all its
    workers, so the node's ranks' distinct KV NICs are listed (rank order) rather than one per rank.

    With ``store``, vLLM's ``MultiConnector`` runs it beside ``MooncakeStoreConnector`` (which reads its store
    from ``MOONCAKE_CONFIG_PATH``), each in the instance's role. MultiConnector loads a request's KV from the
    first connector that has it and saves to all: a prefill instance lists the store first (a prefix found
    there is loaded, the P2P producer never loads), a decode instance the prefill's KV first, and its store
    connector saves finished requests' KV (``save_decode_cache``) for the rack's prefill instances.
    """
    if p.role not in VLLM_KV_ROLES:
        raise InputError(f"placement {p.id} has role {p.role!r}, not prefill or decode")
    devices = ",".join(dict.fromkeys(_node_kv_nics(p, node, gpus)))
    role = VLLM_KV_ROLES[p.role]
    p2p = {
        "kv_connector": VLLM_KV_CONNECTOR,
        "kv_role": role,
        "kv_connector_extra_config": {"mooncake_protocol": "rdma", "device_name": devices},
    }
    config: dict[str, Any] = p2p
    if store:
        kept: dict[str, Any] = {"kv_connector": VLLM_STORE_CONNECTOR, "kv_role": role}
        if p.role == "decode":
            kept["kv_connector_extra_config"] = {"save_decode_cache": True}
        connectors = [kept, p2p] if p.role == "prefill" else [p2p, kept]
        config = {
            "kv_connector": VLLM_MULTI_CONNECTOR,
            "kv_role": role,
            "kv_connector_extra_config": {"connectors": connectors},
        }
    return json.dumps(config, separators=(",", ":"))


def sglang_router_argv(launches: Sequence[NodeLaunch], port: int) -> list[str]:
    """``sglang_router.launch_router --pd-disaggregation`` over the prefill (URL and bootstrap port) and decode
    servers of ``launches`` (their head nodes' names as hosts)."""
    argv = [*ROUTER_COMMAND, "--pd-disaggregation"]
    heads = [launch for launch in launches if launch.node_rank == 0]
    for launch in heads:
        if launch.role == "prefill":
            argv += ["--prefill", f"http://{launch.node}:{launch.port}", str(launch.bootstrap_port)]
    for launch in heads:
        if launch.role == "decode":
            argv += ["--decode", f"http://{launch.node}:{launch.port}"]
    return [*argv, "--host", "0.0.0.0", "--port", str(port)]


def _router_launch(request_id: str, launches: Sequence[NodeLaunch], ports: PortBook) -> NodeLaunch:
    """The router of a disaggregated plan, on the head node of its first prefill instance (no GPUs)."""
    node = next(launch.node for launch in launches if launch.role == "prefill" and launch.node_rank == 0)
    port = ports.take([node], ROUTER_PORT, "router")
    return NodeLaunch(
        placement=f"{request_id}-router", node=node, engine="sglang", role="router", node_rank=0, nnodes=1, env={},
        argv=sglang_router_argv(launches, port), gpus=[], gpu_ids=[], numa_nodes=[], port=port,
    )  # fmt: skip


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
