"""``toposched plan``: choose degrees and exact GPUs for model instances and explain the choice."""

from __future__ import annotations

from dataclasses import replace

import typer
from rich.table import Table

from toposched.cli._common import console, err_console, print_json
from toposched.cli.plan_options import plan_options
from toposched.cli.plan_source import Placed, PlanSource
from toposched.cli.progress import QUIET, Reporter
from toposched.solver.request import Placement, PlacementRequest, Unplaced


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


def _render(placements: list[Placement], unplaced: list[Unplaced], title: str, request: PlacementRequest) -> None:
    """The plan for people. Its labels are the ``plan --json`` field names (``hbm_per_gpu``, ``ttft_ms``,
    ``max_num_seqs`` ...), so a value read here is found under the same name in the JSON."""
    console.print(title, soft_wrap=True)
    for p in placements:
        role = f" ({p.role})" if p.role else ""
        table = Table(title=f"{p.id}{role}: {p.model} tp={p.tp} pp={p.pp}", title_justify="left")
        for col in ("rank", "node", "gpu", "stage"):
            table.add_column(col)
        for r in p.ranks:
            table.add_row(str(r.rank), r.node, str(r.gpu), str(r.stage))
        console.print(table)
        gib = 2**30
        hbm = p.hbm_per_gpu
        console.print(
            f"  hbm_per_gpu: weights {hbm.weights / gib:.2f} GiB, kv {hbm.kv / gib:.2f} GiB, activations "
            f"{hbm.activations / gib:.2f} GiB, workspace {hbm.workspace / gib:.2f} GiB, "
            f"total {hbm.total / gib:.2f} GiB",
            soft_wrap=True,
        )
        console.print(f"  kv_dtype {p.kv_dtype}, kv_tokens_capacity {p.kv_tokens_capacity:,}", soft_wrap=True)
        _render_operating_point(p, request)
        for c in p.constraints:
            if c.name == "slo" and request.slo_tpot_ms is None and request.slo_ttft_ms is None:
                continue  # nothing to hold: no "ok slo" without an SLO
            mark = "[green]ok[/]" if c.held else "[red]broken[/]"
            console.print(f"  {mark} {c.name}: {c.detail}", soft_wrap=True)
        if p.fallbacks:
            console.print(f"  fallbacks: {', '.join(p.fallbacks)}")
        if p.experts is not None:
            e = p.experts
            console.print(
                f"  experts: ep={e.ep}, replicas {e.replicas} (hot copies), imbalance_before "
                f"{e.imbalance_before:.2f} -> imbalance_after {e.imbalance_after:.2f}, extra_bytes_per_gpu "
                f"{e.extra_bytes_per_gpu / gib:.2f} GiB",
                soft_wrap=True,
            )
        if p.compression or p.overlap:
            console.print(f"  degradations: compression {p.compression or 'none'}, overlap {p.overlap:.0%}")
        if p.kv_nics:
            numa = ",".join("?" if n is None else str(n) for n in p.host_numa)
            console.print(f"  kv_nics {','.join(p.kv_nics)} (KV transfer, per rank); host_numa {numa}")
    for u in unplaced:
        console.print(f"[red]not placed[/] {u.request_id} replica {u.replica} (status {u.status}):", soft_wrap=True)
        for reason in u.reasons:
            console.print(f"  - {reason}", soft_wrap=True, markup=False)


