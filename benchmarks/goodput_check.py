"""Planned operating points checked by simulation: predicted vs simulated goodput and SLO attainment.

    .venv/bin/python benchmarks/goodput_check.py [--requests N] [--seeds 0,1,2] [--sigma S]

For three workloads (chat 1k in / 256 out, long-context 8k / 512, batch summarisation 4k / 1k), each with
its SLO, ``toposched plan`` picks the instance (Llama-3.1-70B on an HGX H100, the default policy) and its
operating point (``perf/serving.py``). One instance then serves Poisson arrivals at the rate a capacity
plan loads it with (``Placement.served_rps``: ``perf/serving.py`` ``planned_rate``) in the simulator's
continuous batching (``sim/batching.py``: chunked prefill, the KV cache in tokens, preemption), with the
same step cost and links as the placement, the batch and token budget of the plan, and the placement's KV
capacity. Measured after the first 10 % of the arrivals:

* SLO attainment: the share of requests whose TTFT and mean TPOT (first to last token over
  ``output_len - 1``) meet the workload's SLO;
* goodput: the output tokens of the requests that arrived in the window and met the SLO, over the
  window's length, against the predicted goodput at that rate (the rate x output_len, the plan
  predicting that every request meets the SLO).

``--sigma`` draws lengths from a lognormal of that sigma around the means (0: fixed lengths, the workload
the plan was made for). Medians over ``--seeds``. The figures are model against model (the planner's
closed form against the step-level simulator of the same cost model), not against GPUs."""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import statistics
import time
from dataclasses import dataclass

from toposched.perf.links import get_link
from toposched.perf.step import StepCost
from toposched.sim.batching import Batcher
from toposched.sim.workload import SimRequest
from toposched.solver.pd import Disaggregation, place_pd
from toposched.solver.request import Placement, PlacementRequest, Role
from toposched.solver.scheduler import Scheduler
from toposched.solver.sizing import PdSizing, size_pd_for_rate
from toposched.topology.presets import load_preset
from toposched.workload import resolve_model


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    slo_ttft_ms: float
    slo_tpot_ms: float


WORKLOADS = (
    Workload("chat 1k/256", 1024, 256, slo_ttft_ms=1000, slo_tpot_ms=40),
    Workload("long-context 8k/512", 8192, 512, slo_ttft_ms=3000, slo_tpot_ms=50),
    Workload("summarisation 4k/1k", 4096, 1024, slo_ttft_ms=5000, slo_tpot_ms=60),
)
MODEL = "llama-3.1-70b"
PRESET = "hgx-h100"
PD_PRESET = "cluster-32x-hgx-h100"


def _request(w: Workload, rid: str) -> PlacementRequest:
    """The workload's placement request: its lengths and SLO, required (as ``plan`` asks)."""
    return PlacementRequest(
        id=rid, model=MODEL, input_len=w.input_len, output_len=w.output_len,
        max_model_len=max(8192, w.input_len + w.output_len),
        slo_ttft_ms=w.slo_ttft_ms, slo_tpot_ms=w.slo_tpot_ms, slo_required=True,
    )  # fmt: skip


def plan(w: Workload) -> tuple[Placement, StepCost]:
    """The plan's first placement for the workload, and the step cost over its links."""
    scheduler = Scheduler(load_preset(PRESET))
    out = scheduler.place(_request(w, "check"))
    if not out.placements:
        raise SystemExit(f"{w.name}: not placed: {out.unplaced[0].reasons}")
    p = out.placements[0]
    spec = resolve_model(MODEL)
    gpu = scheduler.gpu_of_node[p.ranks[0].node]
    return p, StepCost(spec, gpu, tp=p.tp, pp=p.pp, link=get_link(p.link))


def _length(rng: random.Random, mean: int, sigma: float) -> int:
    if sigma <= 0:
        return mean
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, min(4 * mean, round(rng.lognormvariate(mu, sigma))))


def _arrivals(w: Workload, rate: float, n: int, seed: int, sigma: float, cap: int) -> list[SimRequest]:
    rng = random.Random(seed)
    out: list[SimRequest] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        isl = min(_length(rng, w.input_len, sigma), cap)
        out.append(SimRequest(i, t, isl, _length(rng, w.output_len, sigma), "interactive"))
    return out


