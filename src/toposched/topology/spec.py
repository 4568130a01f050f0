"""Cluster specs: a YAML file that describes many nodes, the fabric and multi-node NVLink cliques.

```yaml
name: prod-east
fabric: {kind: IB, nic_gbit_per_s: 400, nics_per_node: 8, rail_optimized: true, socket_ifname: eth0}
nodes:
  - name: "h100-{i:02d}"        # "{i}" expands with count
    count: 4
    preset: hgx-h100              # exactly one of preset / smi / probe
    rack: rack0
    zone: zone-a
  - name: gpu-21
    smi: topo/gpu-21.txt          # nvidia-smi topo -m capture, relative to this file
    gpu_model: NVIDIA A100-SXM4-80GB
    hbm_gib: 80
    labels: {pool: batch}
  - name: gpu-22
    probe: probes/gpu-22.json     # saved `toposched topo show --live --json`
  - name: "l40s-{i}"
    count: 2
    preset: l40s-8x-pcie          # (any preset, smi capture or probe)
    p2p: off                      # peer-to-peer off on every GPU pair (on | off; default unknown)
  - name: l40s-9
    smi: topo/l40s-9.txt
    p2p_file: topo/l40s-9-p2p.txt # nvidia-smi topo -p2p r capture: status per GPU pair
cliques:
  - id: nvl72-a
    nodes: [tray-00, tray-01]
```

Validation errors name the key path (``nodes.1.smi``) and the file. The spec and the files it
names are read through ``toposched.inputs`` (bounded regular files, strict UTF-8, YAML without
duplicate keys or deep nesting); numbers must be finite; a node name pattern may only number
``{i}`` with a plain width (``{i}``, ``{i:02d}``) and every name it makes must be a hostname
(``toposched.names``), checked before anything is formatted; at most :data:`MAX_NODES` nodes.

Peer-to-peer: a PCIe-only node's TP all-reduce is costed with the P2P-on table unless the node says
otherwise (``perf/links.py`` ``pcie_link``): ``p2p: off`` (YAML's on/off/true/false) sets every GPU
pair, ``p2p_file:`` reads an ``nvidia-smi topo -p2p r`` capture (``topology/p2p.py``); not both.

NIC speed: ``nic_gbit_per_s`` is the line rate NICs are sold by (200 HDR, 400 NDR, 800 XDR). The
older ``nic_gbps`` (gigaBYTES per second, NDR = 50) still reads, but a figure above what any NIC
carries (``nic_gbps: 400``, a "400G" NIC in the wrong unit) is an error naming the fix.
"""

from __future__ import annotations

import hashlib
import math
import re
import string
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from toposched.errors import InputError, SpecError, TopologyParseError, first_problem
from toposched.inputs import load_json, load_yaml, read_text
from toposched.names import MAX_LABEL, MAX_NODE_NAME, GpuModel, Label, LabelValue, NodeName, node_name_problem
from toposched.topology.model import NIC_MAX_GBPS, Cluster, Fabric, Node, NVLinkClique
from toposched.topology.p2p import apply_p2p, parse_p2p_matrix, set_p2p
from toposched.topology.presets import preset_node
from toposched.topology.smi import parse_topo_matrix

MAX_NODES = 100_000
"""Most nodes one spec may describe, all entries together (as ``NxPRESET`` in scenarios)."""

MAX_GPUS = 65_536
"""Most GPUs one spec (or ``NxPRESET``) may describe: what a 2-core, 24 GiB machine builds in seconds. Measured
(issue 37, 2-core AMD EPYC VM): 8,192 HGX H100 nodes (65,536 GPUs) take 22 s and 2.0 GB to build and print
(`topo show --cluster`); 80,000 GPUs took 35 s and 2.5 GB, and the node limit alone let 800,000 through
(about 25 GB by extrapolation)."""

MAX_SPEC_BYTES = 512 * 1024
"""Largest spec file read: about 5,000 one-line node entries (``count`` patterns describe more).
The YAML reader is pure Python (~6 us a byte), so this keeps a spec under about 4 s to parse."""

MAX_PATH = 4096
"""Longest smi/probe path accepted in a spec."""

_WIDTH = re.compile(r"0?(\d{0,3})d?")  # the format specs a node name may use: '', 'd', '02d', '3'
_PRINTABLE = r"^[^\x00-\x1f\x7f]+$"

