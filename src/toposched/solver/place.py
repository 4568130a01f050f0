"""Turning a chosen GPU list into a ``Placement`` (the GPUs come from ``solver/stages.py``).

* ``tp_link`` and ``stage_links`` name the links a placement's TP groups and pipeline stages use.
* ``assess`` predicts latency over the links the GPUs actually use, estimates cross-domain traffic,
  applies compression/overlap where the SLO class allows them, and checks the constraints.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from toposched.perf.hardware import GpuSpec
from toposched.perf.links import get_link, pcie_link
from toposched.perf.step import COMPRESSION_RATIO, COMPRESSION_US_PER_ALLREDUCE
from toposched.solver.constraints import LEVEL_ORDER, CheckContext, run_checks
from toposched.solver.experts import place_experts
from toposched.solver.index import ClusterIndex
from toposched.solver.options import RESERVE_SEQS, DegreeOption, OptionSet, sequence_tokens
from toposched.solver.request import (
    SLO_CLASSES,
    ExpertReport,
    HbmShare,
    Placement,
    PlacementRequest,
    Rank,
    ValueCache,
)
from toposched.topology.model import Fabric
from toposched.workload.dtypes import weight_format
from toposched.workload.memory import seqs_held

# Modelled degradations (seed 000 section 4). Compression: FP8 on the wire halves BF16 all-reduce
# bytes; the seed reports 2-3x less bandwidth for < 5 ms extra latency. We charge a quantise +
# dequantise pass of 10 us per all-reduce (an assumption: two small elementwise kernels, each about
# the 3 us small-kernel cost of perf-anchors section 0, plus a reduction in FP32). Overlap: 30 % of
# cross-domain communication hidden behind compute (an assumption; engines that overlap report
# partial hiding, and the sidecar is to measure it).
OVERLAP_FRACTION = 0.3
BF16_BYTES = 2


def fabric_link(fabric: Fabric | None) -> str:
    """The link-table key of traffic between nodes (``Fabric.perf_link``: HDR, NDR and XDR apart)."""
    return fabric.perf_link if fabric is not None else "tcp-100"


def _pcie_link(gpu: GpuSpec) -> str:
    if gpu.native_link.startswith("pcie"):
        return gpu.native_link
    return "pcie4" if gpu.name.startswith("A100") else "pcie5"


def tp_link(index: ClusterIndex, refs: Sequence[str], gpu: GpuSpec) -> tuple[str, bool]:
    """(perf link key between these TP ranks, whether they share one NVLink domain)."""
    nodes = {index.info[r].node for r in refs}
    domain_id = index.domain_of(refs) if len(refs) > 1 else index.dmap.gpu_domain.get(refs[0])
    if len(refs) > 1 and domain_id is not None:
        domain = index.domains[domain_id]
        if domain.kind == "mnnvl":
            return "mnnvl", True
        if domain.kind == "bridge" or not gpu.native_link.startswith(("nvlink", "mnnvl")):
            return "nvlink-bridge", True
        return gpu.native_link, True
    if len(nodes) > 1:
        # equal shares per node (what pick_in_group takes): a two-level all-reduce, inside each node
        # over its own link, across nodes one NIC per GPU (perf/links.py two_level_link); else a flat ring
        inter = fabric_link(index.cluster.fabric)
        per_node: dict[str, list[str]] = {}
        for ref in refs:
            per_node.setdefault(index.info[ref].node, []).append(ref)
        shares = {len(v) for v in per_node.values()}
        if len(shares) == 1 and (share := shares.pop()) > 1:
            intra, _ = tp_link(index, next(iter(per_node.values())), gpu)
            return f"{inter}+{intra}x{share}", False
        return inter, False
    if len(refs) == 1:
        return gpu.native_link, True
    # one node, no shared NVLink domain: PCIe, P2P on unless a pair is refused or crosses sockets
    node = index.nodes[next(iter(nodes))]
    peer_to_peer = node.peer_to_peer(index.info[r].index for r in refs)
    return pcie_link(_pcie_link(gpu), peer_to_peer=peer_to_peer), False


def stage_links(index: ClusterIndex, stages: Sequence[Sequence[str]], gpu: GpuSpec) -> tuple[str, bool, str | None]:
    """(perf link key of the slowest TP group, whether every TP group sits in one NVLink domain,
    perf link key between pipeline stages or None when they share the TP link).

    ``assess`` predicts a placement's latency over these links, and the simulator's step cost
    (``solver/stepcost.py``) uses the same ones, so both see the links a placement really uses.
    """
    links = [tp_link(index, stage, gpu) for stage in stages]
    link, in_domain = max(
        links, key=lambda x: (not x[1], x[0].startswith(("tcp", "roce", "ib")), x[0].startswith("pcie"))
    )
    all_refs = [r for stage in stages for r in stage]
    stage_nodes = [{index.info[r].node for r in stage} for stage in stages]
    pp_link = None
    if len(stages) > 1:
        crosses_nodes = any(a != b for a, b in itertools.pairwise(stage_nodes))
        if crosses_nodes:
            pp_link = fabric_link(index.cluster.fabric)
        elif index.domain_of(all_refs) is not None:
            pp_link = link if in_domain else None
        else:
            pp_link = _pcie_link(gpu)
    return link, in_domain, pp_link


@dataclass(frozen=True)
class Assessment:
    placement: Placement
    meets_slo: bool
    cross_gbps: float


def assess(
    index: ClusterIndex,
    options: OptionSet,
    option: DegreeOption,
    stages: list[list[str]],
    *,
    placement_id: str,
    request_id: str,
    policy: str,
    required_level: str | None,
    budget_left_gbps: float,
) -> Assessment:
    """Predict and check one concrete choice of GPUs.

    ``request_id`` is passed explicitly: ``options`` is shared by every request with the same
    fields (the scheduler caches it), so ``options.request.id`` may be another request's id.
    """
    request, gpu = options.request, options.gpu
    link, in_domain, pp_link = stage_links(index, stages, gpu)
    spec = option.spec
    domains = [index.domain_of(stage) for stage in stages]
    crossings = sum(1 for a, b in itertools.pairwise(domains) if a is None or a != b)
    # bytes each rank sends outside its domain per all-reduce: a flat ring moves 2(n-1)/n of the
    # activations; a two-level all-reduce (``tp_link``: g GPUs per node) reduces inside each node
    # first, so only 2(m-1)/m of 1/g of them cross, between the m = n/g nodes
    per_node = get_link(link).gpus_per_node or 1
    across = option.tp // per_node
    spans = not in_domain and option.tp > 1 and across > 1
    slo_class = SLO_CLASSES[request.slo_class]
    compression = "fp8" if (spans or crossings) and not in_domain and slo_class.allow_compression else None
    overlap = OVERLAP_FRACTION if (spans or crossings) and not in_domain and slo_class.allow_overlap else 0.0
    mem = option.memory
    kv_bytes, kv_tokens, weights = max(mem.kv_budget_bytes, 0), mem.kv_tokens_capacity, mem.weights_bytes_per_gpu
    experts = _experts(request, option)
    if experts is not None and experts.extra_bytes_per_gpu:
        weights += experts.extra_bytes_per_gpu
        kv_tokens = int(kv_tokens * max(kv_bytes - experts.extra_bytes_per_gpu, 0) / kv_bytes) if kv_bytes else 0
        kv_bytes = max(kv_bytes - experts.extra_bytes_per_gpu, 0)
    cap = option.max_batch
    if request.concurrent_seqs is None and kv_tokens < mem.kv_tokens_capacity:  # the expert copies' share
        cap = max(1, seqs_held(kv_tokens, sequence_tokens(request)))
    raw = options.operating(option, link, pp_link, max_batch=cap)
    point = raw
    if compression or overlap:
        point = options.operating(
            option,
            link,
            pp_link,
            max_batch=cap,
            comm=(f"{compression}/{overlap}", _comm_paid(compression, overlap, spec.num_layers)),
        )
    # traffic per step at the step rate the placement runs at (the simulator's design batch keeps the
    # uncompressed rate it was tuned with)
    steps_per_s = 1000.0 / (raw if options.prediction == "design-batch" else point).tpot_ms
    # tokens per step: one per running sequence, or a prefill instance's whole pass
    tokens = (
        min(point.batch * request.input_len, point.max_num_batched_tokens)
        if request.serving_role == "prefill"
        else point.batch
    )
    act_bytes = tokens * spec.hidden_size * BF16_BYTES
    cross = 0.0
    if spans:
        bus = 2 * (across - 1) / across * act_bytes / per_node
        cross += option.pp * option.tp * 2 * (spec.num_layers / option.pp) * bus * steps_per_s / 1e9
    cross += crossings * act_bytes * steps_per_s / 1e9
    if compression:
        cross *= COMPRESSION_RATIO
    tpot, ttft = point.tpot_ms, point.ttft_ms
    level = max((index.tightest_level(stage) for stage in stages), key=LEVEL_ORDER.index)
    seq_tokens = (request.concurrent_seqs or RESERVE_SEQS) * request.max_model_len
    fits = mem.fits and (experts is None or kv_tokens >= min(seq_tokens, mem.kv_tokens_capacity))
    checks = run_checks(
        CheckContext(
            request=request,
            level=level,
            required_level=required_level,
            cross_gbps=cross,
            budget_left_gbps=budget_left_gbps,
            fits=fits,
            budget_gib=mem.budget_bytes / 2**30,
            kv_tokens=kv_tokens,
            expert_copies=experts.replicas if experts is not None else 0,
            tpot_ms=tpot,
            ttft_ms=ttft,
            tpot_p95_ms=None if options.prediction == "design-batch" else point.tpot_p95_ms,
        )
    )
    info = index.info
    ranks = tuple(
        _rank(s * option.tp + t, info[ref].node, info[ref].index, s, t)
        for s, stage in enumerate(stages)
        for t, ref in enumerate(stage)
    )
    share = _share(weights, kv_bytes, mem.activation_bytes, mem.workspace_bytes)
    placement = Placement(
        id=placement_id,
        request_id=request_id,
        model=spec.name,
        policy=policy,
        tp=option.tp,
        pp=option.pp,
        ep=option.ep,
        ranks=ranks,
        level=level,
        link=link,
        stage_domains=tuple(domains),
        stage_layers=option.stage_layers,
        hbm_per_gpu=share,
        kv_dtype=str(spec.kv_dtype),
        kv_tokens_capacity=kv_tokens,
        ttft_ms=round(ttft, 3),
        tpot_ms=round(tpot, 3),
        tpot_p95_ms=None if options.prediction == "design-batch" else round(point.tpot_p95_ms, 3),
        max_num_seqs=point.batch,
        max_num_batched_tokens=point.max_num_batched_tokens,
        goodput_tokens_per_s=round(point.goodput_tokens_per_s, 1),
        served_rps=round(point.served_rps, 4),
        batch_prefill_ms=round(point.batch_prefill_ms, 3),
        operating_limit=point.limit,
        cross_domain_gbps=round(cross, 4),
        compression=compression,
        overlap=overlap,
        constraints=checks,
        fallbacks=option.fallbacks,
        experts=experts,
    )
    return Assessment(placement, placement.check("slo").held, cross)


def _comm_paid(compression: str | None, overlap: float, layers: int) -> Callable[[float], float]:
    """All-reduce milliseconds of a pass -> what a placement pays: FP8 on the wire halves the bytes and
    adds a quantise/dequantise per all-reduce; overlap hides a share of the (compressed) transfer."""
    extra = 2 * layers * COMPRESSION_US_PER_ALLREDUCE / 1000 if compression else 0.0
    ratio = COMPRESSION_RATIO if compression else 1.0

    def paid(ms: float) -> float:
        return ms * ratio + extra - ms * ratio * overlap

    return paid


def _make_rank(rank: int, node: str, gpu: int, stage: int, tp_rank: int) -> Rank:
    return Rank(rank=rank, node=node, gpu=gpu, stage=stage, tp_rank=tp_rank)


def _make_share(weights: int, kv: int, activations: int, workspace: int) -> HbmShare:
    return HbmShare(weights=weights, kv=kv, activations=activations, workspace=workspace)


# Ranks and HBM shares repeat from decision to decision (the same GPU, the same model): built once.
_rank = ValueCache(_make_rank, limit=16_384)
_share = ValueCache(_make_share)


def _experts(request: PlacementRequest, option: DegreeOption) -> ExpertReport | None:
    """Expert layout for MoE with ep > 1: hot experts copied within the request's budget.

    One extra expert on a GPU costs its weights in every MoE layer of the stage, shared by the
    tp // ep ranks that split each expert.
    """
    spec = option.spec
    if option.ep <= 1 or spec.moe is None:
        return None
    layout = place_experts(
        spec.moe.num_experts, option.ep, request.expert_hit_rates, replica_budget=request.expert_replicas
    )
    moe_layers, start = 0, 0
    for n in option.stage_layers:
        moe_layers = max(moe_layers, sum(1 for layer in range(start, start + n) if spec.is_moe_layer(layer)))
        start += n
    per_expert = spec.expert_params() * moe_layers * weight_format(spec.weight_dtype).bytes_per_param
    # The engines give every EP rank the same number of expert slots ((experts + redundant) % ep == 0:
    # vLLM fused_moe/layer.py, SGLang eplb/expert_location.py), so the fullest rank's extra slots are
    # reserved on every rank and asked of the engine as ``extra slots x ep`` redundant experts.
    slots = max(layout.extra_experts_per_rank, default=0)
    extra = slots * per_expert / (option.tp // option.ep)
    return ExpertReport(
        ep=option.ep,
        replicas=layout.replicas,
        imbalance_before=round(layout.imbalance_before, 4),
        imbalance_after=round(layout.imbalance_after, 4),
        extra_bytes_per_gpu=round(extra),
        redundant_experts=slots * option.ep,
    )
