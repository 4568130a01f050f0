"""Simulation scenarios: the cluster, the tenants, the traffic, churn and failures, as one validated value.

A scenario has one or more **tenants** (a model with its dtypes, TP, SLO class, batch, request
lengths and per-token SLO); all instances of a tenant form one deployment. Instances are either a
fixed set placed at the start (``instances``: a count or ``max``, as many as fit), or come and go
(``churn``): Poisson instance arrivals, exponential lifetimes, each instance bringing its own request
stream from its ready time (arrival + start-up) to its departure, placed or not. A scenario with
one tenant may give the tenant's fields at the top level
(``model``, ``batch``, ``input_len``, ``slo_ms`` ...), as the scenarios before issue 15 did.

A scenario file (YAML, read by ``sim/loading.py``) has the same fields; see docs/simulator.md. The
built-in scenarios are in ``sim/builtin_scenarios.py``. Every field is bounded (at most
``MAX_REQUESTS`` requests, durations up to ``MAX_SECONDS``, finite numbers only), so a damaged or
hostile file gets one error naming the file and the key, never an unbounded run.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from toposched.names import ObjectId, node_name_problem
from toposched.perf.engine_names import EngineVersion, cost_engine
from toposched.solver.request import SloClass

MAX_REQUESTS = 1_000_000
"""Most requests one scenario or trace may hold (10x the largest fixed scenario)."""

MAX_INSTANCES = 100_000
"""Most instance arrivals one churn run may generate (checked against the cluster before a run)."""

MAX_SECONDS = 1e7
"""Longest duration (rate period, SLO, timeout, start-up) a scenario may give: about 115 days."""

MAX_TOKENS = 1_000_000
"""Longest input or output of one request."""

MAX_SCENARIO_BYTES = 128 * 1024
"""Largest scenario file read (a scenario is a few fields and at most ``MAX_FAILURES`` failures)."""

MAX_FAILURES = 1000
"""Most scheduled failures one scenario may list."""

MAX_TENANTS = 64
"""Most tenants (deployments) in one scenario."""

MAX_REF = 4096
"""Longest cluster / model / trace reference (a name or a path)."""

SLO_CLASS_NAMES = ("realtime", "interactive", "standard", "batch")

Ref = Annotated[str, Field(min_length=1, max_length=MAX_REF, pattern=r"^[^\x00]+$")]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Arrivals(_Value):
    """How requests arrive in a scenario with a fixed set of instances (ignored with a trace or churn)."""

    kind: Literal["poisson", "bursty"] = "poisson"
    rate_per_s: float = Field(default=10.0, gt=0, le=1e6, description="mean arrival rate")
    burst_factor: float = Field(default=4.0, ge=1, le=100, description="bursty: rate multiplier inside a burst")
    burst_every_s: float = Field(default=60.0, gt=0, le=MAX_SECONDS, description="bursty: one burst per this many s")
    burst_length_s: float = Field(default=10.0, gt=0, le=MAX_SECONDS, description="bursty: how long a burst lasts")


class Lengths(_Value):
    """A distribution of token counts (prompt or output)."""

    dist: Literal["fixed", "uniform", "lognormal"] = "fixed"
    mean: int = Field(default=1024, ge=1, le=MAX_TOKENS)
    spread: float = Field(default=0.5, ge=0, lt=1, description="uniform: +/- this fraction of the mean")
    sigma: float = Field(default=0.5, gt=0, le=3, description="lognormal: sigma of the underlying normal")
    max: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS, description="lognormal: longest draw (default 4 x mean); draws are clipped"
    )

    @property
    def upper(self) -> int:
        """The longest value a draw can take (sizes the instances' max model length)."""
        if self.dist == "fixed":
            return self.mean
        if self.dist == "uniform":
            return max(1, round(self.mean * (1 + self.spread)))
        return self.max or min(4 * self.mean, MAX_TOKENS)

    @model_validator(mode="after")
    def _check(self) -> Lengths:
        if self.dist == "lognormal" and self.max is not None and self.max < self.mean:
            raise ValueError(f"max {self.max} is below the mean {self.mean}")
        return self


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


def _check_mix(mix: dict[str, float], what: str) -> None:
    bad = [c for c in mix if c not in SLO_CLASS_NAMES]
    if bad:
        raise ValueError(f"{what} has unknown classes {bad}; use realtime, interactive, standard, batch")
    if not mix or min(mix.values()) < 0 or not 0 < sum(mix.values()) < math.inf:
        raise ValueError(f"{what} needs non-negative shares with a positive, finite sum")


class Tenant(_Value):
    """One deployment: a model served by any number of identical instances."""

    name: ObjectId = Field(max_length=40, description="the deployment's name (instance ids derive from it)")
    model: Ref = Field(description="catalog name, Hugging Face id or config.json path")
    weight_dtype: str | None = Field(default=None, max_length=40)
    kv_dtype: str | None = Field(default=None, max_length=40)
    engine: Literal["vllm", "sglang", "trtllm"] = Field(
        default="vllm", description="the engine the instances run: it prices their steps (perf/latency.py)"
    )
    engine_version: EngineVersion | None = Field(
        default=None, max_length=41, description="its version: a profile entry fitted on that version prices it"
    )

    @property
    def cost_engine(self) -> str | None:
        """The engine and its version as the cost model takes them (``perf/engine_names.cost_engine``)."""
        return cost_engine(self.engine, self.engine_version)

    tp: int | Literal["auto"] = Field(default="auto", description="the TP degree of every instance, or auto")
    slo_class: SloClass = Field(default="interactive", description="the instances' class (admission, budget share)")
    slo_mix: dict[str, float] | None = Field(
        default=None, max_length=4, description="shares of request classes; default: all in slo_class"
    )
    batch: int = Field(default=32, ge=1, le=4096, description="max_num_seqs: sequences one instance runs at once")
    input_len: Lengths = Lengths()
    output_len: Lengths = Lengths(mean=256)
    slo_ms: float | None = Field(
        default=None, gt=0, le=MAX_SECONDS, description="per-token latency SLO (end-to-end / output tokens)"
    )
    slo_factor: float | None = Field(
        default=None,
        gt=0,
        le=1000,
        description="per-token SLO as this factor x the in-domain predicted per-token latency at the design batch",
    )
    weight: float = Field(default=1.0, gt=0, le=1e6, description="churn: share of instance arrivals")
    load: float | None = Field(
        default=None, gt=0, le=10, description="churn: requests per instance as a fraction of its capacity"
    )

    @field_validator("tp")
    @classmethod
    def _tp(cls, value: int | str) -> int | str:
        if isinstance(value, int) and (value < 1 or value > 1024 or value & (value - 1)):
            raise ValueError(f"tp must be 'auto' or a power of two from 1 to 1024, got {value}")
        return value

    @model_validator(mode="after")
    def _check(self) -> Tenant:
        if self.slo_mix is not None:
            _check_mix(self.slo_mix, "slo_mix")
        if (self.slo_ms is None) == (self.slo_factor is None):
            raise ValueError("give exactly one of slo_ms (milliseconds per token) and slo_factor")
        return self

    @property
    def max_model_len(self) -> int:
        """The context the instances reserve KV for: the longest prompt plus the longest output."""
        return self.input_len.upper + self.output_len.upper


class Churn(_Value):
    """Instances arriving and leaving (issue 15): the offered occupancy sets the arrival rate.

    rate = occupancy x GPUs / (mean GPUs per instance x (mean lifetime + start-up)): an instance
    holds its GPUs from booking (start-up) to departure, so offered occupancy is the share of GPU
    time the instances would hold if every one were placed at once.
    """

    occupancy: float = Field(default=0.85, gt=0, le=2, description="offered share of the cluster's GPU time")
    duration_s: float = Field(default=1800.0, gt=0, le=MAX_SECONDS, description="instance and request arrivals stop")
    mean_lifetime_s: float = Field(default=300.0, gt=0, le=MAX_SECONDS, description="exponential, from ready time")
    load: float = Field(default=0.7, gt=0, le=10, description="requests per instance / its in-domain capacity")
    start_full: bool = Field(
        default=True, description="start at the steady state: Poisson(rate x lifetime) instances already up"
    )


class Admission(_Value):
    """How instances that cannot be placed wait, fall back across domains and trigger defragmentation."""

    abandon_after_s: float = Field(default=600.0, gt=0, le=MAX_SECONDS, description="a waiting instance gives up")
    cross_domain: bool = Field(default=True, description="retry with allow_cross_domain after the class's wait")
    defrag: bool = Field(default=True, description="an instance needing a whole NVLink domain may trigger moves")
    # 30 s and at most 2 moves per 300 s, with the headroom below: on churn-128 at 0.85 with the
    # calibrated cost model (docs/simulator.md, medians of 3 seeds) the headroom alone brings TP=8
    # to 0.946 with no move; defragmenting after 30 s gives 0.977 at 3 moves per run with a limit of
    # 4 per window, 1 move with 2; after 60 s 0.972 at 1 move.
    defrag_after_s: float = Field(
        default=30.0, ge=0, le=MAX_SECONDS, description="wait this long for a departure before moving instances"
    )
    # One whole domain kept free for 30 s: on churn-128 at 0.85 (cost model before the measured
    # all-reduce curves) keeping two gave the same figures, a 15 s wait TP=8 0.969, 60 s 0.955
    # (small instances then hold GPUs idle for longer).
    keep_whole_domains: int = Field(
        default=1,
        ge=0,
        le=1024,
        description="an instance smaller than an NVLink domain does not break one of the last N wholly free "
        "domains (0: off)",
    )
    keep_whole_wait_s: float = Field(
        default=30.0, ge=0, le=MAX_SECONDS, description="... for at most this long; then it may break one"
    )
    defrag_max_moves: int = Field(default=4, ge=1, le=64, description="most moves of one defragmentation plan")
    defrag_moves_per_window: int = Field(default=2, ge=1, le=10_000, description="rate limit: moves ...")
    defrag_window_s: float = Field(default=300.0, gt=0, le=MAX_SECONDS, description="... per this many seconds")


PdLayout = Literal["same-server", "rack-local", "spread"]
PD_LAYOUTS: tuple[PdLayout, ...] = ("same-server", "rack-local", "spread")


class Pd(_Value):
    """Prefill/decode disaggregation (issue 20): the scenario's one tenant served by prefill and decode
    instances; each request is prefilled, its KV moves to a decode instance (in TTFT), then decodes.

    Each layout is one run: decode instance ``j`` pairs with prefill instance ``j mod prefill`` and sits
    on its node (``same-server``), on another node of its rack (``rack-local``) or in another rack
    (``spread``); a request's KV goes to the least loaded decode instance paired with its prefill
    instance. ``kv_via: store``: the KV goes through a KV-cache store's host memory (put, then get),
    a store segment per decode instance: on the decode's node (same-server), on another node of its
    rack (rack-local), or on a node of a rack of neither the decode nor its prefill (spread; the
    prefill's rack when there are only two).
    """

    prefill: int = Field(default=1, ge=1, le=1024, description="prefill instances")
    decode: int = Field(default=1, ge=1, le=1024, description="decode instances")
    prefill_tp: int | None = Field(default=None, ge=1, le=64, description="default: the tenant's tp")
    decode_tp: int | None = Field(default=None, ge=1, le=64, description="default: the tenant's tp")
    layouts: tuple[PdLayout, ...] = Field(default=("rack-local", "spread"), min_length=1, max_length=3)
    kv_via: Literal["direct", "store"] = Field(default="direct", description="prefill to decode, or via a store")
    oversubscription: float = Field(
        default=1.0, ge=1, le=64, description="rack NIC bandwidth / its uplink to the spine (1: non-blocking)"
    )

    @model_validator(mode="after")
    def _check(self) -> Pd:
        if len(set(self.layouts)) != len(self.layouts):
            raise ValueError(f"layouts must not repeat (got {list(self.layouts)})")
        for tp in (self.prefill_tp, self.decode_tp):
            if tp is not None and tp & (tp - 1):
                raise ValueError(f"prefill_tp and decode_tp must be powers of two, got {tp}")
        return self


class Scenario(_Value):
    """Everything one simulation run needs; every field has a default except the cluster and the model(s)."""

    name: str = Field(default="scenario", min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
    cluster: Ref = Field(description="preset name, 'NxPRESET' (N nodes of a one-node preset) or cluster spec path")
    # one-tenant shorthand (the tenant is named "default")
    model: Ref | None = Field(default=None, description="catalog name, Hugging Face id or config.json path")
    weight_dtype: str | None = Field(default=None, max_length=40)
    kv_dtype: str | None = Field(default=None, max_length=40)
    engine: Literal["vllm", "sglang", "trtllm"] = "vllm"
    engine_version: EngineVersion | None = Field(default=None, max_length=41)
    input_len: Lengths = Lengths()
    output_len: Lengths = Lengths(mean=256)
    slo_ms: float = Field(
        default=100.0, gt=0, le=MAX_SECONDS, description="per-token latency SLO (end-to-end / output tokens)"
    )
    slo_mix: dict[str, float] = Field(default_factory=lambda: {"interactive": 1.0}, max_length=4)
    batch: int = Field(default=32, ge=1, le=4096, description="sequences one instance serves at once")
    # several tenants
    tenants: tuple[Tenant, ...] = Field(default=(), max_length=MAX_TENANTS)
    # traffic and instances
    requests: int | None = Field(
        default=None, ge=1, le=MAX_REQUESTS, description="requests (fixed instances; default 1,000) or a cap (churn)"
    )
    arrivals: Arrivals = Arrivals()
    instances: int | Literal["max"] = Field(
        default="max", description="instances placed at the start (at most MAX_REQUESTS; checked against the GPUs)"
    )
    autoscale: bool = True
    churn: Churn | None = None
    admission: Admission = Admission()
    instance_startup_s: Seconds = 0.0
    timeout_s: float = Field(
        default=600.0, gt=0, le=MAX_SECONDS, description="a request not started this long after arrival times out"
    )
    drain_grace_s: float | None = Field(
        default=30.0,  # binding.engine_args.DRAIN_S: what the launched engines are given (a test keeps them equal)
        ge=0,
        le=MAX_SECONDS,
        description=(
            "a departing or moved copy finishes its started requests for at most this long, then aborts the"
            " rest (vLLM's --shutdown-timeout within a pod's termination grace; null: no bound)"
        ),
    )
    failures: tuple[Failure, ...] = Field(default=(), max_length=MAX_FAILURES)
    trace: Ref | None = Field(default=None, description="CSV: timestamp,input_len,output_len[,slo_class][,tenant]")
    budget_gbps: float = Field(default=256.0, gt=0, le=1e9)
    pd: Pd | None = Field(default=None, description="prefill/decode disaggregation (one tenant, no churn)")

    @field_validator("instances")
    @classmethod
    def _instances(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= MAX_REQUESTS:
            raise ValueError(f"instances must be 'max' or from 1 to {MAX_REQUESTS:,}, got {value}")
        return value

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        _check_mix(self.slo_mix, "slo_mix")
        if self.tenants and self.model is not None:
            raise ValueError("give either model (one tenant) or tenants, not both")
        if self.tenants and (self.engine != "vllm" or self.engine_version is not None):
            raise ValueError("engine at the top level is the one-tenant shorthand's: give each tenant its engine")
        if not self.tenants and self.model is None:
            raise ValueError("give a model (one tenant) or a list of tenants")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique (got {names})")
        if self.pd is not None:
            self._check_pd(self.pd)
        return self

    def _check_pd(self, pd: Pd) -> None:
        if len(self.tenant_list()) != 1:
            raise ValueError("pd takes one tenant (its prefill and decode instances)")
        if self.churn is not None or self.failures:
            raise ValueError("pd scenarios take no churn and no failures yet")
        tp = self.tenant_list()[0].tp
        if tp == "auto" and (pd.prefill_tp is None or pd.decode_tp is None):
            raise ValueError("pd needs prefill_tp and decode_tp, or a tenant tp")

    @property
    def request_count(self) -> int:
        """Requests to generate (fixed instances) or the most to generate (churn)."""
        if self.requests is not None:
            return self.requests
        return MAX_REQUESTS if self.churn is not None else 1000

    def tenant_list(self) -> tuple[Tenant, ...]:
        """The tenants; the one-tenant shorthand becomes a tenant named ``default``."""
        if self.tenants:
            return self.tenants
        assert self.model is not None  # checked by the validator
        return (
            Tenant(
                name="default",
                model=self.model,
                weight_dtype=self.weight_dtype,
                kv_dtype=self.kv_dtype,
                engine=self.engine,
                engine_version=self.engine_version,
                slo_mix=self.slo_mix,
                batch=self.batch,
                input_len=self.input_len,
                output_len=self.output_len,
                slo_ms=self.slo_ms,
            ),
        )


def expected_instance_arrivals(churn: Churn, gpus: int, mean_gpus: float, startup_s: float) -> float:
    """Mean instance arrivals of a churn run (start-full instances included)."""
    rate = churn.occupancy * gpus / (mean_gpus * (churn.mean_lifetime_s + startup_s))
    initial = rate * churn.mean_lifetime_s if churn.start_full else 0.0
    return rate * churn.duration_s + initial if math.isfinite(rate) else math.inf