FilePath = Annotated[str, Field(min_length=1, max_length=MAX_PATH, pattern=r"^[^\x00]+$")]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class NodeSpec(_Spec):
    name: str = Field(min_length=1, max_length=512, description="hostname; '{i}' is replaced by 0..count-1")
    count: int = Field(default=1, ge=1, le=10_000, description="how many nodes this entry describes")
    preset: str | None = Field(default=None, max_length=200)
    smi: FilePath | None = Field(default=None, description="path to an nvidia-smi topo -m capture")
    probe: FilePath | None = Field(default=None, description="path to a saved `topo show --live --json`")
    gpu_model: GpuModel | None = Field(default=None, description="GPU model for smi captures (they do not say)")
    hbm_gib: float | None = Field(default=None, gt=0, le=4096, description="HBM per GPU for smi captures")
    rack: Label | None = None
    zone: Label | None = None
    labels: dict[Label, LabelValue] = Field(default_factory=dict, max_length=256)
    p2p: bool | None = Field(default=None, description="peer-to-peer on every GPU pair: on/off (default unknown)")
    p2p_file: FilePath | None = Field(default=None, description="path to an nvidia-smi topo -p2p r capture")

    @model_validator(mode="after")
    def _one_source(self) -> NodeSpec:
        given = [k for k in ("preset", "smi", "probe") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of preset, smi, probe (got {', '.join(given) or 'none'})")
        if self.p2p is not None and self.p2p_file is not None:
            raise ValueError("give p2p (on/off for every pair) or p2p_file (a capture), not both")
        return self


class CliqueSpec(_Spec):
    id: Label
    nodes: list[NodeName] = Field(min_length=1, max_length=MAX_NODES)
    bandwidth_gbps: float = Field(default=900.0, gt=0, le=1e6)


class ClusterSpec(_Spec):
    version: Literal[1] = 1
    name: str = Field(default="cluster", min_length=1, max_length=MAX_NODE_NAME, pattern=_PRINTABLE)
    fabric: Fabric | None = None
    nodes: list[NodeSpec] = Field(min_length=1, max_length=MAX_NODES)
    cliques: list[CliqueSpec] = Field(default_factory=list, max_length=MAX_NODES)


def _key_path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc)


def _non_finite(value: Any) -> str | None:
    """The key path of the first NaN or infinite number in a loaded document, or None."""
    stack: list[tuple[Any, str]] = [(value, "")]
    seen: set[int] = set()  # YAML anchors can make a list contain itself
    while stack:
        item, path = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path or "(top level)"
        if isinstance(item, (dict, list)):
            if id(item) in seen:
                continue
            seen.add(id(item))
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(item))
    return None


def _nic_speed(fabric: Any, source: str) -> Any:
    """``fabric`` with its NIC speed as ``nic_gbps`` (GB/s), whichever unit the spec used, checked
    against what NICs carry; anything else is left to the model's validation."""
    if not isinstance(fabric, dict):
        return fabric
    gbit, gbyte = fabric.get("nic_gbit_per_s"), fabric.get("nic_gbps")
    number = (int, float)
    if gbit is not None and gbyte is not None:
        raise SpecError(
            source,
            "fabric",
            "give nic_gbit_per_s or nic_gbps, not both",
            fix="keep nic_gbit_per_s (Gb/s, as NICs are sold)",
        )
    if gbit is not None:
        if not isinstance(gbit, number) or isinstance(gbit, bool) or not 0 < gbit <= NIC_MAX_GBPS * 8:
            raise SpecError(
                source,
                "fabric.nic_gbit_per_s",
                f"{gbit!r} is not a NIC speed in Gb/s (above 0, at most {NIC_MAX_GBPS * 8:g})",
                fix="e.g. nic_gbit_per_s: 400 for InfiniBand NDR",
            )
        rest = {key: value for key, value in fabric.items() if key != "nic_gbit_per_s"}
        return {**rest, "nic_gbps": gbit / 8}
    if isinstance(gbyte, number) and not isinstance(gbyte, bool) and gbyte > NIC_MAX_GBPS:
        raise SpecError(
            source,
            "fabric.nic_gbps",
            f"{gbyte:g} GB/s per NIC is more than any NIC carries ({NIC_MAX_GBPS:g} GB/s = 800 Gb/s XDR); "
            "nic_gbps is in gigaBYTES per second",
            fix=f"for a {gbyte:g} Gb/s NIC write nic_gbit_per_s: {gbyte:g}",
        )
    return fabric


def _as_spec_error(exc: InputError, source: str) -> SpecError:
    """A reader's error about the spec file as a ``SpecError`` (same message, same fix)."""
    if isinstance(exc, SpecError):  # already names the key path
        return exc
    return SpecError(source, "", exc.message.removeprefix(f"{source}: "), fix=exc.fix)


