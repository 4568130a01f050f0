"""The Mooncake KV-cache stores of a prefill/decode disaggregated plan, and what each SGLang instance is told.

A plan made with ``--kv-store mooncake`` has ``stores``: one ``{node, rack, nics}`` per rack its decode
instances use (``solver/pd.py``). Each becomes one Mooncake cluster of its own, two processes on the
store's node (no GPUs):

* the **master** (``mooncake_master``, object metadata, allocation and eviction): its RPC port
  (``--rpc_port``, Mooncake's 50051), its metrics/admin port (``--metrics_port``, 9003), the HTTP
  metadata server off (``--enable_http_metadata_server=false``: the transfer engines find each other by
  ``P2PHANDSHAKE``, so no etcd or metadata service is needed, and SGLang reuses the transfer engine of
  its disaggregation only in that mode), eviction from 95 % use (``--eviction_high_watermark_ratio``,
  SGLang's Mooncake README) and logs on stderr;
* the **store service** (``python3 -m mooncake.mooncake_store_service``), the process that holds the host
  memory: it mounts ``segment_gib`` of the node's memory into the cluster's pool over the store's RDMA
  NICs (``MOONCAKE_DEVICE``) and serves Mooncake's REST API on ``--port`` (8080). It reads its
  configuration from ``MOONCAKE_*`` variables (mooncake/mooncake_config.py ``MooncakeConfig.load_from_env``).

Every SGLang instance uses the store of its rack (a prefill instance without one: the store of the rack of a
decode instance it pairs with): prefill instances run HiCache with it as L3
(``--enable-hierarchical-cache --hicache-storage-backend mooncake``), decode instances offload finished
requests' KV into it (``--disaggregation-decode-enable-offload-kvcache``, which SGLang 0.5.23 accepts only
with a storage backend; it refuses HiCache itself on decode with the ``prefill_complete`` policy). Both get
``--hicache-storage-backend-extra-config``, the JSON that SGLang's ``MooncakeStoreConfig.load_from_extra_config``
reads (sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py): the master's address and metrics port,
``P2PHANDSHAKE``, ``rdma``, the node's name as ``local_hostname`` (peers must reach it; SGLang's default is
``localhost``), the ranks' ``kv_nics`` as ``device_name`` (one device, or SGLang's per-TP-rank JSON) and a
``global_segment_size`` of 0: instances contribute no memory, the store's node holds the pool.

Ports are booked in the plan's ``PortBook`` before any instance's, so they are Mooncake's defaults unless
two stores share a node, and the store launches are the same whoever builds them (``store_launches``).

vLLM 0.33.0 instances use the same stores through ``MooncakeStoreConnector``
(``kv_connector/v1/mooncake/store/connector.py``), which reads a JSON file named by ``MOONCAKE_CONFIG_PATH``
(``vllm/distributed/mooncake_store.py`` ``MooncakeStoreConfig.from_file``; ``vllm_store_config`` writes it):
the master's address, ``P2PHANDSHAKE``, the protocol, the node's KV NICs, and vLLM's ``standalone-store`` mode
with a ``global_segment_size`` of 0 (as for SGLang: the store's node holds the pool; vLLM refuses any other size
in that mode). The connector finds its own address (``get_ip``), so no hostname is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from toposched.binding.node_launch import NodeLaunch, PortBook
from toposched.errors import InputError
from toposched.solver.pd import KvStore
from toposched.solver.request import Placement
from toposched.topology.model import Cluster

__all__ = [
    "HICACHE_FLAG_SOURCES", "MASTER_COMMAND", "MASTER_FLAG_SOURCES", "STORE_ENV_SOURCES", "STORE_SERVICE_COMMAND",
    "MooncakeSettings", "StoreEndpoint", "book_stores", "hicache_args", "instance_extra_config", "master_argv",
    "store_env", "store_for", "store_launches", "vllm_store_config",
]  # fmt: skip

MASTER_COMMAND = ("mooncake_master",)
STORE_SERVICE_COMMAND = ("python3", "-m", "mooncake.mooncake_store_service")
MASTER_RPC_PORT = 50051  # mooncake_master --port default (--rpc_port 0 falls back to it)
MASTER_METRICS_PORT = 9003  # mooncake_master --metrics_port default
STORE_HTTP_PORT = 8080  # mooncake_store_service --port default
METADATA_SERVER = "P2PHANDSHAKE"
_MASTER = "mooncake_master --help (mooncake-transfer-engine-non-cuda 0.3.13.post1, mooncake-store/src/master.cpp)"
MASTER_FLAG_SOURCES: dict[str, str] = {
    "--rpc_port": _MASTER,
    "--metrics_port": _MASTER,
    "--enable_http_metadata_server": _MASTER,
    "--eviction_high_watermark_ratio": _MASTER,
    "--logtostderr": "mooncake_master --help (glog src/logging.cc)",
}
"""The flags ``master_argv`` writes, each with where it is defined."""
STORE_SERVICE_FLAGS = frozenset({"--port"})  # mooncake/mooncake_store_service.py parse_arguments
_STORE_CONFIG = "mooncake-transfer-engine 0.3.13.post1 mooncake/mooncake_config.py MooncakeConfig.load_from_env"
STORE_ENV_SOURCES: dict[str, str] = {
    name: _STORE_CONFIG
    for name in (
        "MOONCAKE_MASTER", "MOONCAKE_LOCAL_HOSTNAME", "MOONCAKE_TE_META_DATA_SERVER", "MOONCAKE_PROTOCOL",
        "MOONCAKE_DEVICE", "MOONCAKE_GLOBAL_SEGMENT_SIZE", "MOONCAKE_LOCAL_BUFFER_SIZE",
    )
}  # fmt: skip
"""The variables of the store service's launch, and the file that reads them."""
_HICACHE = "sglang/srt/arg_groups/fields/memory.py"
HICACHE_FLAG_SOURCES: dict[str, str] = {
    "--enable-hierarchical-cache": f"{_HICACHE}: enable_hierarchical_cache",
    "--hicache-storage-backend": f"{_HICACHE}: hicache_storage_backend (choices include mooncake)",
    "--hicache-storage-backend-extra-config": f"{_HICACHE}: hicache_storage_backend_extra_config (JSON); read by "
    "mem_cache/storage/mooncake_store/mooncake_store.py MooncakeStoreConfig.load_from_extra_config",
    "--disaggregation-decode-enable-offload-kvcache": "sglang/srt/arg_groups/fields/disagg.py: "
    "disaggregation_decode_enable_offload_kvcache (kv_cache_hook.py: decode only, needs a storage backend)",
}
"""SGLang 0.5.23 flags of an instance that uses a store (to join ``engine_args.FLAG_SOURCES['sglang']``)."""
HICACHE_FLAGS = frozenset(HICACHE_FLAG_SOURCES)
VLLM_STORE_CONFIG_SOURCE = "vllm 0.33.0 vllm/distributed/mooncake_store.py MooncakeStoreConfig.from_file"
VLLM_STORE_CONFIG_FIELDS = frozenset(
    {
        "metadata_server", "master_server_address", "protocol", "device_name", "mode", "global_segment_size",
        "local_buffer_size", "enable_offload", "tenant_id",
    }
)  # fmt: skip
"""Every key ``VLLM_STORE_CONFIG_SOURCE`` reads from the file (others are ignored); ``vllm_store_config`` writes
no other."""
VLLM_STORE_MODE = "standalone-store"  # mooncake_store.py MooncakeMode: an outside process owns the pool


