"""Cluster specs: a YAML file that describes many nodes, the fabric and multi-node NVLink cliques.

```yaml
name: prod-east
fabric: {kind: IB, nic_gbps: 50, nics_per_node: 8, rail_optimized: true, socket_ifname: eth0}
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
cliques:
  - id: nvl72-a
    nodes: [tray-00, tray-01]
```

Validation errors name the key path (``nodes.1.smi``) and the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from toposched.errors import InputError, SpecError, TopologyParseError
from toposched.topology.model import Cluster, Fabric, Node, NVLinkClique
from toposched.topology.presets import preset_node
from toposched.topology.smi import parse_topo_matrix


class NodeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="hostname; '{i}' is replaced by 0..count-1")
    count: int = Field(default=1, ge=1, le=10_000, description="how many nodes this entry describes")
    preset: str | None = None
    smi: str | None = Field(default=None, description="path to an nvidia-smi topo -m capture")
    probe: str | None = Field(default=None, description="path to a saved `topo show --live --json`")
    gpu_model: str | None = Field(default=None, description="GPU model for smi captures (they do not say)")
    hbm_gib: float | None = Field(default=None, gt=0, le=4096, description="HBM per GPU for smi captures")
    rack: str | None = None
    zone: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_source(self) -> NodeSpec:
        given = [k for k in ("preset", "smi", "probe") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of preset, smi, probe (got {', '.join(given) or 'none'})")
        if self.count > 1 and "{i" not in self.name:
            raise ValueError(f"count is {self.count} but name {self.name!r} has no '{{i}}' to number the nodes")
        return self


class CliqueSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    nodes: list[str] = Field(min_length=1)
    bandwidth_gbps: float = Field(default=900.0, gt=0)


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    name: str = "cluster"
    fabric: Fabric | None = None
    nodes: list[NodeSpec] = Field(min_length=1)
    cliques: list[CliqueSpec] = Field(default_factory=list)


def _key_path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc)


def load_cluster_spec(path: str | Path) -> Cluster:
    """Read a cluster spec YAML file into a ``Cluster``; raise ``SpecError`` naming the key path."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise InputError(f"cluster spec {path} does not exist") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        raise SpecError(str(path), where, f"not valid YAML ({getattr(exc, 'problem', exc)})") from exc
    if not isinstance(raw, dict):
        raise SpecError(str(path), "", "the top level must be a mapping with 'nodes'")
    try:
        spec = ClusterSpec.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise SpecError(str(path), _key_path(tuple(err["loc"])), err["msg"]) from exc
    return build_cluster(spec, base=path.parent, source=str(path))


def _node_from(entry: NodeSpec, name: str, where: str, base: Path, source: str) -> Node:
    if entry.preset:
        try:
            node = preset_node(entry.preset)
        except InputError as exc:
            raise SpecError(source, f"{where}.preset", exc.message) from exc
    elif entry.smi:
        file = base / entry.smi
        try:
            text = file.read_text(errors="replace")
        except OSError as exc:
            raise SpecError(source, f"{where}.smi", f"cannot read {file}: {exc.strerror}") from exc
        try:
            node = parse_topo_matrix(text, source=str(file), hostname=name).node
        except TopologyParseError as exc:
            raise SpecError(source, f"{where}.smi", exc.message) from exc
        if entry.gpu_model or entry.hbm_gib:
            gpus = tuple(g.model_copy(update={"model": entry.gpu_model, "hbm_gib": entry.hbm_gib}) for g in node.gpus)
            node = node.model_copy(update={"gpus": gpus})
    else:
        file = base / str(entry.probe)
        try:
            data: Any = json.loads(file.read_text())
            node_data = data["cluster"]["nodes"][0] if "cluster" in data else data
            node = Node.model_validate(node_data)
        except OSError as exc:
            raise SpecError(source, f"{where}.probe", f"cannot read {file}: {exc.strerror}") from exc
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise SpecError(source, f"{where}.probe", f"{file} is not a saved probe ({exc})") from exc
    # Node-level fields from the spec override what the source said; the GPU picture stays.
    return Node.model_validate(
        {
            **node.model_dump(),
            "name": name,
            "rack": entry.rack,
            "zone": entry.zone,
            "labels": entry.labels,
            "gpus": [g.model_copy(update={"uuid": g.uuid and f"{g.uuid}-{name}"}) for g in node.gpus]
            if entry.preset
            else node.gpus,
        }
    )


def build_cluster(spec: ClusterSpec, *, base: Path = Path("."), source: str = "<spec>") -> Cluster:
    """Turn a validated spec into a ``Cluster`` (reads smi/probe files relative to ``base``)."""
    nodes: list[Node] = []
    entry_of: dict[str, int] = {}
    for n, entry in enumerate(spec.nodes):
        for i in range(entry.count):
            try:
                name = entry.name.format(i=i)
            except (KeyError, IndexError, ValueError) as exc:
                raise SpecError(source, f"nodes.{n}.name", f"cannot expand {entry.name!r}: {exc}") from exc
            if name in entry_of:
                raise SpecError(source, f"nodes.{n}.name", f"node {name!r} is also named by nodes.{entry_of[name]}")
            entry_of[name] = n
            nodes.append(_node_from(entry, name, f"nodes.{n}", base, source))
    for k, clique in enumerate(spec.cliques):
        unknown = [name for name in clique.nodes if name not in entry_of]
        if unknown:
            raise SpecError(source, f"cliques.{k}.nodes", f"unknown node(s): {', '.join(unknown)}")
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
        err = exc.errors()[0]
        raise SpecError(source, _key_path(tuple(err["loc"])) or "cluster", err["msg"]) from exc