def load_cluster_spec(path: str | Path, *, warnings: list[str] | None = None) -> Cluster:
    """Read a cluster spec YAML file into a ``Cluster``; raise ``SpecError`` naming the key path.

    Warnings about the files the spec names (an smi capture whose NIC legend is cut, say) are
    appended to ``warnings`` when a list is given, each naming the spec, the key and the file.
    """
    path = Path(path)
    source = str(path)
    if "\x00" in source:
        raise InputError(f"cluster spec {source[:200]!r}: a path cannot contain a NUL byte", fix="check the path")
    text = read_text(path, what="cluster spec", max_bytes=MAX_SPEC_BYTES)
    try:
        raw = load_yaml(text, source=source)
    except InputError as exc:
        raise _as_spec_error(exc, source) from None
    except ValueError as exc:  # PyYAML's int() of a 5,000-digit literal (Python's digit limit)
        raise SpecError(source, "", f"a number is too long to read ({str(exc).split(';')[0]})") from None
    if not isinstance(raw, dict):
        raise SpecError(source, "", "the top level must be a mapping with 'nodes'")
    bad = _non_finite(raw)
    if bad is not None:
        raise SpecError(source, bad, "numbers must be finite (not .inf or .nan)")
    if "fabric" in raw:
        raw = {**raw, "fabric": _nic_speed(raw["fabric"], source)}
    try:
        spec = ClusterSpec.model_validate(raw)
    except ValidationError as exc:
        problem = first_problem(exc)
        raise SpecError(source, _key_path(problem.loc), problem.msg) from None
    return build_cluster(spec, base=path.parent, source=source, warnings=warnings)


def _name_pattern(entry: NodeSpec, where: str, source: str) -> str:
    """Check a node name pattern without formatting it: only ``{i}`` with a plain width, bounded length."""
    try:
        parts = list(string.Formatter().parse(entry.name))
    except ValueError as exc:
        raise SpecError(source, f"{where}.name", f"cannot expand {entry.name!r}: {exc}") from None
    longest = 0
    fields = 0
    digits = len(str(entry.count - 1))
    for literal, field, spec, conversion in parts:
        longest += len(literal)
        if field is None:
            continue
        fields += 1
        width = _WIDTH.fullmatch(spec or "")
        if field != "i" or conversion or width is None:
            raise SpecError(
                source,
                f"{where}.name",
                f"{entry.name!r}: only '{{i}}' or '{{i:0Nd}}' may be used in a node name",
                fix='e.g. name: "h100-{i:02d}"',
            )
        longest += max(int(width.group(1) or 0), digits)
    if entry.count > 1 and not fields:
        raise SpecError(
            source, where, f"count is {entry.count} but name {entry.name!r} has no '{{i}}' to number the nodes"
        )
    if longest > MAX_NODE_NAME:
        raise SpecError(
            source,
            f"{where}.name",
            f"{entry.name!r} makes names of up to {longest:,} characters (a node name has at most {MAX_NODE_NAME})",
        )
    return entry.name


def _read(file: Path, what: str, key: str, source: str) -> str:
    try:
        return read_text(file, what=what)
    except InputError as exc:
        raise SpecError(source, key, exc.message, fix=exc.fix) from None


def _template(entry: NodeSpec, where: str, base: Path, source: str, warnings: list[str]) -> Node:
    """The node an entry describes, before it is named: a preset, an smi capture or a saved probe."""
    if entry.preset:
        try:
            return preset_node(entry.preset)
        except InputError as exc:
            raise SpecError(source, f"{where}.preset", exc.message) from None
    if entry.smi:
        file = base / entry.smi
        text = _read(file, "nvidia-smi capture", f"{where}.smi", source)
        try:
            parsed = parse_topo_matrix(text, source=str(file), hostname=None)
        except TopologyParseError as exc:
            raise SpecError(source, f"{where}.smi", exc.message) from None
        node = parsed.node
        warnings.extend(f"{source}: {where}.smi: {file}: {w}" for w in parsed.warnings)
        if entry.gpu_model or entry.hbm_gib:
            gpus = tuple(g.model_copy(update={"model": entry.gpu_model, "hbm_gib": entry.hbm_gib}) for g in node.gpus)
            node = node.model_copy(update={"gpus": gpus})
        return node
    file = base / str(entry.probe)
    text = _read(file, "saved probe", f"{where}.probe", source)
    try:
        data = load_json(text, source=str(file))
    except InputError as exc:
        raise SpecError(source, f"{where}.probe", exc.message) from None
    node_data: Any = data
    if isinstance(data, dict) and "cluster" in data:
        cluster = data["cluster"]
        nodes = cluster.get("nodes") if isinstance(cluster, dict) else None
        node_data = nodes[0] if isinstance(nodes, list) and nodes else None
    try:
        return Node.model_validate(node_data)
    except ValidationError as exc:
        first = first_problem(exc)
        at = _key_path(first.loc)
        problem = f"{at}: {first.msg}" if at else first.msg
        raise SpecError(source, f"{where}.probe", f"{file} is not a saved probe ({problem})") from None


