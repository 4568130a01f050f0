"""Placement requests and their outcomes, as values (DESIGN.md vocabulary).

A ``PlacementRequest`` asks for ``replicas`` instances of a model; each placed instance is a
``Placement`` (degrees, GPUs in rank order, per-GPU HBM, predicted latency, constraint report,
fallbacks); each instance that could not be placed is an ``Unplaced`` with the reasons per
domain/node, so "why didn't it fit?" always has an answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from toposched.names import Label, LabelValue, NodeName, ObjectId, PlacementId, Word
from toposched.perf.engine_names import EngineVersion, cost_engine
from toposched.perf.step import COMPRESSION_RATIO

Affinity = Literal["auto", "nvlink", "numa", "pcie-switch", "node", "none"]
SloClass = Literal["realtime", "interactive", "standard", "batch"]
Role = Literal["prefill", "decode"]
"""The role of an instance in prefill/decode disaggregation (``solver/pd.py``)."""


class SloClassConfig(BaseModel):
    """What an SLO class may trade for placement (seed 000 section 4)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    weight: float = Field(gt=0, le=1000)
    """Share of the cross-domain budget and of fair-queueing service."""
    allow_compression: bool
    """Cross-domain all-reduce may be compressed (FP8: half the bytes of BF16) at a latency cost."""
    allow_overlap: bool
    """Communication may be overlapped with compute (a fraction of it hidden)."""
    cross_domain_after_s: float | None = Field(default=None, ge=0, le=86_400)
    """Seconds an instance waits for room in one NVLink domain before the caller (simulator, admission
    queue) retries it with ``allow_cross_domain``; None: never placed across domains by the fallback."""


COMPRESSION_FLOOR_GBPS = 1.0
"""Compressible cross-domain traffic below which the compression ratio is not defined (None): a pipeline
hand-off of a few MB/s says nothing about whether compression works, and must not fire CompressionRatioHigh
(the service's signal, ``service/metrics.py``, and the simulator's, ``sim/metrics.py``)."""

SLO_CLASSES: dict[str, SloClassConfig] = {
    # Strict classes keep full precision on the wire (seed 000 section 4: compression is for batch work).
    # The fallback never places an SLO miss (it checks the predicted latency), so waiting longer protects only
    # NVLink affinity while the tenant's other instances absorb its load: on churn-128 at 0.85 (seed 1) waiting
    # 5 s instead of 30 s for interactive raised SLO met 0.995 -> 0.997, TP=8 0.964 -> 0.982 and utilisation
    # 0.833 -> 0.838 with fewer moves (docs/simulator.md). Realtime, which may not overlap, keeps its long wait.
    # The classes that allow compression take the fallback at once (issue 35): on churn-tiny a standard TP=4
    # waiting 5 s for NVLink room cost its tenant more than running across domains (seeds 0-9: slo's TTFT p99
    # no higher than index-order's on 10 of 10 instead of 7).
    "realtime": SloClassConfig(weight=8, allow_compression=False, allow_overlap=False, cross_domain_after_s=60),
    "interactive": SloClassConfig(weight=4, allow_compression=False, allow_overlap=True, cross_domain_after_s=5),
    "standard": SloClassConfig(weight=2, allow_compression=True, allow_overlap=True, cross_domain_after_s=0),
    "batch": SloClassConfig(weight=1, allow_compression=True, allow_overlap=True, cross_domain_after_s=0),
}


DEFAULT_MAX_MODEL_LEN = 8192
"""The context every command plans, fits, launches and serves for unless told otherwise (``fit``,
``estimate``'s memory check, ``plan``, ``launch``, the service; docs/solver.md "Defaults"). Not the
model's whole context: a plan reserves KV for several sequences of this length, and 128k tokens x 8
sequences would ask several GPUs more of most models."""


MAX_TP = 65_536
"""The largest TP degree a request may name (a cluster spec holds at most 65,536 GPUs)."""
TpDegree = Annotated[
    int,
    Field(
        ge=1,
        le=MAX_TP,
        json_schema_extra={"enum": [1 << k for k in range(MAX_TP.bit_length())]},
        description="a power of two",
    ),
]
"""A TP degree: a power of two from 1 to ``MAX_TP`` (the OpenAPI schema lists them, issue 37)."""


