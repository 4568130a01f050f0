"""``toposched topo``: show, refresh and list topologies.

``topo show`` with a source flag reads that source now and stores nothing; without one it shows the
newest DomainMap stored by ``topo refresh`` (or by the service) in ``--state`` and warns when it is
older than the bound. ``--state`` is spelled as everywhere else: ``sqlite:PATH`` or ``etcd:URL``.
``--p2p FILE`` adds an ``nvidia-smi topo -p2p r`` capture to a one-node source (``topology/p2p.py``):
which GPU pairs talk peer to peer, what the cost model needs on PCIe-only nodes.
"""

from __future__ import annotations

import time
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from toposched.cli._common import (
    CLUSTER,
    LIVE,
    P2P,
    PRESET,
    SMI,
    STATE,
    console,
    err_console,
    ledger_url,
    print_json,
    source_ref,
)
from toposched.config import TopologyConfig
from toposched.errors import InputError
from toposched.topology.domains import DomainMap, build_domain_map, gpu_ref
from toposched.topology.model import Cluster, LinkKind, Node
from toposched.topology.presets import presets
from toposched.topology.sources import Loaded, SourceRef, load_source
from toposched.topology.store import DomainMapStore, TopologyStore

topo_app = typer.Typer(help="Discover and show GPU topology: NVLink domains, NUMA groups, links.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(topo_app, name="topo")


def open_store(state: str | None) -> tuple[str, DomainMapStore]:
    """The DomainMap store ``--state`` names, and its URL (etcd's client is imported only for etcd)."""
    url = ledger_url(state)
    scheme, _, arg = url.partition(":")
    if scheme == "etcd":
        from toposched.ledger.etcd_topology import EtcdTopologyStore

        return url, EtcdTopologyStore(arg or "http://127.0.0.1:2379")
    return url, TopologyStore(arg)


# ---------------------------------------------------------------------------------------------- JSON


def topology_json(
    cluster: Cluster,
    dmap: DomainMap,
    *,
    source: str,
    warnings: tuple[str, ...] = (),
    version: int | None = None,
    created_at: float | None = None,
    stale: bool | None = None,
) -> dict[str, Any]:
    """The stable JSON form of ``topo show --json``."""
    single = len(cluster.nodes) == 1
    gpus: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    for node in cluster.nodes:
        for g in node.gpus:
            ref = gpu_ref(node.name, g.index)
            gpus.append(
                {
                    "node": node.name,
                    "index": g.index,
                    "ref": ref,
                    "uuid": g.uuid,
                    "pci_bus_id": g.pci_bus_id,
                    "model": g.model,
                    "hbm_gib": g.hbm_gib,
                    "numa_node": g.numa_node,
                    "numa_affinity": g.numa_affinity,
                    "cpu_affinity": g.cpu_affinity,
                    "health": g.health.value,
                    "nvlink_domain": dmap.gpu_domain.get(ref),
                    "nearest_nics": list(dmap.nearest_nics.get(ref, ())),
                }
            )
        links.extend(
            {
                "node": node.name,
                "a": link.a,
                "b": link.b,
                "kind": link.kind.value,
                "nvlinks": link.nvlinks,
                "bandwidth_gbps": link.bandwidth_gbps,
                "latency_us": link.latency_us,
                "p2p": link.p2p,
            }
            for link in node.links
        )

    def members(refs: tuple[str, ...]) -> list[int] | list[str]:
        return [int(r.rsplit("/", 1)[1]) for r in refs] if single else list(refs)

    return {
        "schema_version": cluster.schema_version,
        "name": cluster.name,
        "source": source,
        "version": version,
        "created_at": created_at,
        "stale": stale,
        "warnings": list(warnings),
        "nodes": [
            {"name": n.name, "rack": n.rack, "zone": n.zone, "gpus": len(n.gpus), "nvswitch": n.nvswitch}
            for n in cluster.nodes
        ],
        "gpus": gpus,
        "links": links,
        "nvlink_domains": [members(d.gpus) for d in dmap.domains],
        "domains": [
            {
                "id": d.id,
                "kind": d.kind,
                "nodes": list(d.nodes),
                "gpus": members(d.gpus),
                "cliques": [members(c) for c in d.cliques],
                "min_nvlinks": d.min_nvlinks,
            }
            for d in dmap.domains
        ],
        "numa_groups": [{"id": g.id, "gpus": members(g.gpus)} for g in dmap.numa_groups],
        "pcie_groups": [{"id": g.id, "gpus": members(g.gpus)} for g in dmap.pcie_groups],
        "cluster_fingerprint": dmap.cluster_fingerprint,
        "cluster": cluster.model_dump(mode="json"),
    }


# --------------------------------------------------------------------------------------------- human

_STYLE = {
    LinkKind.NVLINK: "bold green",
    LinkKind.PIX: "yellow",
    LinkKind.PXB: "yellow",
    LinkKind.PHB: "dark_orange",
    LinkKind.NODE: "dark_orange",
    LinkKind.SYS: "red",
}
MAX_MATRIX_NODES = 2


def _matrix(node: Node, dmap: DomainMap) -> Table:
    table = Table(title=f"{node.name}: links between GPUs", title_justify="left", pad_edge=False, box=None)
    table.add_column("")
    for g in node.gpus:
        table.add_column(f"GPU{g.index}", justify="center")
    table.add_column("NUMA", justify="right")
    table.add_column("domain", no_wrap=True)  # the CPUs follow the matrix (_cpu_lines): a list wraps at 80 columns
    for g in node.gpus:
        cells: list[Text] = []
        for other in node.gpus:
            if other.index == g.index:
                cells.append(Text("X", style="dim"))
                continue
            link = node.link(g.index, other.index)
            if link is None:
                cells.append(Text("?", style="dim"))
            else:
                label = f"NV{link.nvlinks}" if link.kind is LinkKind.NVLINK else link.kind.value
                cells.append(Text(label, style=_STYLE.get(link.kind, "")))
        numa = str(g.numa_node) if g.numa_node is not None else (g.numa_affinity or "-")
        domain_id = dmap.gpu_domain.get(gpu_ref(node.name, g.index))
        domain = domain_id.removeprefix(node.name + "/") if domain_id else "-"
        table.add_row(f"GPU{g.index}", *cells, numa, domain)
    return table


def _index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``0-3,6``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _cpu_lines(node: Node) -> list[str]:
    """The CPUs near each GPU (``cpu_affinity``), one line per set of GPUs sharing a list, under the matrix
    (a column of them wrapped at 80 columns); none when the source gave no CPU lists."""
    if not any(g.cpu_affinity for g in node.gpus):
        return []
    groups: dict[tuple[str, str], list[int]] = {}
    for g in node.gpus:
        numa = str(g.numa_node) if g.numa_node is not None else (g.numa_affinity or "-")
        groups.setdefault((numa, g.cpu_affinity or "-"), []).append(g.index)
    return [f"{node.name}: CPUs near each GPU (cpu_affinity)"] + [
        f"  GPU{_index_ranges(indices)} (NUMA {numa}): {cpus}" for (numa, cpus), indices in groups.items()
    ]


def _p2p_line(node: Node) -> str | None:
    """One line on peer-to-peer for a node whose source said (``--p2p``, a spec's ``p2p``), else None."""
    known = [link for link in node.links if link.p2p is not None]
    if not known:
        return None
    refused = [f"{link.a}-{link.b}" for link in known if link.p2p is False]
    if not refused:
        return f"{node.name}: peer-to-peer OK on all {len(known)} GPU pairs"
    shown = ", ".join(refused[:12]) + (f" and {len(refused) - 12} more" if len(refused) > 12 else "")
    return f"{node.name}: peer-to-peer refused on {len(refused)} of {len(known)} GPU pairs: {shown}"


def _render(cluster: Cluster, dmap: DomainMap, header: str) -> None:
    console.print(header, soft_wrap=True)
    gpu_models = sorted({g.model or "model unknown" for n in cluster.nodes for g in n.gpus})
    console.print(
        f"{len(cluster.nodes)} node(s), {cluster.gpu_count} GPU(s) ({escape(', '.join(gpu_models))}), "
        f"{len(dmap.domains)} NVLink domain(s)" + (f", fabric {cluster.fabric.describe()}" if cluster.fabric else "")
    )
    for node in cluster.nodes[:MAX_MATRIX_NODES]:
        console.print()
        console.print(_matrix(node, dmap))
        for cpus in _cpu_lines(node):
            console.print(cpus, markup=False, soft_wrap=True)
        if (line := _p2p_line(node)) is not None:
            console.print(line, markup=False, soft_wrap=True)
    if len(cluster.nodes) > MAX_MATRIX_NODES:
        console.print(f"\n(link matrices of the other {len(cluster.nodes) - MAX_MATRIX_NODES} nodes: use --json)")
    console.print()
    domains = Table(title="NVLink domains", title_justify="left")
    for col in ("id", "kind", "GPUs", "min lanes", "all-pairs NVLink sets"):
        domains.add_column(col)
    shown = dmap.domains[:16]
    for d in shown:
        single = len(d.nodes) == 1
        short = [r.rsplit("/", 1)[1] if single else r for r in d.gpus]
        cliques = (
            "whole domain"
            if d.cliques == (d.gpus,)
            else "; ".join(",".join(r.rsplit("/", 1)[1] for r in c) for c in d.cliques)
        )
        domains.add_row(d.id, d.kind, f"{len(d.gpus)}: {','.join(short)}", str(d.min_nvlinks), cliques)
    if not dmap.domains:
        domains.add_row("-", "-", "no NVLink between GPUs", "-", "-")
    console.print(domains)
    if len(dmap.domains) > len(shown):
        console.print(f"({len(dmap.domains) - len(shown)} more domains: use --json)")
    numa = Table(title="NUMA groups", title_justify="left")
    numa.add_column("group")
    numa.add_column("GPUs")
    for grp in dmap.numa_groups[:16]:
        numa.add_row(grp.id, ",".join(r.rsplit("/", 1)[1] for r in grp.gpus))
    if dmap.numa_groups:
        console.print(numa)
    if dmap.pcie_groups:
        console.print(
            "PCIe-switch groups: "
            + "; ".join(f"{g.id}=" + ",".join(r.rsplit("/", 1)[1] for r in g.gpus) for g in dmap.pcie_groups[:16])
        )


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


@topo_app.command("show")
def show(
    smi: str | None = SMI,
    preset: str | None = PRESET,
    cluster: str | None = CLUSTER,
    live: bool = LIVE,
    p2p: str | None = P2P,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    state: str | None = STATE,
    max_age: float | None = typer.Option(
        None, "--max-age", help="Seconds after which a stored DomainMap is stale (default 300).", metavar="S"
    ),
) -> None:
    """Show links, NVLink domains and NUMA groups of a topology source or of the stored DomainMap."""
    ref = source_ref(smi, preset, cluster, live, p2p)
    if ref is not None:
        loaded = load_source(ref)
        dmap = build_domain_map(loaded.cluster)
        for w in loaded.warnings:
            err_console.print(f"warning: {w}", markup=False, soft_wrap=True)
        if json_out:
            print_json(topology_json(loaded.cluster, dmap, source=ref.describe(), warnings=loaded.warnings))
        else:
            _render(loaded.cluster, dmap, f"[bold]{escape(loaded.cluster.name)}[/] from {escape(ref.describe())}")
        return
    config = TopologyConfig.load(max_age_s=max_age)
    url, store = open_store(state)
    stored = store.latest()
    if stored is None:
        raise InputError(
            f"no topology given and none stored in {url}",
            fix="pass --preset NAME, --smi FILE, --cluster FILE or --live, or run `toposched topo refresh` first",
        )
    age = stored.age_s()
    stale = age > config.max_age_s
    if stale:
        err_console.print(
            f"warning: DomainMap version {stored.version} is {_age(age)} old (bound {_age(config.max_age_s)}); "
            "run `toposched topo refresh`",
            markup=False,
            soft_wrap=True,
        )
    if json_out:
        print_json(
            topology_json(
                stored.cluster,
                stored.domain_map,
                source=stored.source.describe(),
                version=stored.version,
                created_at=stored.created_at,
                stale=stale,
            )
        )
    else:
        _render(
            stored.cluster,
            stored.domain_map,
            f"[bold]{escape(stored.cluster.name)}[/] DomainMap v{stored.version} from "
            f"{escape(stored.source.describe())}, "
            f"{_age(age)} old" + (" [red](stale)[/]" if stale else ""),
        )


@topo_app.command("refresh")
def refresh(
    smi: str | None = SMI,
    preset: str | None = PRESET,
    cluster: str | None = CLUSTER,
    live: bool = LIVE,
    p2p: str | None = P2P,
    state: str | None = STATE,
    json_out: bool = typer.Option(False, "--json", help="Print the stored version as JSON."),
) -> None:
    """Probe a source again and store a new DomainMap version (default: the source of the last one)."""
    url, store = open_store(state)
    ref = source_ref(smi, preset, cluster, live)
    previous = store.latest()
    if ref is None:
        ref = previous.source if previous is not None else SourceRef(kind="live")
    if p2p is not None:
        ref = ref.model_copy(update={"p2p": p2p})
    loaded: Loaded = load_source(ref)
    for w in loaded.warnings:
        err_console.print(f"warning: {w}", markup=False, soft_wrap=True)
    saved = store.save(loaded.cluster, loaded.source)
    changed = previous is None or previous.domain_map.cluster_fingerprint != saved.domain_map.cluster_fingerprint
    if json_out:
        print_json(
            {
                "version": saved.version,
                "created_at": saved.created_at,
                "source": saved.source.describe(),
                "state": url,
                "changed": changed,
                "gpus": saved.cluster.gpu_count,
                "nvlink_domains": len(saved.domain_map.domains),
            }
        )
        return
    note = "changed" if changed and previous is not None else ("first version" if previous is None else "unchanged")
    console.print(
        f"stored DomainMap v{saved.version} ({note}) from {saved.source.describe()}: "
        f"{saved.cluster.gpu_count} GPUs, {len(saved.domain_map.domains)} NVLink domains "
        f"-> {url}  [{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(saved.created_at))}]",
        markup=False,
        soft_wrap=True,
    )


@topo_app.command("presets")
def list_presets(json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the built-in machines and clusters."""
    rows = []
    for p in presets():
        c = p.build()
        rows.append({"name": p.name, "nodes": len(c.nodes), "gpus": c.gpu_count, "description": p.description})
    if json_out:
        print_json(rows)
        return
    table = Table(title="Topology presets", title_justify="left")
    for col in ("name", "nodes", "GPUs", "description"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["name"]), str(r["nodes"]), str(r["gpus"]), str(r["description"]))
    console.print(table)
