"""Decision latency of the fast solver, and its optimality gap against the CP-SAT exact baseline.

    .venv/bin/python benchmarks/solver_bench.py latency [--decisions N]
    .venv/bin/python benchmarks/solver_bench.py gap [--instances N] [--shapes all|classic]

latency: clusters of 256, 4,096 and 16,384 H100 GPUs (HGX nodes, seed 000's fabric), filled to 60 %
with a seeded mix of instances (TP 1/2/4/8 of Llama-3.1-8B/70B and Mixtral-8x22B); then N single
placements, each timed alone (perf_counter around ``Scheduler.place``) and released again so the
fill stays at 60 %. Prints p50/p99/max per size.

gap: N random small instances, random GPUs busy, a batch of 1-4 requests. Clusters (``--shapes all``,
the default): a quarter each of 1-4 nodes of HGX H100 or the 4-GPU NVLink-pair box, 2-4 GB200 trays in
one NVLink domain, 1-2 L40S PCIe boxes, an HGX H100 with an L40S box; ``classic``: the first kind only,
as before issue 35. The fast ``slo`` policy places each batch with ``Scheduler.place_batch`` (priority,
then fewest GPUs first, the largest first again when that leaves one unplaced; ``--arrival-order``: one
by one as they came), CP-SAT places the batch jointly; both outcomes are scored by
``solver.exact.objective``. Prints mean and max gap, the batches where the fast side leaves more
unplaced than CP-SAT (per cluster kind) apart from the objective gap on the others, the whole NVLink
groups each side breaks (fragmentation, which the objective's weights hide), and one digit per batch
with the groups the fast side broke (to compare two versions of the code batch by batch). Times are CPU
time (``time.process_time``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from toposched.solver.exact import objective, place_exact
from toposched.solver.index import ClusterIndex
from toposched.solver.request import Placement, PlacementRequest, Unplaced
from toposched.solver.scheduler import Scheduler
from toposched.solver.stages import fragmentation
from toposched.topology.model import Cluster, NVLinkClique
from toposched.topology.presets import gb200_nvl72, hgx, hgx_h100_cluster, l40s_pcie, nvlink_pairs_4gpu

MIX = [("llama-3.1-8b", (1,)), ("llama-3.1-8b", (2,)), ("llama-3.1-70b", (4,)), ("mixtral-8x22b", (8,))]


def _request(rng: random.Random, n: int) -> PlacementRequest:
    model, tps = rng.choice(MIX)
    return PlacementRequest(id=f"r{n}", model=model, allowed_tp=tps, max_model_len=8192, concurrent_seqs=8)


def latency(decisions: int) -> None:
    print(f"{'GPUs':>7} {'fill':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'placed':>7}")
    for gpus in (256, 4096, 16384):
        rng = random.Random(7)
        s = Scheduler(hgx_h100_cluster(nodes=gpus // 8, nodes_per_rack=8, racks_per_zone=8))
        n = 0
        while len(s.index.free) > 0.4 * gpus:
            s.place(_request(rng, n))
            n += 1
        fill = 1 - len(s.index.free) / gpus
        times = []
        placed = 0
        for _ in range(decisions):
            req = _request(rng, n)
            n += 1
            start = time.perf_counter()
            out = s.place(req)
            times.append((time.perf_counter() - start) * 1000)
            for p in out.placements:
                placed += 1
                s.release(p.id)
        times.sort()
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        print(f"{gpus:>7} {fill:>6.0%} {statistics.median(times):>8.3f} {p99:>8.3f} {times[-1]:>8.3f} {placed:>7}")


def _classic_cluster(rng: random.Random) -> Cluster:
    nodes = []
    for i in range(rng.randint(1, 4)):
        if rng.random() < 0.7:
            nodes.append(hgx(f"h{i}", "NVIDIA H100 80GB HBM3", 79.65))
        else:
            nodes.append(nvlink_pairs_4gpu(f"p{i}"))
    return Cluster(nodes=tuple(nodes))


def _gb200_trays(count: int) -> Cluster:
    """``count`` GB200 compute trays (4 GPUs each) in one multi-node NVLink domain (a slice of an NVL72)."""
    rack = gb200_nvl72("g")
    trays = rack.nodes[:count]
    clique = NVLinkClique(id="g/clique0", nodes=tuple(t.name for t in trays), bandwidth_gbps=900.0)
    return Cluster(name="g", nodes=trays, fabric=rack.fabric, cliques=(clique,))


def _small_cluster(rng: random.Random, shapes: str) -> tuple[str, Cluster]:
    """``classic``: 1-4 HGX H100 or 4-GPU NVLink-pair boxes. ``all`` (issue 35): also 2-4 GB200 trays in one
    NVLink domain, 1-2 L40S PCIe boxes, and HGX H100 with L40S boxes mixed."""
    if shapes == "classic":
        return "classic", _classic_cluster(rng)
    kind = rng.choice(("classic", "gb200", "l40s", "mixed"))
    if kind == "classic":
        return kind, _classic_cluster(rng)
    if kind == "gb200":
        return kind, _gb200_trays(rng.randint(2, 4))
    if kind == "l40s":
        return kind, Cluster(nodes=tuple(l40s_pcie(f"l{i}") for i in range(rng.randint(1, 2))))
    return kind, Cluster(nodes=(hgx("h0", "NVIDIA H100 80GB HBM3", 79.65), l40s_pcie("l0")))


def broken_groups(index_before: ClusterIndex, placements: list[Placement]) -> int:
    """Whole NVLink groups (all GPUs free before) that the placements take GPUs from."""
    return fragmentation(index_before, [[ref for p in placements for ref in p.gpu_refs]])[0]


def gap(instances: int, *, arrival_order: bool, shapes: str = "all") -> None:
    """Fast (``place_batch``, or one by one in arrival order) against CP-SAT, on the same batches."""
    gaps = []
    worse = 0
    exact_s: list[float] = []
    fast_s: list[float] = []
    unplaced_more = 0
    kinds: dict[str, int] = {}
    more_by_kind: dict[str, int] = {}
    comparable: list[float] = []
    frag_fast: list[int] = []
    frag_exact: list[int] = []
    for k in range(instances):
        rng = random.Random(k)
        kind, cluster = _small_cluster(rng, shapes)
        kinds[kind] = kinds.get(kind, 0) + 1
        refs = [f"{n.name}/{g.index}" for n in cluster.nodes for g in n.gpus]
        busy = rng.sample(refs, rng.randint(0, len(refs) // 2))
        batch = [_request(rng, j) for j in range(rng.randint(1, 4))]
        prio = {r.id: r.priority for r in batch}
        fast = Scheduler(cluster, busy=busy)
        base = Scheduler(cluster, busy=busy).index
        placed: list[Placement] = []
        unplaced: list[Unplaced] = []
        start = time.process_time()
        if arrival_order or not hasattr(fast, "place_batch"):
            for r in batch:
                out = fast.place(r)
                placed += out.placements
                unplaced += out.unplaced
        else:
            out = fast.place_batch(batch)
            placed, unplaced = out.placements, out.unplaced
        fast_s.append(time.process_time() - start)
        by_id = {r.id: r for r in batch}
        fast_cost = objective(base, placed, unplaced, prio, by_id)
        ex = Scheduler(cluster, busy=busy)
        start = time.process_time()
        out = place_exact(ex, batch)
        exact_s.append(time.process_time() - start)
        exact_cost = objective(base, out.placements, out.unplaced, prio, by_id)
        g = (fast_cost - exact_cost) / exact_cost if exact_cost else 0.0
        worse += g > 1e-12
        gaps.append(g)
        if len(unplaced) > len(out.unplaced):
            unplaced_more += 1
            more_by_kind[kind] = more_by_kind.get(kind, 0) + 1
        elif len(unplaced) == len(out.unplaced):
            comparable.append(g)
        frag_fast.append(broken_groups(base, placed))
        frag_exact.append(broken_groups(base, out.placements))
    order = "arrival order" if arrival_order or not hasattr(Scheduler, "place_batch") else "place_batch"
    more = sum(f > e for f, e in zip(frag_fast, frag_exact, strict=True))
    print(
        f"instances {instances} ({order}): mean gap {statistics.mean(gaps):.4%}, "
        f"median {statistics.median(gaps):.4%}, max {max(gaps):.4%}, min {min(gaps):.4%}; "
        f"fast worse on {worse}, leaves more unplaced on {unplaced_more}"
    )
    shown = ", ".join(f"{k} {n} ({more_by_kind.get(k, 0)} with more unplaced)" for k, n in sorted(kinds.items()))
    print(f"  clusters: {shown}")
    if comparable:
        print(
            f"  batches where both leave as many unplaced ({len(comparable)}): mean gap "
            f"{statistics.mean(comparable):.4%}, max {max(comparable):.4%} (the objective alone)"
        )
    print(
        f"  whole NVLink groups broken: fast {sum(frag_fast)}, exact {sum(frag_exact)} "
        f"(fast breaks more than exact on {more} of {instances} batches)"
    )
    print(
        f"  median CPU time per batch: fast {statistics.median(fast_s) * 1000:.2f} ms, "
        f"exact {statistics.median(exact_s) * 1000:.1f} ms"
    )
    print("  per-batch groups broken (fast): " + "".join(str(min(f, 9)) for f in frag_fast))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--decisions", type=int, default=500)
    g = sub.add_parser("gap")
    g.add_argument("--instances", type=int, default=300)
    g.add_argument("--arrival-order", action="store_true", help="place one by one as requests arrived")
    g.add_argument("--shapes", choices=("all", "classic"), default="all", help="clusters drawn (module docstring)")
    args = parser.parse_args()
    if args.what == "latency":
        latency(args.decisions)
    else:
        gap(args.instances, arrival_order=args.arrival_order, shapes=args.shapes)


if __name__ == "__main__":
    main()
