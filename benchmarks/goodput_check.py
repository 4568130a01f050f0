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
* goodput: output tokens/s of the requests that meet it, against the predicted goodput at that rate
  (the rate x output_len, the plan predicting that every request meets the SLO).

``--sigma`` draws lengths from a lognormal of that sigma around the means (0: fixed lengths, the workload
the plan was made for). Medians over ``--seeds``. The figures are model against model (the planner's
closed form against the step-level simulator of the same cost model), not against GPUs."""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass

from toposched.perf.links import get_link
from toposched.perf.step import StepCost
from toposched.sim.batching import Batcher
from toposched.sim.workload import SimRequest
from toposched.solver.request import Placement, PlacementRequest
from toposched.solver.scheduler import Scheduler
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


def plan(w: Workload) -> tuple[Placement, StepCost]:
    """The plan's first placement for the workload, and the step cost over its links."""
    scheduler = Scheduler(load_preset(PRESET))
    request = PlacementRequest(
        id="check", model=MODEL, input_len=w.input_len, output_len=w.output_len,
        max_model_len=max(8192, w.input_len + w.output_len),
        slo_ttft_ms=w.slo_ttft_ms, slo_tpot_ms=w.slo_tpot_ms, slo_required=True,
    )  # fmt: skip
    out = scheduler.place(request)
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


def simulate(
    p: Placement, cost: StepCost, w: Workload, rate: float, n: int, seed: int, sigma: float
) -> tuple[float, float, float, float]:
    """(SLO attainment, goodput tok/s, TTFT p50 ms, mean TPOT p50 ms) of ``n`` Poisson arrivals at ``rate``."""
    rng = random.Random(seed)
    arrivals: list[SimRequest] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        isl = min(_length(rng, w.input_len, sigma), p.kv_tokens_capacity // 2)
        arrivals.append(SimRequest(i, t, isl, _length(rng, w.output_len, sigma), "interactive"))
    assert p.max_num_seqs is not None and p.max_num_batched_tokens is not None
    batcher = Batcher(
        cost, max_seqs=p.max_num_seqs, max_batched_tokens=p.max_num_batched_tokens,
        kv_capacity=p.kv_tokens_capacity, timeout_s=1e9,
    )  # fmt: skip
    done: list[SimRequest] = []
    nxt = 0
    end: float | None = None
    while len(done) < n:
        arrival = arrivals[nxt].arrival_s if nxt < n else math.inf
        if end is None or arrival < end:
            now = arrival
            if batcher.busy:
                cut = batcher.interrupt(now)
                end = cut if cut is not None else end
            batcher.waiting.append(arrivals[nxt])
            nxt += 1
            if end is None:
                end = batcher.compose(now, lambda _r: None)
            continue
        now = end
        done.extend(batcher.finish(now))
        end = batcher.compose(now, lambda _r: None)
    warm = arrivals[n // 10].arrival_s
    kept = [r for r in done if r.arrival_s >= warm]
    met, ttfts, tpots = [], [], []
    for r in kept:
        ttft = (r.first_token_s - r.arrival_s) * 1e3
        tpot = (r.finish_s - r.first_token_s) * 1e3 / max(r.output_len - 1, 1)
        ttfts.append(ttft)
        tpots.append(tpot)
        met.append(ttft <= w.slo_ttft_ms and tpot <= w.slo_tpot_ms)
    span = max(r.finish_s for r in kept) - warm
    goodput = sum(r.output_len for r, ok in zip(kept, met, strict=True) if ok) / span
    return sum(met) / len(kept), goodput, statistics.median(ttfts), statistics.median(tpots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--sigma", type=float, default=0.0)
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


if __name__ == "__main__":
    main()
