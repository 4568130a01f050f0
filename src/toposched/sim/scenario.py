"""Simulation scenarios: the cluster, the model, the traffic and the failures, as one validated value.

Built-in scenarios (``SCENARIOS``):

* ``seed-256`` — seed 000's setting: 32 x HGX H100 (256 GPUs) over 8 x 400G InfiniBand; an FP8
  175B-class dense model (``data/scenarios/dense-175b-class.json``: GPT-3 175B's shape); 4,096
  requests of sequence length 2,048 (1,024 in, 1,024 out); instances with batch 32; per-token SLO
  100 ms. The seed gives no arrival rate; we use Poisson arrivals at 36 requests/s, about 90 % of
  what the topology-aware placement can serve (32 instances x 32 slots / ~25.6 s per request).
* ``small`` — 4 HGX H100 nodes, Llama-3.1-70B, 400 requests: for tests and quick looks.
* ``large-16k`` — 2,048 HGX H100 nodes (16,384 GPUs), Llama-3.1-70B, 100,000 requests: the
  performance scenario.

A scenario file (YAML) has the same fields; see docs/simulator.md.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from toposched.errors import InputError, SpecError
from toposched.registry import Registry
from toposched.topology.model import Cluster, Fabric
from toposched.topology.presets import load_preset, preset_node
from toposched.topology.spec import load_cluster_spec


class Arrivals(BaseModel):
    """How requests arrive (ignored when a trace is given)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["poisson", "bursty"] = "poisson"
    rate_per_s: float = Field(default=10.0, gt=0, le=1e6, description="mean arrival rate")
    burst_factor: float = Field(default=4.0, ge=1, le=100, description="bursty: rate multiplier inside a burst")
    burst_every_s: float = Field(default=60.0, gt=0, description="bursty: one burst per this many seconds")
    burst_length_s: float = Field(default=10.0, gt=0, description="bursty: how long a burst lasts")


class Lengths(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    dist: Literal["fixed", "uniform"] = "fixed"
    mean: int = Field(default=1024, ge=1, le=1_000_000)
    spread: float = Field(default=0.5, ge=0, lt=1, description="uniform: +/- this fraction of the mean")


class Failure(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    at_s: float = Field(ge=0)
    gpu: str = Field(description="GPU ref 'node/index'")
    kind: Literal["gpu-down", "nvlink-down"] = "gpu-down"
    """gpu-down: out of service; nvlink-down: leaves its NVLink domain but can serve alone."""


class Scenario(BaseModel):
    """Everything one simulation run needs; every field has a default except the cluster and model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "scenario"
    cluster: str = Field(description="preset name, 'NxPRESET' (N nodes of a one-node preset) or cluster spec path")
    model: str = Field(description="catalog name, Hugging Face id or config.json path")
    weight_dtype: str | None = None
    kv_dtype: str | None = None
    requests: int = Field(default=1000, ge=1, le=10_000_000)
    arrivals: Arrivals = Arrivals()
    input_len: Lengths = Lengths()
    output_len: Lengths = Lengths(mean=256)
    slo_ms: float = Field(default=100.0, gt=0, description="per-token latency SLO (end-to-end / output tokens)")
    slo_mix: dict[str, float] = Field(default_factory=lambda: {"interactive": 1.0})
    batch: int = Field(default=32, ge=1, le=4096, description="sequences one instance serves at once")
    instances: int | Literal["max"] = Field(default="max", description="instances placed at the start")
    autoscale: bool = True
    instance_startup_s: float = Field(default=0.0, ge=0)
    timeout_s: float = Field(default=600.0, gt=0, description="a request waiting longer than this times out")
    failures: tuple[Failure, ...] = ()
    trace: str | None = Field(default=None, description="CSV: timestamp,model,input_len,output_len,slo_class")
    budget_gbps: float = Field(default=256.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        bad = [c for c in self.slo_mix if c not in ("realtime", "interactive", "standard", "batch")]
        if bad:
            raise ValueError(f"slo_mix has unknown classes {bad}; use realtime, interactive, standard, batch")
        if not self.slo_mix or min(self.slo_mix.values()) < 0 or sum(self.slo_mix.values()) <= 0:
            raise ValueError("slo_mix needs non-negative shares with a positive sum")
        return self


def _dense_175b() -> str:
    return str(resources.files("toposched") / "data" / "scenarios" / "dense-175b-class.json")


SCENARIOS: Registry[Scenario] = Registry("scenario")
SCENARIOS.register(
    "seed-256",
    Scenario(
        name="seed-256",
        cluster="cluster-32x-hgx-h100",
        model=_dense_175b(),
        weight_dtype="fp8",
        requests=4096,
        arrivals=Arrivals(rate_per_s=36.0),
        input_len=Lengths(mean=1024),
        output_len=Lengths(mean=1024),
        slo_ms=100.0,
        batch=32,
    ),
)
SCENARIOS.register(
    "small",
    Scenario(
        name="small",
        cluster="4xhgx-h100",
        model="llama-3.1-70b",
        requests=400,
        arrivals=Arrivals(rate_per_s=20.0),
        input_len=Lengths(mean=512, dist="uniform"),
        output_len=Lengths(mean=128, dist="uniform"),
        slo_ms=60.0,
        slo_mix={"interactive": 0.7, "batch": 0.3},
        batch=16,
        failures=(Failure(at_s=5.0, gpu="hgx-h100-1/3"),),
    ),
)
SCENARIOS.register(
    "large-16k",
    Scenario(
        name="large-16k",
        cluster="2048xhgx-h100",
        model="llama-3.1-70b",
        requests=100_000,
        arrivals=Arrivals(rate_per_s=2000.0),
        input_len=Lengths(mean=512),
        output_len=Lengths(mean=128),
        slo_ms=30.0,
        batch=32,
    ),
)


def load_scenario(ref: str) -> Scenario:
    """A built-in scenario by name, or a YAML file; errors name the key path."""
    path = Path(ref)
    if not path.exists():
        return SCENARIOS.get(ref)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(str(path), "", f"not valid YAML ({exc})".splitlines()[0]) from exc
    if not isinstance(raw, dict):
        raise SpecError(str(path), "", "a scenario file is a mapping of fields")
    for key in ("model", "cluster", "trace"):  # relative paths are relative to the scenario file
        value = raw.get(key)
        if isinstance(value, str) and (path.parent / value).exists():
            raw[key] = str(path.parent / value)
    try:
        return Scenario.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise SpecError(str(path), ".".join(str(p) for p in err["loc"]), err["msg"]) from exc
    except InputError:
        raise


def load_cluster(ref: str) -> Cluster:
    """A preset, ``NxPRESET`` (N copies of a one-node preset, racks of 8, zones of 64, 8x400G IB) or a spec."""
    m = re.fullmatch(r"(\d+)x(.+)", ref)
    if m and not Path(ref).exists():
        count, preset = int(m.group(1)), m.group(2)
        if not 1 <= count <= 100_000:
            raise InputError(f"cluster {ref!r}: the node count must be between 1 and 100000")
        width = len(str(count - 1))
        base = preset_node(preset)
        nodes = [
            base.model_copy(
                update={"name": f"{preset}-{n:0{width}d}", "rack": f"rack{n // 8}", "zone": f"zone{n // 64}"}
            )
            for n in range(count)
        ]
        return Cluster(name=ref, nodes=tuple(nodes), fabric=Fabric(kind="IB", nic_gbps=50.0, nics_per_node=8))
    path = Path(ref)
    if path.exists():
        return load_cluster_spec(path)
    return load_preset(ref)