def _batcher(p: Placement, cost: StepCost, *, prefill_only: bool = False) -> Batcher:
    assert p.max_num_seqs is not None and p.max_num_batched_tokens is not None
    return Batcher(
        cost, max_seqs=p.max_num_seqs, max_batched_tokens=p.max_num_batched_tokens,
        kv_capacity=p.kv_tokens_capacity, timeout_s=1e9, prefill_only=prefill_only,
    )  # fmt: skip


def serve(front: list[Batcher], back: list[Batcher], arrivals: list[SimRequest], kv_ms: float) -> list[SimRequest]:
    """Run ``arrivals`` through the instances: each goes to the least-loaded ``front`` instance; with a
    ``back`` pool (disaggregated), a prompt prefilled there moves ``kv_ms`` later to the least-loaded decode
    instance, which stamps its first token on arrival (as ``sim/disaggregated.py`` does). Returns the finished."""
    heap: list[tuple[float, int, int, str, object]] = []
    seq = itertools.count()
    version = [0] * (len(front) + len(back))
    pools = front + back
    done: list[SimRequest] = []

    def start(k: int, now: float) -> None:
        end = pools[k].compose(now, lambda _r: None)
        if end is not None:
            version[k] += 1
            heapq.heappush(heap, (end, next(seq), k, "step", version[k]))

    def give(k: int, req: SimRequest, now: float) -> None:
        b = pools[k]
        if b.busy:
            cut = b.interrupt(now)
            if cut is not None:
                version[k] += 1
                heapq.heappush(heap, (cut, next(seq), k, "step", version[k]))
            b.waiting.append(req)
        else:
            b.waiting.append(req)
            start(k, now)

    for req in arrivals:
        heapq.heappush(heap, (req.arrival_s, next(seq), -1, "arrive", req))
    while heap:
        now, _, k, kind, item = heapq.heappop(heap)
        if kind == "arrive":
            assert isinstance(item, SimRequest)
            give(min(range(len(front)), key=lambda i: front[i].load), item, now)
        elif kind == "kv":
            assert isinstance(item, SimRequest)
            item.first_token_s = now
            give(len(front) + min(range(len(back)), key=lambda i: back[i].load), item, now)
        elif item == version[k]:
            for req in pools[k].finish(now):
                if back and k < len(front):
                    heapq.heappush(heap, (now + kv_ms / 1e3, next(seq), -1, "kv", req))
                else:
                    done.append(req)
            start(k, now)
    return done


def measure(w: Workload, done: list[SimRequest], warm: float, end: float) -> tuple[float, float, float, float]:
    """(SLO attainment, goodput tok/s, TTFT p50 ms, mean TPOT p50 ms) of the requests that arrived in
    ``[warm, end]``; goodput: their output tokens that met the SLO over that window."""
    kept = [r for r in done if warm <= r.arrival_s <= end]
    met, ttfts, tpots = [], [], []
    for r in kept:
        ttft = (r.first_token_s - r.arrival_s) * 1e3
        tpot = (r.finish_s - r.first_token_s) * 1e3 / max(r.output_len - 1, 1)
        ttfts.append(ttft)
        tpots.append(tpot)
        met.append(ttft <= w.slo_ttft_ms and tpot <= w.slo_tpot_ms)
    goodput = sum(r.output_len for r, ok in zip(kept, met, strict=True) if ok) / (end - warm)
    return sum(met) / len(kept), goodput, statistics.median(ttfts), statistics.median(tpots)