class PlacementRequest(BaseModel):
    """What to place. Every field has a default except the model."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    id: ObjectId = Field(default="req", description="idempotency key; instance ids derive from it")
    model: str = Field(min_length=1, description="catalog name, Hugging Face id or config.json path")
    weight_dtype: str | None = None
    kv_dtype: str | None = None
    engine: Literal["vllm", "sglang", "trtllm"] = Field(
        default="vllm",
        description="the engine the instances run (trtllm: TensorRT-LLM's PyTorch backend, as `launch trtllm` "
        "starts it): it prices their steps and picks the calibration profile's entry (perf/engine_names.py engine_of)",
    )
    engine_version: EngineVersion | None = Field(
        default=None,
        max_length=41,
        description="the engine's version (e.g. 0.11.0): a calibration profile entry fitted on that version "
        "prices it (perf/engine_names.py)",
    )
    max_model_len: int = Field(default=DEFAULT_MAX_MODEL_LEN, ge=1, le=10_000_000)
    concurrent_seqs: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="running sequences per instance (the engines' max-num-seqs); None: the operating point "
        "that maximises goodput under the SLO, at most what the KV cache holds (docs/solver.md)",
    )
    input_len: int = Field(default=1024, ge=1, description="typical prompt length, for predictions")
    output_len: int = Field(default=256, ge=1, description="typical output length, for predictions")
    slo_tpot_ms: float | None = Field(default=None, gt=0)
    slo_ttft_ms: float | None = Field(default=None, gt=0)
    slo_class: SloClass = "interactive"
    serving_role: Role | None = Field(
        default=None,
        description="what the instances serve: prefill (prompts only) or decode (decodes only) in a disaggregated "
        "deployment (solver/pd.py sets it); None: both. It decides the operating point's model (perf/serving.py)",
    )
    slo_required: bool = Field(
        default=False,
        description="an instance whose predicted per-request TTFT or TPOT misses the SLO is not placed: it is "
        "unplaced with the changes that would meet it (plan and the service set it; the simulator does not)",
    )
    priority: int = Field(default=0, ge=0, le=100)
    replicas: int = Field(default=1, ge=1, le=10_000)
    allowed_tp: tuple[TpDegree, ...] | None = Field(default=None, min_length=1)
    max_pp: int = Field(default=8, ge=1, le=64)
    ep: int = Field(default=1, ge=1, le=1024, description="expert-parallel degree for MoE models")
    expert_hit_rates: tuple[float, ...] | None = Field(
        default=None, description="per-expert hit rates (MoE with ep > 1); uniform when absent"
    )
    expert_replicas: int = Field(default=0, ge=0, le=4096, description="copies of hot experts allowed (ep > 1)")
    affinity: Affinity = "auto"
    allow_int4_kv: bool = False
    # Kubernetes label syntax: the selector becomes node-affinity expressions of the pods (binding/k8s_affinity.py)
    node_selector: dict[Label, LabelValue] = Field(default_factory=dict, description="node labels that must match")
    racks: tuple[Label, ...] | None = None
    zones: tuple[Label, ...] | None = None
    spread_replicas: bool = Field(default=False, description="anti-affinity: no two replicas on one node")
    near: PlacementId | None = Field(default=None, description="placement id to be close to (role affinity)")
    near_level: Literal["node", "rack", "zone"] = "rack"
    near_required: bool = False
    allow_cross_domain: bool = Field(
        default=False,
        description="when no option fits the affinity level, the slo and latency policies may place TP groups "
        "across NVLink domains within the class's budget share and the SLO (the cross-domain fallback)",
    )

    keep_whole_domains: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="headroom for instances that need a whole NVLink domain: the slo and latency policies do not "
        "break a wholly free domain (of the cluster's largest size) while this many or fewer are left; the "
        "request is unplaced (queued) instead, so the caller can wait for room and drop the headroom later",
    )

    @property
    def cost_engine(self) -> str | None:
        """The engine and its version as the cost model takes them (``perf/engine_names.cost_engine``)."""
        return cost_engine(self.engine, self.engine_version)

    @model_validator(mode="after")
    def _check(self) -> PlacementRequest:
        if self.allowed_tp is not None:
            if not self.allowed_tp:
                raise ValueError("allowed_tp, when given, must list at least one tp")
            bad = [t for t in self.allowed_tp if t < 1 or t & (t - 1)]
            if bad:
                raise ValueError(f"allowed_tp values must be powers of two (got {bad})")
        if self.max_model_len < self.input_len:
            raise ValueError(f"max_model_len {self.max_model_len} is shorter than input_len {self.input_len}")
        return self


def instance_ids(request_id: str, replicas: int) -> list[str]:
    """The instance (placement) ids of a request: the id itself for one replica, ``ID-0..ID-n`` for more."""
    return [f"{request_id}-{n}" for n in range(replicas)] if replicas > 1 else [request_id]


class Rank(BaseModel):
    model_config = ConfigDict(frozen=True)

    rank: int
    node: NodeName
    gpu: int
    stage: int
    tp_rank: int


class HbmShare(BaseModel):
    """Bytes reserved on each GPU of a placement (the worst stage's figures)."""

    model_config = ConfigDict(frozen=True)

    weights: int
    kv: int
    activations: int
    workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations + self.workspace


class ConstraintCheck(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: Literal["domain-affinity", "cross-domain-budget", "capacity", "slo", "selector", "near"]
    held: bool
    detail: str


class ExpertReport(BaseModel):
    """Expert-parallel layout of an MoE placement (solver/experts.py)."""

    model_config = ConfigDict(frozen=True)

    ep: int
    replicas: int
    imbalance_before: float
    imbalance_after: float
    extra_bytes_per_gpu: int
    redundant_experts: int = Field(default=0, ge=0)
    """Expert slots beyond the model's experts, the same number on every EP rank (the fullest rank's
    extra slots x ep): what the engines take as their redundant-expert count (vLLM
    ``--eplb-config num_redundant_experts``, SGLang ``--ep-num-redundant-experts``), and what
    ``extra_bytes_per_gpu`` pays for."""


class Placement(BaseModel):
    """One placed instance."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    id: PlacementId
    request_id: ObjectId
    model: str
    policy: str
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    ep: int = Field(ge=1)
    ranks: tuple[Rank, ...]
    level: str = Field(description="affinity level the TP groups satisfy")
    link: str = Field(description="perf link key between TP ranks")
    stage_domains: tuple[str | None, ...]
    stage_layers: tuple[int, ...] = Field(description="layers per pipeline stage (VLLM_PP_LAYER_PARTITION)")
    hbm_per_gpu: HbmShare
    kv_dtype: str
    kv_tokens_capacity: int
    ttft_ms: float
    """Predicted time to first token of one request at the operating point (``perf/serving.py``)."""
    tpot_ms: float
    """Predicted mean time per output token at the operating point."""
    tpot_p95_ms: float | None = None
    """The 95th percentile over requests of their mean TPOT (what a TPOT SLO is checked against); None
    for the simulator's design batch and plans made before operating points."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """The operating point: running sequences the engine is launched with (None in plans made before
    operating points: the request's ``concurrent_seqs``, else 8)."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """Tokens of one engine pass at the operating point (chunked prefill's budget)."""
    goodput_tokens_per_s: float | None = None
    """Output tokens/s of requests meeting the SLO at the operating point (the throughput when the
    predictions meet it, else 0)."""
    served_rps: float | None = None
    """Requests/s the instance is planned for: the Poisson rate at which 95 % of requests meet the SLO's
    wait budget (``perf/serving.py planned_rate``); goodput is this x output_len."""
    batch_prefill_ms: float | None = None
    """The prefill of ``max_num_seqs`` prompts at once (a static batch's TTFT), for reference."""
    operating_limit: str | None = None
    """Why the batch is not larger: slo-tpot, slo-ttft, prefill, kv-cache, engine, knee or fixed."""
    cross_domain_gbps: float
    compression: str | None = None
    overlap: float = 0.0
    constraints: tuple[ConstraintCheck, ...]
    fallbacks: tuple[str, ...] = ()
    experts: ExpertReport | None = None
    role: Role | None = None
    """Prefill or decode instance of a disaggregated deployment (``solver/pd.py``); None: serves both."""
    kv_nics: tuple[Word, ...] = ()
    """Per rank (rank order), the RDMA device that rank moves KV caches through: the nearest NIC of its GPU
    on the GPU's NUMA node. Empty for an instance that is not disaggregated."""
    host_numa: tuple[int | None, ...] = ()
    """Per rank (rank order), the NUMA node the rank's host memory binds to (its GPU's; None: unknown).
    Empty for an instance that is not disaggregated."""

    @property
    def cross_domain_gbps_uncompressed(self) -> float:
        """Cross-domain GB/s before compression (``cross_domain_gbps`` is what goes on the wire), for
        the compression-ratio signal; the placement knows its own compression, callers need not."""
        return self.cross_domain_gbps / COMPRESSION_RATIO if self.compression == "fp8" else self.cross_domain_gbps

    def check(self, name: str) -> ConstraintCheck:
        """The constraint check called ``name`` (``solver/constraints.py``); KeyError if it has none."""
        for c in self.constraints:
            if c.name == name:
                return c
        raise KeyError(f"placement {self.id} has no constraint check {name!r}")

    @property
    def gpu_refs(self) -> tuple[str, ...]:
        return tuple(f"{r.node}/{r.gpu}" for r in self.ranks)


M = TypeVar("M", bound=BaseModel)


class ValueCache(Generic[M]):
    """``make(*key)``, built once per key and shared: for the small frozen values every decision builds
    again (a rank, a constraint check), whose validation costs more than a dict lookup.

    ``key`` must be everything the value is made of, as str, int and bool (what the model keeps as
    given), so equal keys make equal values; a key that fails validation is never stored (the next call
    raises again). At ``limit`` entries the cache starts over.
    """

    def __init__(self, make: Callable[..., M], limit: int = 4096) -> None:
        self._make = make
        self._limit = limit
        self._values: dict[tuple[object, ...], M] = {}

    def __call__(self, *key: object) -> M:
        value = self._values.get(key)
        if value is None:
            value = self._make(*key)
            if len(self._values) >= self._limit:
                self._values.clear()
            self._values[key] = value
        return value


class Unplaced(BaseModel):
    model_config = ConfigDict(frozen=True)

    request_id: str
    replica: int
    status: Literal["queued", "rejected"]
    reasons: tuple[str, ...]
