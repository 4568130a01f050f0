"""Findings on an NCCL log: intra-node traffic over the network, TCP sockets between nodes, SHM or
P2P disabled, no GPUDirect RDMA, a communicator spanning nodes, NVLS or CollNet unavailable."""

from __future__ import annotations

from toposched.sidecar.nccl_report import Connection, Finding


def _pairs(conns: list[Connection], limit: int = 4) -> str:
    seen = sorted({(c.src, c.dst) for c in conns}, key=lambda p: (p[0], -1 if p[1] is None else p[1]))
    text = ", ".join(f"{a}->{b}" for a, b in seen[:limit])
    return text + (f" and {len(seen) - limit} more" if len(seen) > limit else "")


def collect_findings(
    *,
    connections: list[Connection],
    host_of: dict[int, str],
    hosts: tuple[str, ...],
    nranks: int | None,
    nnodes: int | None,
    env_p2p_disabled: bool,
    collnet_failed: bool,
    nvls: bool,
    nvls_unavailable: bool,
    nvswitch: bool,
    mnnvl: bool,
    skipped: int,
) -> list[Finding]:
    out: list[Finding] = []
    net = [c for c in connections if c.family.startswith("NET/")]

    def same_node(c: Connection) -> bool:
        if nnodes == 1:
            return True
        a, b = host_of.get(c.src), host_of.get(c.dst) if c.dst is not None else None
        return a is not None and a == b

    intra: list[Connection] = []
    inter: list[Connection] = []
    for c in net:
        (intra if same_node(c) else inter).append(c)
    if intra:
        fams = ", ".join(sorted({c.family for c in intra}))
        out.append(
            Finding(
                "intra_node_network",
                "warning",
                f"{len(intra)} connection(s) between GPUs of one node go over {fams} ({_pairs(intra)}): intra-node "
                "traffic over the network stack instead of NVLink/PCIe P2P or SHM",
            )
        )
    sockets = [c for c in inter if c.family == "NET/Socket"]
    if sockets:
        out.append(
            Finding(
                "net_socket",
                "warning",
                f"{len(sockets)} inter-node connection(s) use NET/Socket (TCP, {_pairs(sockets)}): no InfiniBand/RoCE "
                "RDMA; check NCCL_IB_HCA / NCCL_IB_DISABLE and the RDMA devices",
            )
        )
    shm = [c for c in connections if c.family == "SHM"]
    if env_p2p_disabled:
        out.append(
            Finding(
                "p2p_disabled",
                "warning",
                "NCCL_P2P_DISABLE=1 is set: GPU peer-to-peer (NVLink/PCIe P2P) is off"
                + (f"; {len(shm)} connection(s) go through host shared memory (SHM)" if shm else ""),
            )
        )
    elif shm:
        out.append(
            Finding(
                "shm_transport",
                "warning",
                f"{len(shm)} intra-node connection(s) use SHM through host memory ({_pairs(shm)}): NCCL found no P2P "
                "path between those GPUs (no NVLink, P2P unsupported or disabled)",
            )
        )
    no_gdr = [c for c in net if c.family != "NET/Socket" and not c.gdrdma]
    if no_gdr:
        fams = ", ".join(sorted({c.family for c in no_gdr}))
        out.append(
            Finding(
                "gdrdma_off",
                "warning",
                f"{len(no_gdr)} network connection(s) over {fams} without GPUDirect RDMA ({_pairs(no_gdr)}): data is "
                "staged through host memory; check nvidia-peermem and NCCL_NET_GDR_LEVEL",
            )
        )
    node_count = max(nnodes or 0, len(hosts), 2 if inter else 0)
    if node_count > 1 and (nnodes is None or nnodes > 1):
        out.append(
            Finding(
                "spans_nodes",
                "warning",
                f"the communicator spans {nnodes if nnodes else 'at least ' + str(node_count)} nodes: if this is a "
                "tensor-parallel group it crosses nodes; keep TP inside one NVLink domain",
            )
        )
    if nnodes is not None and nnodes > 1 and len(hosts) == 1 and nranks is not None:
        loggers = {c.logger_rank for c in connections} | set(host_of)
        if loggers >= set(range(nranks)):
            out.append(
                Finding(
                    "nnodes_mismatch",
                    "warning",
                    f"NCCL counted {nnodes} nodes but every rank logs from host {hosts[0]}: containers with different "
                    "host hashes make NCCL use the network between GPUs of one machine",
                )
            )
    if nvls_unavailable and nvswitch and not nvls:
        out.append(
            Finding(
                "nvls_unavailable",
                "warning",
                "NVLS (NVLink SHARP) is not available on NVSwitch hardware: check the fabric manager / IMEX, "
                "NCCL_NVLS_ENABLE and the CUDA driver",
            )
        )
    if collnet_failed:
        out.append(
            Finding(
                "collnet_fallback",
                "warning",
                "CollNet (SHARP) could not be initialised; NCCL fell back to the point-to-point network",
            )
        )
    if mnnvl:
        out.append(Finding("mnnvl", "info", "multi-node NVLink (MNNVL) is in use"))
    if not connections:
        out.append(Finding("no_connections", "info", "the log has no channel connection ('via ...') lines"))
    if skipped:
        out.append(
            Finding(
                "skipped_records",
                "info",
                f"{skipped} record(s) were cut by interleaved output or damaged and were not read",
            )
        )
    return out
