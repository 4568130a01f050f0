"""The plans the engine checks launch: every preset with dense, MoE, FP8, PP, EP, multi-node and Ray requests.

Plans are made by toposched's own scheduler, written as ``toposched plan --json`` writes them and read
back through the plan reader, then launched by the same functions as ``toposched launch``: engine
launches (``build_launches``), Ray drivers (``ray_document``), ``--format sh`` scripts
(``write_scripts``) and Kubernetes objects (``render_objects``, ``render_roles``). A request that
cannot be placed on a preset (405B on 8 V100s) is listed as skipped; the corpus as a whole must still
cover every category in ``CATEGORIES``, or the check fails.

A prefill/decode disaggregated ask (``Ask.pd``) is planned by ``solver/pd.py`` and launched with its
``disaggregation``: SGLang's prefill and decode commands and the router's command, and vLLM's prefill
and decode commands with their ``--kv-transfer-config`` (vLLM 0.33.0 has no router) (``pd`` category).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from toposched.binding.engines import build_launches
from toposched.binding.node_launch import Engine, NodeLaunch
from toposched.binding.plan_doc import PlanDoc, parse_plan, plan_json
from toposched.binding.ray import ray_document
from toposched.errors import ToposchedError
from toposched.solver.pd import Disaggregation, KvStore, place_pd
from toposched.solver.request import HbmShare, Placement, PlacementRequest, Rank, instance_ids
from toposched.solver.scheduler import Scheduler
from toposched.topology.model import Cluster, Fabric, Node
from toposched.topology.presets import load_preset, preset_names
from toposched.workload.catalog import catalog_entry

CATEGORIES = (
    "dense", "moe", "fp8", "pp", "ep", "eplb", "multi-node", "ray", "local-path", "nccl-ifname", "hand-written",
    "shared-head", "pd",
)  # fmt: skip
"""What the corpus must hold at least one launched plan of (``too-long`` must not be launched)."""

# Compute capability and SM count of each GPU the presets name (NVIDIA's CUDA GPU list and datasheets),
# keyed by a part of the GPU name; the first match wins, so GB200 comes before B200.
GPU_FACTS: tuple[tuple[str, tuple[int, int], int], ...] = (
    ("V100", (7, 0), 80),
    ("A100", (8, 0), 108),
    ("L40S", (8, 9), 142),
    ("H100", (9, 0), 132),
    ("H200", (9, 0), 132),
    ("GB200", (10, 0), 148),
    ("B200", (10, 0), 148),
)

GIB = 1024**3
SGLANG_IMAGE = "lmsysorg/sglang:v0.5.23"
"""Container image for SGLang pods (toposched has no default for SGLang)."""
TRTLLM_IMAGE = "registry.invalid/tensorrt-llm:pinned"
"""Container image for TensorRT-LLM pods (no default either; only the objects' schemas are checked)."""
IMAGES: dict[str, str] = {"sglang": SGLANG_IMAGE, "trtllm": TRTLLM_IMAGE}


@dataclass(frozen=True)
class Ask:
    """One request of the corpus and the categories it stands for."""

    label: str
    tags: tuple[str, ...]
    request: dict[str, Any]
    presets: tuple[str, ...] | None = None
    """Only these presets (None: every preset)."""
    fabric: dict[str, Any] | None = None
    """Fields to set on the cluster's fabric first."""
    pd: dict[str, Any] | None = None
    """``Disaggregation`` fields: a prefill/decode disaggregated plan of the request (None: a plain one)."""


MULTI = ("cluster-32x-hgx-h100", "gb200-nvl72")
HOT_EXPERTS = (20.0, 20.0) + (1.0,) * 126
"""Hit rates of Qwen3-235B-A22B's 128 experts with two very hot ones: no layout of single copies
balances eight ranks, so hot-expert copies pay off."""
ASKS: tuple[Ask, ...] = (
    Ask("8b-x2", ("dense",), {"model": "llama-3.1-8b", "replicas": 2}),
    Ask("8b-hf-id", ("dense",), {"model": "meta-llama/Llama-3.1-8B-Instruct"}, ("hgx-h100", "l40s-8x-pcie")),
    Ask("70b", ("dense",), {"model": "llama-3.1-70b", "slo_tpot_ms": 40}),
    Ask("70b-fp8", ("dense", "fp8"), {"model": "llama-3.1-70b", "weight_dtype": "fp8", "kv_dtype": "fp8"}),
    Ask("70b-tp4-pp2", ("dense", "pp"), {"model": "llama-3.1-70b", "allowed_tp": (4,), "max_pp": 2}),
    Ask("405b-fp8", ("dense", "fp8"), {"model": "llama-3.1-405b", "weight_dtype": "fp8", "max_model_len": 16384}),
    Ask("mixtral", ("moe",), {"model": "mixtral-8x7b"}),
    Ask("mixtral-ep2", ("moe", "ep"), {"model": "mixtral-8x7b", "ep": 2, "allowed_tp": (2,)}),
    Ask(
        "qwen3-moe-ep8-eplb",
        ("moe", "ep", "eplb"),
        {
            "model": "qwen3-235b-a22b",
            "ep": 8,
            "allowed_tp": (8,),
            "weight_dtype": "fp8",
            "expert_replicas": 16,
            "expert_hit_rates": HOT_EXPERTS,
        },
        ("hgx-h200", "hgx-b200", *MULTI),
    ),
    Ask("405b-multi-node", ("dense", "pp", "multi-node"), {"model": "llama-3.1-405b", "slo_tpot_ms": 60}, MULTI),
    Ask(
        "deepseek-v3-fp8-ep8",
        ("moe", "ep", "fp8", "multi-node"),
        {"model": "deepseek-v3", "weight_dtype": "fp8", "ep": 8, "allowed_tp": (8,)},
        MULTI,
    ),
    Ask(
        "405b-nccl-exclude",
        ("multi-node", "nccl-ifname"),
        {"model": "llama-3.1-405b", "slo_tpot_ms": 60},
        ("cluster-32x-hgx-h100",),
        {"socket_ifname": "^docker,lo", "rdma_resource": "rdma/ib", "host_network": True},
    ),
    Ask(
        "8b-nccl-exact", ("dense", "nccl-ifname"), {"model": "llama-3.1-8b"}, ("hgx-h100",), {"socket_ifname": "=eth0"}
    ),
    Ask(
        "70b-pd",
        ("dense", "pd"),
        {"model": "llama-3.1-70b", "slo_ttft_ms": 600, "slo_tpot_ms": 40},
        ("cluster-32x-hgx-h100",),
        pd={"prefill": 2, "decode": 2, "kv_store": "mooncake"},
    ),
    # one machine without rack labels: the decode instances go on the prefill instance's node
    Ask("8b-pd", ("dense", "pd"), {"model": "llama-3.1-8b"}, ("hgx-h100",), pd={"prefill": 1, "decode": 2}),
    Ask(
        "405b-fp8-pd",
        ("dense", "fp8", "pd"),
        {"model": "llama-3.1-405b", "weight_dtype": "fp8", "slo_tpot_ms": 60},
        ("cluster-32x-hgx-h100",),
        pd={"prefill": 1, "decode": 2, "same_rack_required": True},
    ),
    # Longer than the model's 131072 positions: toposched must refuse it (plan or launch), not emit it.
    Ask("8b-context-200k", ("too-long",), {"model": "llama-3.1-8b", "max_model_len": 200_000}, ("hgx-h100",)),
)
SHARED_HEADS = Ask("8b-x2-shared-head", ("multi-node", "hand-written", "shared-head"), {"model": "llama-3.1-8b"})
HAND_ASK = Ask("8b-tp4-hand", ("dense", "hand-written"), {"model": "llama-3.1-8b"})
"""For presets toposched cannot plan on (GPUs its performance table lacks, V100): a hand-written
plan, as ``--plan`` accepts, with this request on the first four GPUs of the first node."""
LOCAL_MODEL = "Meta-Llama-3.1-8B"
"""The catalog config copied into a model folder for the ``local-path`` request (a model given as a path)."""


@dataclass
class Plan:
    """A placed request (``doc``) or the reason it was skipped or refused."""

    label: str
    preset: str
    tags: tuple[str, ...]
    doc: PlanDoc | None = None
    skipped: str | None = None
    """Not placed on this preset: not a failure."""
    failure: str | None = None
    """The plan writer and reader disagree: a failure."""

    @property
    def name(self) -> str:
        return f"{self.preset}/{self.label}"


@dataclass(frozen=True)
class EngineCase:
    """One command to run through an engine's parser, with what it runs on."""

    id: str
    engine: Engine
    argv: list[str]
    env: dict[str, str]
    gpu: str
    """``TOPOSCHED_GPU_STUB``: ``NAME;MAJOR.MINOR;MEMORY_BYTES;SM_COUNT``."""
    node: str
    """Where the command runs."""
    node_rank: int = 0
    ib_devices: str = ""
    """The RDMA devices of ``node``, comma-separated: what ``/sys/class/infiniband`` lists there (PD commands)."""

    def key(self) -> str:
        """Cases with one key are one check: same command, same device count, same GPU."""
        return json.dumps([self.engine, self.argv, self.env.get("CUDA_VISIBLE_DEVICES", ""), self.gpu])


@dataclass
class Corpus:
    plans: list[Plan]
    engine_cases: list[EngineCase] = field(default_factory=list)
    refusals: list[tuple[str, str]] = field(default_factory=list)
    """(case, message): launches the launcher refused with an InputError (e.g. INT4 KV on SGLang)."""
    launches: list[tuple[str, NodeLaunch]] = field(default_factory=list)

    def covered(self) -> set[str]:
        tags = {t for p in self.plans if p.doc is not None for t in p.tags} - {"eplb", "ray"}
        if any(c.id.endswith("/ray-driver") for c in self.engine_cases):
            tags.add("ray")
        if any("--enable-eplb" in c.argv for c in self.engine_cases):
            tags.add("eplb")  # hot-expert copies that reached the engines, not just asked for
        return tags


def gpu_stub(node: Node) -> str:
    """The ``TOPOSCHED_GPU_STUB`` value for the GPUs of ``node``."""
    gpu = node.gpus[0]
    if gpu.model is None or gpu.hbm_gib is None:
        raise ValueError(f"node {node.name}: the corpus needs GPUs whose model and memory are known")
    for part, capability, sms in GPU_FACTS:
        if part in gpu.model:
            memory = int(gpu.hbm_gib * GIB)
            return f"{gpu.model};{capability[0]}.{capability[1]};{memory};{sms}"
    raise ValueError(f"GPU_FACTS has no compute capability for {gpu.model!r}; add it")


def model_config(model: str) -> Path | None:
    """The config.json toposched ships for a catalog name or Hugging Face id, or None for a path."""
    if Path(model).exists():
        return None
    entry = catalog_entry(model)
    return Path(str(resources.files("toposched") / "data" / "models" / entry.config_file))


def local_model_dir(root: Path) -> Path:
    """A model folder holding only a config.json, as ``--model /path/to/model`` would name."""
    folder = root / "models" / LOCAL_MODEL
    folder.mkdir(parents=True, exist_ok=True)
    source = model_config("llama-3.1-8b")
    assert source is not None
    shutil.copyfile(source, folder / "config.json")
    return folder


def _with_fabric(cluster: Cluster, fields: dict[str, Any] | None) -> Cluster:
    if not fields:
        return cluster
    fabric = (cluster.fabric or Fabric()).model_copy(update=fields)
    return cluster.model_copy(update={"fabric": fabric})


def _round_trip(
    plan: Plan,
    placements: Any,
    unplaced: Any,
    request: PlacementRequest,
    cluster: Cluster,
    disaggregation: Disaggregation | None = None,
    stores: list[KvStore] | None = None,
) -> None:
    """Write the plan as ``toposched plan --json`` does and read it back as ``--plan`` does."""
    document = plan_json(
        placements, unplaced, request, cluster, policy="slo", source=f"preset {plan.preset}",
        disaggregation=disaggregation, stores=stores or [],
    )  # fmt: skip
    text = json.dumps(document)
    try:
        plan.doc = parse_plan(json.loads(text), source=plan.name)
    except ToposchedError as exc:
        plan.failure = f"the plan reader refuses what the plan writer wrote: {exc}"


def hand_placement(request: PlacementRequest, blocks: list[tuple[str, list[int]]], replica: int = 0) -> Placement:
    """Replica ``replica`` of ``request`` on ``blocks`` (node, GPUs) in rank order, TP only, nothing predicted."""
    cells = [(node, gpu) for node, gpus in blocks for gpu in gpus]
    ranks = tuple(Rank(rank=r, node=n, gpu=g, stage=0, tp_rank=r) for r, (n, g) in enumerate(cells))
    return Placement(
        id=instance_ids(request.id, request.replicas)[replica], request_id=request.id, model=request.model,
        policy="hand", tp=len(cells), pp=1, ep=1, ranks=ranks, level="node", link="nvlink", stage_domains=(None,),
        stage_layers=(32,), hbm_per_gpu=HbmShare(weights=0, kv=0, activations=0, workspace=0), kv_dtype="auto",
        kv_tokens_capacity=0, ttft_ms=0.0, tpot_ms=0.0, cross_domain_gbps=0.0, constraints=(),
    )  # fmt: skip


def _shared_heads(plans: list[Plan]) -> None:
    """Two TP=4 instances over the same two GB200 trays (two GPUs on each): both have their head rank on
    tray 0, so their rendezvous ports must differ (issue 14 item 8)."""
    cluster = load_preset("gb200-nvl72")
    trays = [cluster.nodes[0].name, cluster.nodes[1].name]
    request = PlacementRequest(id=SHARED_HEADS.label, replicas=2, **SHARED_HEADS.request)
    placements = [hand_placement(request, [(t, gpus) for t in trays], i) for i, gpus in enumerate(([0, 1], [2, 3]))]
    plan = Plan(SHARED_HEADS.label, "gb200-nvl72", SHARED_HEADS.tags)
    plans.append(plan)
    _round_trip(plan, placements, [], request, cluster)


def make_plans(root: Path) -> list[Plan]:
    """Every ask on every preset it applies to, plus one request naming a local model folder."""
    plans: list[Plan] = []
    asks = [*ASKS, Ask("8b-local-path", ("dense", "local-path"), {"model": str(local_model_dir(root))}, ("hgx-h100",))]
    for preset in preset_names():
        for ask in asks:
            if ask.presets is not None and preset not in ask.presets:
                continue
            plan = Plan(ask.label, preset, ask.tags)
            plans.append(plan)
            cluster = _with_fabric(load_preset(preset), ask.fabric)
            try:
                request = PlacementRequest(id=ask.label, **ask.request)
                if ask.pd is None:
                    outcome, layout, stores = Scheduler(cluster).place(request), None, []
                else:
                    made = place_pd(Scheduler(cluster), request, Disaggregation(**ask.pd))
                    outcome, layout, stores = made.outcome, made.layout, made.stores
            except (ToposchedError, ValueError) as exc:
                plan.skipped = f"cannot plan: {exc}"
                continue
            if not outcome.placements or (ask.pd is not None and outcome.unplaced):
                reasons = outcome.unplaced[0].reasons if outcome.unplaced else ()
                plan.skipped = "not placed: " + (reasons[0] if reasons else "no reason given")
                continue
            _round_trip(plan, outcome.placements, outcome.unplaced, request, cluster, layout, stores)
        if all(p.doc is None for p in plans if p.preset == preset):
            plan = Plan(HAND_ASK.label, preset, HAND_ASK.tags)
            plans.append(plan)
            cluster = load_preset(preset)
            request = PlacementRequest(id=HAND_ASK.label, **HAND_ASK.request)
            _round_trip(plan, [hand_placement(request, [(cluster.nodes[0].name, [0, 1, 2, 3])])], [], request, cluster)
    _shared_heads(plans)
    return plans


def _node(doc: PlanDoc, name: str) -> Node:
    return next(n for n in doc.cluster.nodes if n.name == name)


def build(root: Path) -> Corpus:
    """Plans, and every engine command the launcher makes from them."""
    corpus = Corpus(make_plans(root))
    for plan in corpus.plans:
        if plan.doc is None:
            continue
        doc = plan.doc
        for engine in ("vllm", "sglang", "trtllm"):
            try:
                launches = build_launches(
                    doc.placements,
                    doc.request,
                    doc.cluster,
                    engine,
                    disaggregation=doc.disaggregation,
                    stores=doc.stores,
                )
            except ToposchedError as exc:
                corpus.refusals.append((f"{plan.name}/{engine}", str(exc)))
                continue
            for launch in launches:
                case_id = f"{plan.name}/{launch.placement}/{launch.node}"
                corpus.launches.append((case_id, launch))
                if engine == "trtllm":  # no parser to run here (tests/binding/test_trtllm.py checks its options)
                    continue
                if launch.role == "store":  # mooncake_master and the store service: tests/binding/test_mooncake.py
                    continue
                node = _node(doc, launch.node)
                ib = ",".join(n.device for n in node.nics if n.device) if launch.role else ""
                corpus.engine_cases.append(
                    EngineCase(
                        case_id, engine, launch.argv, launch.env, gpu_stub(node), launch.node, launch.node_rank, ib
                    )
                )
        try:
            ray = ray_document(doc)
        except ToposchedError as exc:
            corpus.refusals.append((f"{plan.name}/ray", str(exc)))
            continue
        for group in ray["placement_groups"]:
            # The driver runs on the node of rank 0 and sees all of that node's GPUs; the placement group
            # gives the workers theirs.
            head = _node(doc, next(p for p in doc.placements if p.id == group["placement"]).ranks[0].node)
            env = {**group["env"], "CUDA_VISIBLE_DEVICES": ",".join(str(g.index) for g in head.gpus)}
            case_id = f"{plan.name}/{group['placement']}/ray-driver"
            corpus.engine_cases.append(EngineCase(case_id, "vllm", group["argv"], env, gpu_stub(head), head.name))
    return corpus


def captured(doc: PlanDoc, *, uuids: bool) -> PlanDoc:
    """The plan as if its topology had been probed live (NVML), so its GPUs can be pinned through DRA.

    Preset bus ids and UUIDs are invented, and toposched rightly refuses to pin them; for the
    Kubernetes objects of the DRA path the nodes are relabelled as NVML probes with UUIDs in NVML's
    form (``uuids``) or with their bus ids only.
    """
    nodes = []
    for node in doc.cluster.nodes:
        gpus = tuple(
            g.model_copy(
                update={"uuid": f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node.name}/{g.index}')}" if uuids else None}
            )
            for g in node.gpus
        )
        nodes.append(node.model_copy(update={"gpus": gpus, "source": "nvml"}))
    return PlanDoc(doc.placements, doc.request, doc.cluster.model_copy(update={"nodes": tuple(nodes)}))


def k8s_variants(plan: Plan) -> Iterator[tuple[str, PlanDoc, Engine]]:
    """The plan for each way pods get GPUs (device plugin on the preset, DRA by UUID, DRA by bus id) and engine."""
    if plan.doc is None:
        return
    for engine in ("vllm", "sglang", "trtllm"):
        yield f"{plan.name}/device-plugin/{engine}", plan.doc, engine
        yield f"{plan.name}/dra-uuid/{engine}", captured(plan.doc, uuids=True), engine
        yield f"{plan.name}/dra-bus-id/{engine}", captured(plan.doc, uuids=False), engine