def _render_operating_point(p: Placement, request: PlacementRequest) -> None:
    """The running batch and what one request sees at it (``perf/serving.py``)."""
    limit = p.operating_limit or ""
    why = f" (operating_limit {limit}: {LIMITS[limit]})" if limit in LIMITS else ""
    if p.role == "prefill":
        console.print(
            f"  operating point: max_num_seqs {p.max_num_seqs} prompts per pass, max_num_batched_tokens "
            f"{p.max_num_batched_tokens}{why}; a pass takes tpot_ms {p.tpot_ms:.1f}; predicted ttft_ms "
            f"{p.ttft_ms:.1f} at served_rps {p.served_rps or 0:.2f}; link {p.link}, level {p.level}",
            soft_wrap=True,
        )
        return
    batch = p.max_num_seqs or request.concurrent_seqs
    console.print(
        f"  operating point: max_num_seqs {batch}{why}, max_num_batched_tokens {p.max_num_batched_tokens or '?'}; "
        f"input_len {request.input_len}, output_len {request.output_len}",
        soft_wrap=True,
    )
    meeting = " meeting the SLO" if request.slo_tpot_ms is not None or request.slo_ttft_ms is not None else ""
    served = (
        f"; goodput_tokens_per_s {p.goodput_tokens_per_s:,.0f}{meeting}, served_rps {p.served_rps:.2f} per instance"
        if p.goodput_tokens_per_s is not None and p.served_rps is not None
        else ""
    )
    p95 = f", tpot_p95_ms {p.tpot_p95_ms:.2f}" if p.tpot_p95_ms is not None else ""
    console.print(
        f"  predicted per request: ttft_ms {p.ttft_ms:.1f}, tpot_ms {p.tpot_ms:.2f}{p95}{served}; link {p.link}, "
        f"level {p.level}, cross_domain_gbps {p.cross_domain_gbps:.2f}",
        soft_wrap=True,
    )


LIMITS = {
    "slo-tpot": "one more would miss the TPOT SLO",
    "slo-ttft": "one more would miss the TTFT SLO",
    "kv-cache": "all the KV cache holds at these lengths",
    "engine": "the engine's batch limit",
    "pass": "all a pass of the token budget holds",
    "knee": "throughput knee: 90 % of the largest batch's throughput, no SLO given",
    "fixed": "--concurrent-seqs",
}
"""Why a plan's running batch is not larger (``Placement.operating_limit``), as the table says it."""


def _render_pd(placed: Placed) -> None:
    """The pairs and stores of a disaggregated plan, after its placements."""
    pd = placed.disaggregation
    if pd is None:
        return
    for decode, prefill in pd.pairs.items():
        console.print(f"pair: decode {decode} <- prefill {prefill}", soft_wrap=True, markup=False)
    for store in placed.stores:
        console.print(
            f"store ({pd.kv_store}): node {store.node}, rack {store.rack}, nics {','.join(store.nics)}",
            soft_wrap=True,
            markup=False,
        )


@plan_options(plan_file=False)
def plan(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    engine: str = typer.Option(
        "vllm", "--engine", help="Engine the instances run: vllm, sglang or trtllm (prices their steps)."
    ),
    quiet: bool = QUIET,
    *,
    source: PlanSource,
) -> None:
    """Choose parallel degrees and exact GPUs for model instances, with predicted latency and reasons."""
    with Reporter("plan", quiet=quiet) as progress:
        placed = replace(source, engine=engine).place(progress)
        if json_out:
            progress.stage("writing the plan")
            doc = placed.document()
    outcome = placed.outcome
    if json_out:
        print_json(doc)
    else:
        title = f"[bold]{source.model}[/] on {placed.ref.describe()} (policy {placed.policy})"
        _render(outcome.placements, outcome.unplaced, title, placed.request)
        _render_pd(placed)
        _render_capacity(placed)
    if placed.shortfall:
        err_console.print(f"error: {placed.shortfall}", markup=False, soft_wrap=True)
    if outcome.unplaced:
        raise typer.Exit(1)


def _render_capacity(placed: Placed) -> None:
    if placed.mode is not None:
        console.print(f"mode: chosen {placed.mode.chosen} (why: {placed.mode.why})", soft_wrap=True, markup=False)
    cap = placed.capacity
    if cap is None:
        return
    console.print(
        f"capacity: request_rate_rps {cap.request_rate_rps:g}; replicas {cap.replicas} x tp={cap.tp} pp={cap.pp} "
        f"on gpu {cap.gpu} (gpus {cap.gpus}) at batch {cap.batch} each: served_rps {cap.served_rps:g} together",
        soft_wrap=True,
        markup=False,
    )
