"""Scenario and cluster references resolved: a built-in scenario by name or a scenario YAML file
(errors name the file and the key), and a cluster preset, ``NxPRESET`` or a cluster spec file."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import ValidationError

from toposched.errors import InputError, SpecError, first_problem
from toposched.inputs import load_yaml, read_text
from toposched.sim.builtin_scenarios import SCENARIOS
from toposched.sim.scenario import MAX_REF, MAX_SCENARIO_BYTES, Scenario
from toposched.topology.model import Cluster, Fabric
from toposched.topology.presets import load_preset, preset_node
from toposched.topology.spec import MAX_GPUS, MAX_NODES, load_cluster_spec


def _exists(ref: str) -> bool:
    """Whether ``ref`` names an existing file; False for names the OS cannot hold."""
    try:
        return Path(ref).exists()
    except (OSError, ValueError):
        return False


def _check_ref(ref: str, what: str) -> None:
    if not ref or len(ref) > MAX_REF or "\x00" in ref:
        shown = repr(ref) if len(ref) <= 60 else repr(ref[:57]) + "..."
        raise InputError(f"{what} {shown} is not a name or a path", fix=f"at most {MAX_REF} characters, no NUL byte")


def _relative(raw: dict[str, object], key: str, base: Path) -> None:
    """A relative path in ``raw[key]`` becomes relative to the scenario file's folder when it exists there."""
    value = raw.get(key)
    if isinstance(value, str) and value and len(value) <= MAX_REF and _exists(str(base / value)):
        raw[key] = str(base / value)


def load_scenario(ref: str) -> Scenario:
    """A built-in scenario by name, or a YAML file; errors name the file and the key path.

    The file is read through ``toposched.inputs`` (a bounded regular UTF-8 file, YAML without
    duplicate keys or deep nesting); every number must be finite and within its field's bounds.
    """
    _check_ref(ref, "scenario")
    path = Path(ref)
    if not _exists(ref):
        return SCENARIOS.get(ref)
    source = str(path)
    text = read_text(path, what="scenario file", max_bytes=MAX_SCENARIO_BYTES)
    try:
        raw = load_yaml(text, source=source)
    except SpecError:
        raise
    except InputError as exc:
        raise SpecError(source, "", exc.message.removeprefix(f"{source}: "), fix=exc.fix) from None
    except ValueError as exc:  # PyYAML's int() of a 5,000-digit literal (Python's digit limit)
        raise SpecError(source, "", f"a number is too long to read ({str(exc).split(';')[0]})") from None
    if not isinstance(raw, dict):
        raise SpecError(source, "", "a scenario file is a mapping of fields")
    for key in ("model", "cluster", "trace"):  # relative paths are relative to the scenario file
        _relative(raw, key, path.parent)
    tenants = raw.get("tenants")
    if isinstance(tenants, list):
        raw["tenants"] = [dict(t) if isinstance(t, dict) else t for t in tenants]
        for tenant in raw["tenants"]:
            if isinstance(tenant, dict):
                _relative(tenant, "model", path.parent)
    try:
        return Scenario.model_validate(raw)
    except ValidationError as exc:
        problem = first_problem(exc)
        raise SpecError(source, problem.path, problem.msg) from None


def load_cluster(ref: str) -> Cluster:
    """A preset, ``NxPRESET`` (N copies of a one-node preset, racks of 8, zones of 64, 8x400G IB) or a spec."""
    _check_ref(ref, "cluster")
    m = re.fullmatch(r"([0-9]+)x([A-Za-z0-9][A-Za-z0-9._-]*)", ref)  # ASCII digits, a preset name (no spaces)
    if m and not _exists(ref):
        digits, preset = m.group(1), m.group(2)
        count = int(digits) if len(digits) <= 6 else MAX_NODES + 1
        if not 1 <= count <= MAX_NODES:
            raise InputError(f"cluster {ref[:60]!r}: the node count must be between 1 and {MAX_NODES}")
        width = len(str(count - 1))
        base = preset_node(preset)
        if count * len(base.gpus) > MAX_GPUS:
            raise InputError(
                f"cluster {ref[:60]!r}: {count * len(base.gpus):,} GPUs; at most {MAX_GPUS:,} are accepted "
                "(building 65,536 takes about 20 s and 2 GB)",
                fix=f"use at most {MAX_GPUS // max(len(base.gpus), 1):,} nodes of {preset}",
            )
        nodes = [
            base.model_copy(
                update={"name": f"{preset}-{n:0{width}d}", "rack": f"rack{n // 8}", "zone": f"zone{n // 64}"}
            )
            for n in range(count)
        ]
        return Cluster(name=ref, nodes=tuple(nodes), fabric=Fabric(kind="IB", nic_gbps=50.0, nics_per_node=8))
    if _exists(ref):
        return load_cluster_spec(ref)
    return load_preset(ref)
