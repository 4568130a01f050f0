"""``toposched plan``: choose degrees and exact GPUs for model instances and explain the choice."""

from __future__ import annotations

from pathlib import Path

import typer
from pydantic import ValidationError
from rich.table import Table

from toposched.binding.plan_doc import plan_json
from toposched.cli._common import CLUSTER, LIVE, PRESET, SMI, console, err_console, print_json, source_ref
from toposched.cli.calibrate import PROFILE, profile_option
from toposched.errors import InputError
from toposched.perf.profile import use_profile
from toposched.solver.request import Placement, PlacementRequest, Unplaced
from toposched.solver.scheduler import POLICIES, Scheduler
from toposched.topology.model import Cluster
from toposched.topology.sources import load_source
from toposched.workload import resolve_model
from toposched.workload.parallel import tp_problem, valid_tps


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


def parse_gpu_list(text: str | None, cluster: Cluster, flag: str) -> list[str]:
    """'0,1,5' (single-node clusters) or 'node/0,node/1' -> GPU refs; errors name the flag."""
    if not text:
        return []
    known = {f"{n.name}/{g.index}" for n in cluster.nodes for g in n.gpus}
    refs: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if "/" in item:
            ref = item
        elif item.isdigit():
            if len(cluster.nodes) != 1:
                raise InputError(
                    f"{flag} {item!r}: this cluster has {len(cluster.nodes)} nodes", fix="write NODE/INDEX"
                )
            ref = f"{cluster.nodes[0].name}/{item}"
        else:
            raise InputError(f"{flag}: {item!r} is not a GPU index", fix="give indices like 0,1,2 or NODE/INDEX")
        if ref not in known:
            raise InputError(f"{flag}: GPU {ref} is not in the topology")
        refs.append(ref)
    return refs


def _rates(text: str | None) -> tuple[float, ...] | None:
    if not text:
        return None
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise InputError(f"--expert-hit-rates: {exc}", fix="give numbers like 0.2,0.1,0.05,...") from exc


def _render(placements: list[Placement], unplaced: list[Unplaced], title: str, request: PlacementRequest) -> None:
    console.print(title, soft_wrap=True)
    for p in placements:
        table = Table(title=f"{p.id}: {p.model} tp={p.tp} pp={p.pp}", title_justify="left")
        for col in ("rank", "node", "GPU", "stage"):
            table.add_column(col)
        for r in p.ranks:
            table.add_row(str(r.rank), r.node, str(r.gpu), str(r.stage))
        console.print(table)
        gib = 2**30
        hbm = p.hbm_per_gpu
        console.print(
            f"  per GPU: weights {hbm.weights / gib:.2f} GiB, KV {hbm.kv / gib:.2f} GiB ({p.kv_dtype}, "
            f"{p.kv_tokens_capacity:,} tokens), activations {hbm.activations / gib:.2f} GiB, "
            f"workspace {hbm.workspace / gib:.2f} GiB",
            soft_wrap=True,
        )
        console.print(
            f"  predicted TTFT {p.ttft_ms:.1f} ms, TPOT {p.tpot_ms:.2f} ms at batch {request.concurrent_seqs}, "
            f"{request.input_len} in / {request.output_len} out, over {p.link} (level {p.level}); "
            f"cross-domain {p.cross_domain_gbps:.2f} GB/s",
            soft_wrap=True,
        )
        for c in p.constraints:
            mark = "[green]ok[/]" if c.held else "[red]broken[/]"
            console.print(f"  {mark} {c.name}: {c.detail}", soft_wrap=True)
        if p.fallbacks:
            console.print(f"  fallbacks used: {', '.join(p.fallbacks)}")
        if p.experts is not None:
            e = p.experts
            console.print(
                f"  experts: ep={e.ep}, {e.replicas} hot copies, load imbalance {e.imbalance_before:.2f} -> "
                f"{e.imbalance_after:.2f}, +{e.extra_bytes_per_gpu / gib:.2f} GiB per GPU",
                soft_wrap=True,
            )
        if p.compression or p.overlap:
            console.print(f"  degradations: compression {p.compression or 'none'}, overlap {p.overlap:.0%}")
    for u in unplaced:
        console.print(f"[red]not placed[/] {u.request_id} replica {u.replica} ({u.status}):", soft_wrap=True)
        for reason in u.reasons:
            console.print(f"  - {reason}", soft_wrap=True, markup=False)