class MooncakeSettings(BaseModel):
    """How the stores of a plan run; the defaults are Mooncake's and SGLang's documented ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    segment_gib: int = Field(default=64, ge=1, le=1 << 20)
    """Host memory (GiB) each store's node contributes to its pool (``MOONCAKE_GLOBAL_SEGMENT_SIZE``)."""
    protocol: Literal["rdma", "tcp"] = "rdma"
    """Mooncake's transfer protocol; ``tcp`` only where the nodes have no RDMA (the NICs are then unused)."""
    eviction_high_watermark: float = Field(default=0.95, gt=0.0, le=1.0)
    """Pool use from which the master evicts (``--eviction_high_watermark_ratio``; SGLang's README uses 0.95)."""


@dataclass(frozen=True)
class StoreEndpoint:
    """One store of the plan with the ports booked for it on its node."""

    index: int
    store: KvStore
    rpc_port: int
    metrics_port: int
    http_port: int

    @property
    def master_address(self) -> str:
        """``NODE:PORT`` of the master, as instances and the store service name it."""
        return f"{self.store.node}:{self.rpc_port}"


def book_stores(stores: Sequence[KvStore], ports: PortBook) -> list[StoreEndpoint]:
    """The ports of every store on its node (book them before the instances' so they stay Mooncake's defaults)."""
    out = []
    for i, store in enumerate(stores):
        node = [store.node]
        rpc = ports.take(node, MASTER_RPC_PORT, "Mooncake master")
        metrics = ports.take(node, MASTER_METRICS_PORT, "Mooncake master metrics")
        http = ports.take(node, STORE_HTTP_PORT, "Mooncake store service")
        out.append(StoreEndpoint(i, store, rpc, metrics, http))
    return out


