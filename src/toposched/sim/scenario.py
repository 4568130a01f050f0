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

A scenario file (YAML) has the same fields; see docs/simulator.md. Every field is bounded (at most
``MAX_REQUESTS`` requests, durations up to ``MAX_SECONDS``, finite numbers only), so a damaged or
hostile file gets one error naming the file and the key, never an unbounded run.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from toposched.errors import InputError, SpecError
from toposched.inputs import load_yaml, read_text
from toposched.names import node_name_problem
from toposched.registry import Registry
from toposched.topology.model import Cluster, Fabric
from toposched.topology.presets import load_preset, preset_node
from toposched.topology.spec import MAX_NODES, load_cluster_spec

MAX_REQUESTS = 1_000_000
"""Most requests one scenario or trace may hold (10x the largest built-in scenario)."""

MAX_SECONDS = 1e7
"""Longest duration (rate period, SLO, timeout, start-up) a scenario may give: about 115 days."""

MAX_SCENARIO_BYTES = 128 * 1024
"""Largest scenario file read (a scenario is a few fields and at most ``MAX_FAILURES`` failures)."""

MAX_FAILURES = 1000
"""Most scheduled failures one scenario may list."""

MAX_REF = 4096
"""Longest cluster / model / trace reference (a name or a path)."""

Ref = Annotated[str, Field(min_length=1, max_length=MAX_REF, pattern=r"^[^\x00]+$")]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Arrivals(_Value):
    """How requests arrive (ignored when a trace is given)."""

    kind: Literal["poisson", "bursty"] = "poisson"
    rate_per_s: float = Field(default=10.0, gt=0, le=1e6, description="mean arrival rate")
    burst_factor: float = Field(default=4.0, ge=1, le=100, description="bursty: rate multiplier inside a burst")
    burst_every_s: float = Field(default=60.0, gt=0, le=MAX_SECONDS, description="bursty: one burst per this many s")
    burst_length_s: float = Field(default=10.0, gt=0, le=MAX_SECONDS, description="bursty: how long a burst lasts")


class Lengths(_Value):
    dist: Literal["fixed", "uniform"] = "fixed"
    mean: int = Field(default=1024, ge=1, le=1_000_000)
    spread: float = Field(default=0.5, ge=0, lt=1, description="uniform: +/- this fraction of the mean")


def gpu_ref_problem(ref: str) -> str | None:
    """Why ``ref`` is not a GPU reference ``node/index``, or None when it is."""
    node, slash, index = ref.rpartition("/")
    if not slash or not index.isascii() or not index.isdigit() or len(index) > 6:
        return f"{ref[:60]!r} is not a GPU reference 'node/index' such as 'hgx-h100-1/3'"
    return node_name_problem(node)


class Failure(_Value):
    at_s: Seconds
    gpu: str = Field(max_length=300, description="GPU ref 'node/index'")
    kind: Literal["gpu-down", "nvlink-down"] = "gpu-down"
    """gpu-down: out of service; nvlink-down: leaves its NVLink domain but can serve alone."""

    @field_validator("gpu")
    @classmethod
    def _gpu_ref(cls, value: str) -> str:
        problem = gpu_ref_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class Scenario(_Value):
    """Everything one simulation run needs; every field has a default except the cluster and model."""

    name: str = Field(default="scenario", min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
    cluster: Ref = Field(description="preset name, 'NxPRESET' (N nodes of a one-node preset) or cluster spec path")
    model: Ref = Field(description="catalog name, Hugging Face id or config.json path")
    weight_dtype: str | None = Field(default=None, max_length=40)
    kv_dtype: str | None = Field(default=None, max_length=40)
    requests: int = Field(default=1000, ge=1, le=MAX_REQUESTS)
    arrivals: Arrivals = Arrivals()
    input_len: Lengths = Lengths()
    output_len: Lengths = Lengths(mean=256)
    slo_ms: float = Field(
        default=100.0, gt=0, le=MAX_SECONDS, description="per-token latency SLO (end-to-end / output tokens)"
    )
    slo_mix: dict[str, float] = Field(default_factory=lambda: {"interactive": 1.0}, max_length=4)
    batch: int = Field(default=32, ge=1, le=4096, description="sequences one instance serves at once")
    instances: int | Literal["max"] = Field(
        default="max", description="instances placed at the start (at most MAX_REQUESTS; checked against the GPUs)"
    )
    autoscale: bool = True
    instance_startup_s: Seconds = 0.0
    timeout_s: float = Field(
        default=600.0, gt=0, le=MAX_SECONDS, description="a request waiting longer than this times out"
    )
    failures: tuple[Failure, ...] = Field(default=(), max_length=MAX_FAILURES)
    trace: Ref | None = Field(default=None, description="CSV: timestamp,model,input_len,output_len,slo_class")
    budget_gbps: float = Field(default=256.0, gt=0, le=1e9)

    @field_validator("instances")
    @classmethod
    def _instances(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= MAX_REQUESTS:
            raise ValueError(f"instances must be 'max' or from 1 to {MAX_REQUESTS:,}, got {value}")
        return value

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
        value = raw.get(key)
        if isinstance(value, str) and value and len(value) <= MAX_REF and _exists(str(path.parent / value)):
            raw[key] = str(path.parent / value)
    try:
        return Scenario.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise SpecError(source, ".".join(str(p) for p in err["loc"]), err["msg"]) from None


def load_cluster(ref: str) -> Cluster:
    """A preset, ``NxPRESET`` (N copies of a one-node preset, racks of 8, zones of 64, 8x400G IB) or a spec."""
    _check_ref(ref, "cluster")
    m = re.fullmatch(r"(\d+)x(.+)", ref)
    if m and not _exists(ref):
        digits, preset = m.group(1), m.group(2)
        count = int(digits) if len(digits) <= 6 else MAX_NODES + 1
        if not 1 <= count <= MAX_NODES:
            raise InputError(f"cluster {ref[:60]!r}: the node count must be between 1 and {MAX_NODES}")
        width = len(str(count - 1))
        base = preset_node(preset)
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