def _with_p2p(node: Node, entry: NodeSpec, where: str, base: Path, source: str) -> Node:
    """``node`` with the entry's peer-to-peer availability on its GPU pairs (unchanged without one)."""
    if entry.p2p is not None:
        return set_p2p(node, entry.p2p)
    if entry.p2p_file is None:
        return node
    file = base / entry.p2p_file
    text = _read(file, "P2P capture", f"{where}.p2p_file", source)
    try:
        return apply_p2p(node, parse_p2p_matrix(text, source=str(file)))
    except InputError as exc:
        raise SpecError(source, f"{where}.p2p_file", exc.message, fix=exc.fix) from None


def _preset_uuid(uuid: str, node: str) -> str:
    """A preset GPU's UUID made unique per node; a digest of the node name when it would be too long."""
    unique = f"{uuid}-{node}"
    if len(unique) <= MAX_LABEL:
        return unique
    return f"{uuid}-{hashlib.sha256(node.encode()).hexdigest()[:16]}"


def _named(template: Node, entry: NodeSpec, name: str) -> Node:
    """``template`` as the node called ``name``; spec fields override what the source said.

    Every value put in was validated already (the name by :func:`node_name_problem`, rack, zone
    and labels by ``NodeSpec``), so the copy skips revalidating the unchanged GPU picture.
    """
    gpus = template.gpus
    if entry.preset:  # UUIDs stay unique across nodes made from one preset
        gpus = tuple(g.model_copy(update={"uuid": g.uuid and _preset_uuid(g.uuid, name)}) for g in gpus)
    update = {"name": name, "rack": entry.rack, "zone": entry.zone, "labels": dict(entry.labels), "gpus": gpus}
    return template.model_copy(update=update)


def build_cluster(
    spec: ClusterSpec, *, base: Path = Path("."), source: str = "<spec>", warnings: list[str] | None = None
) -> Cluster:
    """Turn a validated spec into a ``Cluster`` (reads smi/probe files relative to ``base``)."""
    found: list[str] = [] if warnings is None else warnings
    total = sum(entry.count for entry in spec.nodes)
    if total > MAX_NODES:
        raise SpecError(source, "nodes", f"describes {total:,} nodes; at most {MAX_NODES:,} are accepted")
    patterns = [_name_pattern(entry, f"nodes.{n}", source) for n, entry in enumerate(spec.nodes)]
    nodes: list[Node] = []
    entry_of: dict[str, int] = {}
    gpus = 0
    for n, entry in enumerate(spec.nodes):
        where = f"nodes.{n}"
        template = _with_p2p(_template(entry, where, base, source, found), entry, where, base, source)
        gpus += len(template.gpus) * entry.count
        if gpus > MAX_GPUS:
            raise SpecError(
                source,
                where,
                f"the spec describes more than {MAX_GPUS:,} GPUs (at least {gpus:,} by this entry); at most "
                f"{MAX_GPUS:,} are accepted (building 65,536 takes about 20 s and 2 GB)",
                fix="split the cluster into several specs, or lower the counts",
            )
        for i in range(entry.count):
            name = patterns[n].format(i=i)
            problem = node_name_problem(name)
            if problem:
                raise SpecError(source, f"{where}.name", problem, fix="use a hostname such as 'gpu-node-01'")
            if name in entry_of:
                raise SpecError(source, f"{where}.name", f"node {name!r} is also named by nodes.{entry_of[name]}")
            entry_of[name] = n
            node = _named(template, entry, name)
            if i == 0:  # the copies skip validation: check one node per entry against the full model
                try:
                    Node.model_validate(node.model_dump())
                except ValidationError as exc:
                    bad = first_problem(exc)
                    raise SpecError(source, where, f"{_key_path(bad.loc)}: {bad.msg}") from None
            nodes.append(node)
    for k, clique in enumerate(spec.cliques):
        unknown = [name for name in clique.nodes if name not in entry_of]
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise SpecError(source, f"cliques.{k}.nodes", f"unknown node(s): {shown}")
    try:
        return Cluster(
            name=spec.name,
            nodes=tuple(nodes),
            fabric=spec.fabric,
            cliques=tuple(
                NVLinkClique(id=c.id, nodes=tuple(c.nodes), bandwidth_gbps=c.bandwidth_gbps) for c in spec.cliques
            ),
        )
    except ValidationError as exc:
        bad = first_problem(exc)
        raise SpecError(source, _key_path(bad.loc) or "cluster", bad.msg) from None