def master_argv(endpoint: StoreEndpoint, settings: MooncakeSettings | None = None) -> list[str]:
    """``mooncake_master`` for one store (gflags' ``--flag=value`` form: a bool flag takes no separate value)."""
    settings = settings or MooncakeSettings()
    return [
        *MASTER_COMMAND,
        f"--rpc_port={endpoint.rpc_port}",
        f"--metrics_port={endpoint.metrics_port}",
        "--enable_http_metadata_server=false",
        f"--eviction_high_watermark_ratio={settings.eviction_high_watermark}",
        "--logtostderr=true",
    ]


def store_env(endpoint: StoreEndpoint, settings: MooncakeSettings | None = None) -> dict[str, str]:
    """The store service's configuration: its master, its node as the name peers reach, its NICs, its memory."""
    settings = settings or MooncakeSettings()
    return {
        "MOONCAKE_MASTER": endpoint.master_address,
        "MOONCAKE_LOCAL_HOSTNAME": endpoint.store.node,
        "MOONCAKE_TE_META_DATA_SERVER": METADATA_SERVER,
        "MOONCAKE_PROTOCOL": settings.protocol,
        "MOONCAKE_DEVICE": ",".join(endpoint.store.nics) if settings.protocol == "rdma" else "",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(settings.segment_gib << 30),
        "MOONCAKE_LOCAL_BUFFER_SIZE": "0",  # it only serves its memory (SGLang's README for a store service)
    }


def store_launches(
    request_id: str,
    endpoints: Sequence[StoreEndpoint],
    settings: MooncakeSettings | None = None,
    engine: Literal["sglang", "vllm"] = "sglang",
) -> list[NodeLaunch]:
    """Two launches per store, its master (``ID-store-N-master``) and its store service (``ID-store-N``); the
    same commands whichever ``engine`` the instances run (it is only what the launches say they belong to)."""

    def launch(placement: str, argv: list[str], env: dict[str, str], port: int, node: str) -> NodeLaunch:
        return NodeLaunch(
            placement=placement, node=node, engine=engine, role="store", node_rank=0, nnodes=1, env=env,
            argv=argv, gpus=[], gpu_ids=[], numa_nodes=[], port=port,
        )  # fmt: skip

    launches = []
    for e in endpoints:
        master = f"{request_id}-store-{e.index}-master"
        launches.append(launch(master, master_argv(e, settings), {}, e.rpc_port, e.store.node))
        service = [*STORE_SERVICE_COMMAND, "--port", str(e.http_port)]
        env = store_env(e, settings)
        launches.append(launch(f"{request_id}-store-{e.index}", service, env, e.http_port, e.store.node))
    return launches