def plan(
    model: str = typer.Option(..., "--model", help="Catalog name, Hugging Face id or config.json path."),
    smi: str | None = SMI,
    preset: str | None = PRESET,
    cluster: str | None = CLUSTER,
    live: bool = LIVE,
    gpu: str | None = typer.Option(None, "--gpu", help="GPU type when the topology does not say (e.g. H100-SXM)."),
    replicas: int = typer.Option(1, "--replicas", help="Instances to place."),
    tp: int | None = typer.Option(None, "--tp", help="Force this tensor-parallel degree."),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel degree (MoE; must divide tp)."),
    expert_replicas: int = typer.Option(0, "--expert-replicas", help="Copies of hot experts allowed (ep > 1)."),
    expert_hit_rates: str | None = typer.Option(
        None, "--expert-hit-rates", help="Per-expert hit rates, comma-separated (ep > 1).", metavar="R0,R1,..."
    ),
    max_pp: int = typer.Option(8, "--max-pp", help="Largest pipeline-parallel degree to consider."),
    slo_tpot_ms: float | None = typer.Option(None, "--slo-tpot-ms", help="Per-token latency SLO."),
    slo_ttft_ms: float | None = typer.Option(None, "--slo-ttft-ms", help="Time-to-first-token SLO."),
    slo_class: str = typer.Option("interactive", "--slo-class", help="realtime|interactive|standard|batch."),
    max_model_len: int = typer.Option(8192, "--max-model-len", help="Context length to reserve KV for."),
    concurrent_seqs: int = typer.Option(8, "--concurrent-seqs", help="Sequences to reserve KV for (and batch)."),
    input_len: int = typer.Option(1024, "--input-len", help="Typical prompt length for predictions."),
    output_len: int = typer.Option(256, "--output-len", help="Typical output length for predictions."),
    weight_dtype: str | None = typer.Option(None, "--weight-dtype", help="bf16|fp16|fp8|int8|int4."),
    kv_dtype: str | None = typer.Option(None, "--kv-dtype", help="auto|fp8|int8|int4."),
    affinity: str = typer.Option("auto", "--affinity", help="auto|nvlink|pcie-switch|numa|node|none."),
    policy: str = typer.Option("slo", "--policy", help=f"Placement policy: {'|'.join(POLICIES.names())}."),
    busy: str | None = typer.Option(None, "--busy", help="GPUs already taken: 0,1,... or NODE/INDEX,..."),
    budget_gbps: float = typer.Option(256.0, "--budget-gbps", help="Cross-domain traffic budget (GB/s)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the random policy."),
    profile: Path | None = PROFILE,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Choose parallel degrees and exact GPUs for model instances, with predicted latency and reasons."""
    ref = source_ref(smi, preset, cluster, live)
    if ref is None:
        raise InputError("plan needs a topology", fix="pass --preset NAME, --smi FILE, --cluster FILE or --live")
    POLICIES.get(policy)  # unknown names fail here with the valid ones
    if tp is not None:
        spec = resolve_model(model)
        problem = tp_problem(spec, tp)
        if problem:
            raise InputError(f"--tp {tp}: {problem}", fix="valid tp: " + ", ".join(map(str, valid_tps(spec))))
    try:
        request = PlacementRequest(
            id="plan",
            model=model,
            replicas=replicas,
            allowed_tp=(tp,) if tp else None,
            ep=ep,
            expert_replicas=expert_replicas,
            expert_hit_rates=_rates(expert_hit_rates),
            max_pp=max_pp,
            slo_tpot_ms=slo_tpot_ms,
            slo_ttft_ms=slo_ttft_ms,
            slo_class=slo_class,
            max_model_len=max_model_len,
            concurrent_seqs=concurrent_seqs,
            input_len=min(input_len, max_model_len),
            output_len=output_len,
            weight_dtype=weight_dtype,
            kv_dtype=kv_dtype,
            affinity=affinity,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["loc"]:
            flag = "--" + str(err["loc"][0]).replace("_", "-")
            raise InputError(f"{flag}: {err['msg']} (got {err.get('input')!r})") from exc
        raise InputError(f"request: {err['msg']}") from exc
    chosen = profile_option(profile)  # a bad profile fails before the topology is read
    loaded = load_source(ref)
    for w in loaded.warnings:
        err_console.print(f"warning: {w}", markup=False, soft_wrap=True)
    busy_refs = parse_gpu_list(busy, loaded.cluster, "--busy")
    scheduler = Scheduler(loaded.cluster, gpu=gpu, busy=busy_refs, budget_gbps=budget_gbps, seed=seed)
    with use_profile(chosen):  # the JSON document may predict too: keep it until the end
        outcome = scheduler.place(request, policy=policy)
        if json_out:
            print_json(
                plan_json(
                    outcome.placements, outcome.unplaced, request, loaded.cluster, policy=policy, source=ref.describe()
                )
            )
        else:
            title = f"[bold]{model}[/] on {ref.describe()} (policy {policy})"
            _render(outcome.placements, outcome.unplaced, title, request)
    if outcome.unplaced:
        raise typer.Exit(1)