def simulate(
    p: Placement, cost: StepCost, w: Workload, rate: float, n: int, seed: int, sigma: float
) -> tuple[float, float, float, float]:
    """One instance at ``rate`` (see ``measure``)."""
    arrivals = _arrivals(w, rate, n, seed, sigma, p.kv_tokens_capacity // 2)
    done = serve([_batcher(p, cost)], [], arrivals, 0.0)
    return measure(w, done, arrivals[n // 10].arrival_s, arrivals[-1].arrival_s)


def plan_pd(w: Workload, rate: float) -> tuple[list[Placement], list[Placement], PdSizing, dict[str, StepCost]]:
    """``--pd auto`` for the workload at ``rate`` on the 256-GPU preset, disaggregated whatever it would
    choose: the prefill and decode placements, the sizing (KV transfer, TTFT), a step cost per placement."""
    scheduler = Scheduler(load_preset(PD_PRESET))
    request = _request(w, "pd")
    sized = size_pd_for_rate(scheduler, request, rate)
    if sized is None:
        raise SystemExit(f"{w.name}: no disaggregated sizing meets the SLO")
    layout = Disaggregation(prefill=sized.prefill.capacity.replicas, decode=sized.decode.capacity.replicas)
    degrees: dict[Role, tuple[int, int]] = {
        "prefill": (sized.prefill.capacity.tp, sized.prefill.capacity.pp),
        "decode": (sized.decode.capacity.tp, sized.decode.capacity.pp),
    }
    made = place_pd(scheduler, request, layout, degrees=degrees)
    if made.outcome.unplaced:
        raise SystemExit(f"{w.name}: {len(made.outcome.unplaced)} instances not placed")
    spec = resolve_model(MODEL)
    costs = {
        p.id: StepCost(spec, scheduler.gpu_of_node[p.ranks[0].node], tp=p.tp, pp=p.pp, link=get_link(p.link))
        for p in made.outcome.placements
    }
    prefills = [p for p in made.outcome.placements if p.role == "prefill"]
    decodes = [p for p in made.outcome.placements if p.role == "decode"]
    return prefills, decodes, sized, costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--sigma", type=float, default=0.0)
    ap.add_argument("--pd-rate", type=float, default=20.0, help="requests/s of the disaggregated check")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{MODEL} on {PRESET}; each instance at its planned rate; {args.requests} requests, "
          f"seeds {seeds}, length sigma {args.sigma:g}")  # fmt: skip
    header = "workload                 tp batch limit     TTFT/TPOT pred (ms)  rate r/s  goodput pred  sim   ratio  SLO met  sim TTFT/TPOT p50  cpu s"  # noqa: E501
    print(header)
    for w in WORKLOADS:
        p, cost = plan(w)
        assert p.served_rps is not None and p.goodput_tokens_per_s is not None
        rate = p.served_rps
        predicted = rate * w.output_len
        t0 = time.process_time()
        runs = [simulate(p, cost, w, rate, args.requests, seed, args.sigma) for seed in seeds]
        cpu = time.process_time() - t0
        met = statistics.median(r[0] for r in runs)
        good = statistics.median(r[1] for r in runs)
        ttft = statistics.median(r[2] for r in runs)
        tpot = statistics.median(r[3] for r in runs)
        print(
            f"{w.name:24} {p.tp:2} {p.max_num_seqs:5} {p.operating_limit or '':9} {p.ttft_ms:7.0f} / {p.tpot_ms:5.1f}"
            f"      {rate:7.2f}  {predicted:10.0f} {good:6.0f}  {good / predicted:5.3f}  {met:6.3f}"
            f"   {ttft:7.0f} / {tpot:5.1f}   {cpu:5.1f}"
        )
    print(f"\ndisaggregated on {PD_PRESET} at {args.pd_rate:g} req/s (pools as size_pd_for_rate sizes them)")
    print("workload                 prefill    decode       TTFT pred  goodput pred  sim   ratio  SLO met  "
          "sim TTFT/TPOT p50  cpu s")  # fmt: skip
    for w in WORKLOADS:
        prefills, decodes, sized, costs = plan_pd(w, args.pd_rate)
        predicted = args.pd_rate * w.output_len
        kv_ms, ttft_pred = sized.kv_ms, sized.ttft_ms
        t0 = time.process_time()
        runs = []
        for seed in seeds:
            cap = min(p.kv_tokens_capacity for p in decodes) // 2
            arrivals = _arrivals(w, args.pd_rate, args.requests, seed, args.sigma, cap)
            front = [_batcher(p, costs[p.id], prefill_only=True) for p in prefills]
            back = [_batcher(p, costs[p.id]) for p in decodes]
            warm, end = arrivals[args.requests // 10].arrival_s, arrivals[-1].arrival_s
            runs.append(measure(w, serve(front, back, arrivals, kv_ms), warm, end))
        cpu = time.process_time() - t0
        met, good = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        ttft, tpot = statistics.median(r[2] for r in runs), statistics.median(r[3] for r in runs)
        pre = f"{len(prefills)} x tp{prefills[0].tp} b{prefills[0].max_num_seqs}"
        dec = f"{len(decodes)} x tp{decodes[0].tp} b{decodes[0].max_num_seqs}"
        print(
            f"{w.name:24} {pre:10} {dec:12} {ttft_pred:7.0f}    {predicted:10.0f} {good:6.0f}  {good / predicted:5.3f}"
            f"  {met:6.3f}   {ttft:7.0f} / {tpot:5.1f}   {cpu:5.1f}"
        )


if __name__ == "__main__":
    main()