def _rack_of(cluster: Cluster, node: str) -> tuple[str, str]:
    """A node's rack; a node without one is its own rack."""
    rack = cluster.node(node).rack
    return ("rack", rack) if rack is not None else ("node", node)


def store_for(
    p: Placement,
    endpoints: Sequence[StoreEndpoint],
    cluster: Cluster,
    placements: Mapping[str, Placement],
    pairs: Mapping[str, str],
) -> StoreEndpoint:
    """The store an instance uses: the one in the rack of its head node, else (a prefill instance) the one in
    the rack of a decode instance paired with it, else the plan's first."""
    if not endpoints:
        raise InputError(f"placement {p.id}: the plan has no KV-cache store")
    by_rack = {_rack_of(cluster, e.store.node): e for e in reversed(endpoints)}
    racks = [_rack_of(cluster, p.ranks[0].node)]
    racks += [_rack_of(cluster, placements[d].ranks[0].node) for d, f in pairs.items() if f == p.id and d in placements]
    return next((by_rack[r] for r in racks if r in by_rack), endpoints[0])


def _device_name(p: Placement, node: str) -> str:
    """The ranks of ``p`` on ``node``: their one KV NIC, else SGLang's JSON keyed by TP rank (mooncake_store.py
    reads ``device_name`` that way), else, when two ranks of one TP rank share the node, all their NICs."""
    if len(p.kv_nics) != len(p.ranks):
        raise InputError(f"placement {p.id} is a {p.role} instance without a KV NIC for each rank")
    mine = [(r.tp_rank, nic) for r, nic in zip(p.ranks, p.kv_nics, strict=True) if r.node == node]
    nics = list(dict.fromkeys(nic for _, nic in mine))
    if len(nics) == 1:
        return nics[0]
    by_rank = dict(mine)
    if len(by_rank) == len(mine):
        return json.dumps({str(k): v for k, v in sorted(by_rank.items())}, separators=(",", ":"))
    return ",".join(nics)


def instance_extra_config(
    p: Placement, node: str, endpoint: StoreEndpoint, settings: MooncakeSettings | None = None
) -> str:
    """``--hicache-storage-backend-extra-config`` for the ranks of ``p`` on ``node``."""
    settings = settings or MooncakeSettings()
    config = {
        "master_server_address": endpoint.master_address,
        "metadata_server": METADATA_SERVER,
        "protocol": settings.protocol,
        "device_name": _device_name(p, node) if settings.protocol == "rdma" else "",
        "local_hostname": node,
        "global_segment_size": 0,
        "master_metrics_port": endpoint.metrics_port,
    }
    return json.dumps(config, separators=(",", ":"))


def hicache_args(
    p: Placement, node: str, endpoint: StoreEndpoint, settings: MooncakeSettings | None = None
) -> list[str]:
    """SGLang's flags for one node of an instance that uses ``endpoint``'s store."""
    if p.role == "prefill":
        argv = ["--enable-hierarchical-cache"]
    elif p.role == "decode":
        argv = ["--disaggregation-decode-enable-offload-kvcache"]
    else:
        raise InputError(f"placement {p.id} has role {p.role!r}, not prefill or decode")
    extra = instance_extra_config(p, node, endpoint, settings)
    return [*argv, "--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", extra]


def vllm_store_config(devices: str, endpoint: StoreEndpoint, settings: MooncakeSettings | None = None) -> str:
    """The JSON file vLLM's ``MooncakeStoreConnector`` reads (``MOONCAKE_CONFIG_PATH``) for one node of an instance
    that uses ``endpoint``'s store; ``devices`` are the node's KV NICs (a comma list: one config per process)."""
    settings = settings or MooncakeSettings()
    config = {
        "metadata_server": METADATA_SERVER,
        "master_server_address": endpoint.master_address,
        "protocol": settings.protocol,
        "device_name": devices if settings.protocol == "rdma" else "",
        "mode": VLLM_STORE_MODE,
        "global_segment_size": 0,
    }
    return json.dumps(config, indent=2) + "\n"
