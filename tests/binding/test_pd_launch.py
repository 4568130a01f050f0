"""SGLang launches of a prefill/decode disaggregated plan: roles, KV NICs, bootstrap ports, the router."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from tests.conftest import RunCli
from toposched.binding.engine_args import ROUTER_FLAGS
from toposched.binding.engines import SGLANG_FLAGS, build_launches, sglang_ib_device
from toposched.binding.node_launch import NodeLaunch
from toposched.binding.plan_doc import PlanDoc, parse_plan, plan_json
from toposched.errors import InputError
from toposched.solver.pd import Disaggregation, place_pd
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.presets import hgx_h100_cluster


def _pd_doc(cluster_nodes: int = 8, **spec: Any) -> PlanDoc:
    cluster = hgx_h100_cluster(nodes=cluster_nodes)
    request = PlacementRequest(id="plan", model="llama-3.1-70b", slo_ttft_ms=600, slo_tpot_ms=40)
    made = place_pd(Scheduler(cluster), request, Disaggregation(**spec))
    out = made.outcome
    assert not out.unplaced, out.unplaced
    doc = plan_json(
        out.placements, [], request, cluster, policy="slo", source="test", disaggregation=made.layout,
        stores=made.stores,
    )  # fmt: skip
    return parse_plan(json.loads(json.dumps(doc)), "pd.json")


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _launch(doc: PlanDoc) -> list[NodeLaunch]:
    return build_launches(doc.placements, doc.request, doc.cluster, "sglang", disaggregation=doc.disaggregation)


def test_each_instance_runs_in_its_role_over_the_nics_of_its_ranks() -> None:
    doc = _pd_doc(prefill=3, decode=4, kv_store="mooncake")
    launches = _launch(doc)
    servers = [x for x in launches if x.role in ("prefill", "decode")]
    assert len(servers) == len(doc.placements) == 7
    by_id = {p.id: p for p in doc.placements}
    for launch in servers:
        p = by_id[launch.placement]
        argv = launch.argv
        assert _flags(argv) <= SGLANG_FLAGS, _flags(argv) - SGLANG_FLAGS
        assert _value(argv, "--disaggregation-mode") == p.role == launch.role
        assert _value(argv, "--disaggregation-transfer-backend") == "mooncake"
        # the IB device of visible GPU i is the KV NIC of the rank on the i-th GPU of CUDA_VISIBLE_DEVICES
        device = _value(argv, "--disaggregation-ib-device")
        mapping = (
            json.loads(device) if device.startswith("{") else dict.fromkeys(map(str, range(len(launch.gpus))), device)
        )
        nic_of = {(r.node, r.gpu): nic for r, nic in zip(p.ranks, p.kv_nics, strict=True)}
        visible = launch.env["CUDA_VISIBLE_DEVICES"].split(",")
        assert [mapping[str(i)] for i in range(len(visible))] == [nic_of[(launch.node, int(g))] for g in visible]
        assert ("--disaggregation-bootstrap-port" in argv) == (p.role == "prefill")
    # bootstrap ports are unique on each node, and apart from the servers' ports
    taken = Counter((x.node, port) for x in servers for port in (x.port, x.bootstrap_port) if port is not None)
    assert max(taken.values()) == 1


def test_the_router_points_at_every_prefill_with_its_bootstrap_port_and_every_decode() -> None:
    doc = _pd_doc(prefill=2, decode=3)
    launches = _launch(doc)
    router = launches[-1]
    assert router.role == "router" and router.placement == "plan-router" and router.gpus == []
    argv = router.argv
    assert argv[:4] == ["python3", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    assert _flags(argv) <= ROUTER_FLAGS
    prefill = [argv[i + 1 : i + 3] for i, a in enumerate(argv) if a == "--prefill"]
    decode = [argv[i + 1] for i, a in enumerate(argv) if a == "--decode"]
    heads = [x for x in launches[:-1] if x.node_rank == 0]
    assert prefill == [[f"http://{x.node}:{x.port}", str(x.bootstrap_port)] for x in heads if x.role == "prefill"]
    assert decode == [f"http://{x.node}:{x.port}" for x in heads if x.role == "decode"]
    assert router.node == heads[0].node and _value(argv, "--port") == "30000"


def test_a_multi_node_prefill_instance_keeps_its_rendezvous_and_bootstrap_apart() -> None:
    cluster = hgx_h100_cluster(nodes=4)
    request = PlacementRequest(id="plan", model="llama-3.1-405b", slo_tpot_ms=60)
    made = place_pd(Scheduler(cluster), request, Disaggregation(prefill=1, decode=1))
    doc = plan_json(made.outcome.placements, [], request, cluster, policy="slo", source="t", disaggregation=made.layout)
    plan = parse_plan(doc, "pd.json")
    launches = _launch(plan)
    prefill = [x for x in launches if x.role == "prefill"]
    assert len(prefill) == 2 and {x.nnodes for x in prefill} == {2}
    assert {x.bootstrap_port for x in prefill} == {8998} and {x.dist_port for x in prefill} == {20000}


def test_a_disaggregated_plan_is_refused_where_it_would_start_as_plain_servers() -> None:
    doc = _pd_doc(prefill=1, decode=1)
    with pytest.raises(InputError, match=r"plan-prefill is a prefill instance .* starts plain instances only"):
        build_launches(doc.placements, doc.request, doc.cluster, "sglang")
    with pytest.raises(InputError, match="disaggregated plans with SGLang or vLLM only so far, not trtllm"):
        build_launches(doc.placements, doc.request, doc.cluster, "trtllm", disaggregation=doc.disaggregation)


def test_one_device_for_ranks_that_share_a_nic() -> None:
    p = _pd_doc(prefill=1, decode=1).placements[0]
    node, gpus = p.ranks[0].node, [r.gpu for r in p.ranks]
    assert len(set(p.kv_nics)) > 1
    assert json.loads(sglang_ib_device(p, node, gpus)) == {str(i): nic for i, nic in enumerate(p.kv_nics)}
    shared = p.model_copy(update={"kv_nics": ("mlx5_0",) * len(p.ranks)})  # e.g. DGX-2: two GPUs per NIC
    assert sglang_ib_device(shared, node, gpus) == "mlx5_0"


def test_launch_sglang_writes_a_script_per_instance_and_the_routers(run_cli: RunCli, tmp_path: Any) -> None:
    plan = tmp_path / "pd.json"
    made = run_cli("plan", "--model", "llama-3.1-70b", "--preset", "cluster-32x-hgx-h100", "--pd-prefill", "1",
                   "--pd-decode", "2", "--kv-store", "mooncake", "--json")  # fmt: skip
    assert made.exit_code == 0, made.stderr
    plan.write_text(made.stdout)
    out = tmp_path / "scripts"
    result = run_cli("launch", "sglang", "--plan", str(plan), "--out", str(out))
    assert result.exit_code == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 6 and sum(n.startswith("plan-router-") for n in names) == 1
    # the plan's one store: its master and its store service, on the store's node
    store = json.loads(made.stdout)["stores"][0]["node"]
    assert {f"plan-store-0-master-{store}.sh", f"plan-store-0-{store}.sh"} <= set(names)
    decode = next((out / n).read_text() for n in names if n.startswith("plan-decode-"))
    assert "--disaggregation-decode-enable-offload-kvcache" in decode and f"{store}:50051" in decode
    refused = run_cli("launch", "trtllm", "--plan", str(plan), "--out", str(tmp_path / "trt"))
    assert refused.exit_code == 2 and "SGLang or vLLM only" in refused.stderr and "Traceback" not in refused.stderr


def _flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--") and not a.startswith(("--cpunodebind", "--membind"))}
