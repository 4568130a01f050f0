"""The plan document embeds only the nodes its placements use, plus the whole cluster's fingerprint (issue 17)."""

from __future__ import annotations

import json

from toposched.binding.engines import build_launches
from toposched.binding.plan_doc import parse_plan, plan_json
from toposched.binding.plan_schema import ClusterSummary, used_cluster
from toposched.sim.loading import load_cluster
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler


def test_one_instance_on_a_large_cluster_is_a_small_self_contained_plan() -> None:
    cluster = load_cluster("512xhgx-h100")  # 4,096 GPUs
    request = PlacementRequest(id="r", model="llama-3.1-70b", allowed_tp=(4,), replicas=2, spread_replicas=True)
    out = Scheduler(cluster).place(request)
    doc = plan_json(out.placements, out.unplaced, request, cluster, policy="slo", source="test")
    text = json.dumps(doc)
    assert len(text) < 100_000  # was ~8 MB with the whole cluster embedded
    used = {r.node for p in out.placements for r in p.ranks}
    assert {n["name"] for n in doc["cluster"]["nodes"]} == used and len(used) == 2
    summary = doc["cluster_summary"]
    assert summary["nodes"] == 512 and summary["gpus"] == 4096 and len(summary["sha256"]) == 64
    assert summary == ClusterSummary.of(cluster).model_dump()  # deterministic
    other = cluster.model_copy(update={"name": "other"})
    assert ClusterSummary.of(other).sha256 != summary["sha256"]
    plan = parse_plan(json.loads(text), "plan.json")  # reads back and passes every check
    assert [p.id for p in plan.placements] == [p.id for p in out.placements]
    assert plan.cluster.fabric == cluster.fabric
    launches = build_launches(plan.placements, plan.request, plan.cluster, "vllm")  # and launches
    assert {launch.node for launch in launches} == used


def test_a_small_cluster_is_embedded_whole_and_cliques_are_cut_to_the_used_nodes() -> None:
    cluster = load_cluster("2xhgx-h100")
    request = PlacementRequest(id="r", model="llama-3.1-8b", allowed_tp=(1,))
    out = Scheduler(cluster).place(request)
    assert len(used_cluster(cluster, out.placements).nodes) == 1
    assert used_cluster(cluster, []).nodes == cluster.nodes[:1]  # still a valid cluster
    whole = cluster.model_copy(update={"nodes": cluster.nodes[:1]})
    assert used_cluster(whole, out.placements) is whole
