"""Turning a degree option into concrete GPUs, and a chosen GPU list into a ``Placement``.

* ``find_stages`` picks ``pp`` TP groups of ``tp`` GPUs that each sit inside one group of the
  affinity level, in a layout the engines can launch (``solver/layout.py``): best fit (the group
  with the fewest free GPUs that still has room, so large free blocks stay whole), all stages on
  one node when one has room, else whole stages spread evenly over nodes. ``find_stages_across``
  lets TP groups span NVLink domains (the scheduler's bounded cross-domain fallback).
* ``pick_in_group`` (``solver/locality.py``) chooses the GPUs inside a group with the scoring that
  ``allocate`` uses; in a group spanning nodes, equal shares of the fewest nodes.
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
from toposched.solver.index import ClusterIndex, Group, LevelIndex
from toposched.solver.layout import layout_problem, per_node_choices
from toposched.solver.locality import pick_in_group
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
from toposched.topology.domains import gpu_ref
from toposched.topology.model import Fabric
from toposched.workload.dtypes import weight_format
from toposched.workload.memory import seqs_held

GroupFilter = Callable[[Group], bool]

# Modelled degradations (seed 000 section 4). Compression: FP8 on the wire halves BF16 all-reduce
# bytes; the seed reports 2-3x less bandwidth for < 5 ms extra latency. We charge a quantise +
# dequantise pass of 10 us per all-reduce (an assumption: two small elementwise kernels, each about
# the 3 us small-kernel cost of perf-anchors section 0, plus a reduction in FP32). Overlap: 30 % of
# cross-domain communication hidden behind compute (an assumption; engines that overlap report
# partial hiding, and the sidecar is to measure it).
OVERLAP_FRACTION = 0.3
BF16_BYTES = 2


def _fit_key(level_index: LevelIndex, g: int, room: int) -> tuple[int, int]:
    """Best-fit order of a group: the least room that suffices, then partly used before wholly free
    (the other way round under ``keep_whole``)."""
    whole = int(level_index.free_count[g] == level_index.size[g])
    return (whole, room) if level_index.keep_whole else (room, whole)


def _one_stage(
    index: ClusterIndex, tp: int, level: str, accept: GroupFilter, ok: Callable[[str], bool]
) -> tuple[list[str], Group] | None:
    """One TP group of ``tp`` GPUs inside one accepted group of ``level`` (best fit), or None."""
    level_index = index.levels[level]
    for g in level_index.best_fit(tp):
        group = level_index.groups[g]
        if not accept(group):
            continue
        room = [r for r in group.gpus if r in index.free and ok(r)]
        if len(room) < tp:
            continue
        picked = pick_in_group(index, room, tp)
        if picked is not None:
            return list(picked), group
    return None


def _stages_on_node(
    index: ClusterIndex, node: str, tp: int, count: int, level: str, accept: GroupFilter, ok: Callable[[str], bool]
) -> tuple[list[list[str]], list[Group]] | None:
    """``count`` disjoint TP groups on one node, each inside one accepted group of ``level``."""
    level_index = index.levels[level]
    refs = [gpu_ref(node, g.index) for g in index.nodes[node].gpus]
    usable = [r for r in refs if r in index.free and ok(r)]
    if len(usable) < tp * count:
        return None
    ids = sorted({g for r in usable for g in level_index.of_gpu.get(r, ())})
    taken: set[str] = set()
    stages: list[list[str]] = []
    groups: list[Group] = []
    for _ in range(count):
        best: tuple[tuple[int, int, int], Group, list[str]] | None = None
        for g in ids:
            group = level_index.groups[g]
            if not accept(group):
                continue
            room = [r for r in group.gpus if r in usable and r not in taken]
            if len(room) < tp:
                continue
            # the previous stage's group first (consecutive stages stay together), then best fit
            key = (0 if groups and group is groups[-1] else 1, *_fit_key(level_index, g, len(room)))
            if best is None or key < best[0]:
                best = (key, group, room)
        if best is None:
            return None
        picked = pick_in_group(index, best[2], tp)
        if picked is None:
            return None
        taken.update(picked)
        stages.append(list(picked))
        groups.append(best[1])
    return stages, groups


def find_stages(
    index: ClusterIndex, tp: int, pp: int, level: str, accept: GroupFilter, allowed: Callable[[str], bool]
) -> tuple[list[list[str]], list[Group]] | None:
    """``pp`` disjoint TP groups of ``tp`` GPUs, each inside one group of ``level``, in a layout the
    engines can launch (``solver/layout.py``); None if impossible.

    Tried in this order, the first that fits wins:

    1. one stage: best fit over the level's groups (a TP group may span nodes only where the group
       does, e.g. a multi-node NVLink domain; ``pick_in_group`` then takes equal shares of the fewest
       nodes);
    2. every stage on one node (best-fit node);
    3. ``k`` whole stages on each of ``pp / k`` nodes, the most stages per node first (so pipeline
       stages align with nodes and every node runs the same number of GPUs);
    4. stages that each span nodes (TP over a multi-node NVLink domain), no node shared by two stages.
    """
    if pp == 1:
        one = _one_stage(index, tp, level, accept, allowed)
        if one is None or _layout_problem(index, [one[0]], tp):
            return None
        return [one[0]], [one[1]]
    node_index = index.levels["node"]
    largest_node = node_index.max_size
    for per_node in (k for k in range(pp, 0, -1) if pp % k == 0 and k * tp <= largest_node):
        stages: list[list[str]] = []
        groups: list[Group] = []
        for g in node_index.best_fit(per_node * tp):
            node_group = node_index.groups[g]
            if not accept(node_group):
                continue
            (node,) = node_group.nodes
            hosted = _stages_on_node(index, node, tp, per_node, level, accept, allowed)
            if hosted is None:
                continue
            stages.extend(hosted[0])
            groups.extend(hosted[1])
            if len(stages) == pp:
                return stages, groups
    if not index.levels[level].spans_nodes:
        return None
    used_nodes: set[str] = set()
    stages, groups = [], []
    for _ in range(pp):
        one = _one_stage(index, tp, level, accept, lambda r: allowed(r) and index.info[r].node not in used_nodes)
        if one is None:
            return None
        stages.append(one[0])
        groups.append(one[1])
        used_nodes.update(index.info[r].node for r in one[0])
    if _layout_problem(index, stages, tp):
        return None
    return stages, groups


def find_stages_across(
    index: ClusterIndex, tp: int, pp: int, accept: GroupFilter, allowed: Callable[[str], bool]
) -> list[list[str]] | None:
    """``pp`` TP groups of ``tp`` GPUs that may span NVLink domains (the cross-domain fallback), in a
    layout the engines can launch; None if the free GPUs cannot hold them.

    The fewest domains first, which on machines with one NVLink domain per node means the fewest
    nodes:

    1. every TP group inside one node (``find_stages`` at level ``node``): on a node with several
       domains (NVLink pairs or quads, PCIe boxes) the group crosses them over PCIe, not the network;
    2. each TP group in equal shares of the fewest nodes (``layout.py``: a node holds an equal share
       of one TP group), the largest share first; no node shared by two stages. The nodes are taken
       by best fit (the fewest free GPUs that still hold the share, partly used before wholly free),
       not largest first: at equal span that leaves the large free blocks whole for the in-domain
       placements that need them.

    ``accept`` is asked about single nodes only (a group of level ``none`` is the whole cluster,
    which a selector or rack filter would refuse as a whole).
    """
    found = find_stages(index, tp, pp, "node", accept, allowed)
    if found is not None:
        return found[0]
    node_index = index.levels["node"]
    for share in per_node_choices(tp, 1, [node_index.max_size]):
        if share == tp:
            continue  # one node holding the whole group: step 1
        needed = pp * (tp // share)
        picks: list[list[str]] = []
        for g in node_index.best_fit(share):
            group = node_index.groups[g]
            if not accept(group):
                continue
            room = [r for r in group.gpus if r in index.free and allowed(r)]
            picked = pick_in_group(index, room, share) if len(room) >= share else None
            if picked is None:
                continue
            picks.append(list(picked))
            if len(picks) == needed:
                break
        if len(picks) < needed:
            continue
        # ranks in cluster order: each stage's nodes together, each node's GPUs one block
        picks.sort(key=lambda refs: index.info[refs[0]].order)
        per_stage = tp // share
        stages = [[r for refs in picks[s * per_stage : (s + 1) * per_stage] for r in refs] for s in range(pp)]
        if _layout_problem(index, stages, tp) is None:
            return stages
    return None


def fragmentation(index: ClusterIndex, stages: Sequence[Sequence[str]]) -> tuple[int, int]:
    """(whole NVLink groups the stages would break, free GPUs in the NVLink groups they use)."""
    level = index.levels["nvlink"]
    refs = [r for stage in stages for r in stage]
    touched = {g for r in refs for g in level.of_gpu.get(r, ())}
    broken = sum(1 for g in touched if level.size[g] > 1 and level.free_count[g] == level.size[g])
    return broken, sum(level.free_count[g] for g in touched)


def breaks_reserve(index: ClusterIndex, stages: Sequence[Sequence[str]], keep: int) -> bool:
    """Whether the stages leave a wholly free NVLink domain of the cluster's largest size partly used
    while fewer than ``keep`` others would stay wholly free (a group that fills a domain breaks none)."""
    level = index.levels["nvlink"]
    used: dict[int, int] = {}
    for stage in stages:
        for ref in stage:
            for g in level.of_gpu.get(ref, ()):
                used[g] = used.get(g, 0) + 1
    whole = [g for g in used if level.size[g] == level.max_size and level.free_count[g] == level.size[g]]
    broken = sum(1 for g in whole if used[g] < level.size[g])
    return broken > 0 and len(level.whole[level.max_size]) - len(whole) < keep


def fit_cost(index: ClusterIndex, stages: Sequence[Sequence[str]]) -> tuple[int, int]:
    """Lower is better: best fit, then the tie-break of ``LevelIndex.best_fit`` (both the other way
    round under ``keep_whole``), for choosing between equally good degree options (the same TP and
    PP on two GPU types)."""
    broken, free = fragmentation(index, stages)
    return (broken, free) if index.levels["nvlink"].keep_whole else (free, broken)


def _layout_problem(index: ClusterIndex, stages: list[list[str]], tp: int) -> str | None:
    refs = [r for stage in stages for r in stage]
    info = index.info
    if len({info[r].node for r in refs}) <= 1:
        return None  # one node holds one block of ranks: always launchable (what layout_problem answers)
    return layout_problem([_R(n, info[r].node, info[r].index) for n, r in enumerate(refs)], tp)


@dataclass(frozen=True)
class _R:
    rank: int
    node: str
    gpu: int


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
