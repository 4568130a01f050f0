"""Ray placement groups: the spec, then a real two-node local Ray cluster with fake GPUs.

The cluster is two ``ray start`` processes on this machine (head on 127.0.0.1; tooling-checked.md:
``ray.cluster_utils.Cluster`` did not come up), each declaring 8 fake GPUs and the NVLink-domain
resource that ``launch ray`` tells the operator to declare. If Ray does not start, the tests fail.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.binding.builders import nvl72_doc
from toposched.binding.engines import VLLM_FLAGS
from toposched.binding.plan_doc import PlanDoc
from toposched.binding.ray import ray_document, ray_specs, ray_start_args
from toposched.solver.request import Rank
from toposched.workload import resolve_model

RAY = str(Path(sys.executable).with_name("ray"))


def test_spec_bundles_follow_rank_order_and_domains(plans: dict[str, PlanDoc]) -> None:
    (spec,) = ray_specs(plans["multi"])
    assert spec.strategy == "PACK"
    ranks = sorted(plans["multi"].placements[0].ranks, key=lambda r: r.rank)
    assert len(spec.bundles) == len(ranks) == 16
    for bundle, r in zip(spec.bundles, ranks, strict=True):
        assert bundle == {"GPU": 1.0, f"nvl_{r.node.replace('-', '_')}_nv0": 1.0}
    assert spec.env == {"VLLM_RAY_BUNDLE_INDICES": ",".join(str(i) for i in range(16))}
    assert spec.argv[:3] == ["vllm", "serve", resolve_model("llama-3.1-405b").hf_id]
    assert spec.argv[spec.argv.index("--distributed-executor-backend") + 1] == "ray"
    assert {a for a in spec.argv if a.startswith("--")} <= VLLM_FLAGS
    assert "--nnodes" not in spec.argv and "--headless" not in spec.argv and "numactl" not in spec.argv


def test_spec_single_node_is_strict_pack_and_pcie_uses_the_node(plans: dict[str, PlanDoc]) -> None:
    (spec,) = ray_specs(plans["pcie"])
    assert spec.strategy == "STRICT_PACK"
    assert spec.bundles == [{"GPU": 1.0, "host_l40s": 1.0}] * 4
    assert ray_start_args([spec], plans["pcie"]) == {"l40s": ["--num-gpus", "8", "--resources", '{"host_l40s":8}']}
    doc = ray_document(plans["two"])
    assert [g["placement"] for g in doc["placement_groups"]] == ["plan-0", "plan-1"]
    assert doc["ray_start"] == {"hgx-h100": ["--num-gpus", "8", "--resources", '{"nvl_hgx_h100_nv0":8}']}


def test_nvl72_bundles_are_pinned_to_their_tray() -> None:
    """The NVL72's one NVLink domain spans 18 trays: its resource would let Ray choose the trays (and how
    many GPUs on each), so each bundle names its tray; the tray implies the domain."""
    doc = nvl72_doc((5, 2), tp=8)
    (spec,) = ray_specs(doc)
    assert spec.strategy == "PACK"
    assert spec.bundles == [{"GPU": 1.0, "host_nvl72_tray05": 1.0}] * 4 + [{"GPU": 1.0, "host_nvl72_tray02": 1.0}] * 4
    assert spec.env == {"VLLM_RAY_BUNDLE_INDICES": "0,1,2,3,4,5,6,7"}
    assert ray_start_args([spec], doc) == {
        "nvl72-tray02": ["--num-gpus", "4", "--resources", '{"host_nvl72_tray02":4}'],
        "nvl72-tray05": ["--num-gpus", "4", "--resources", '{"host_nvl72_tray05":4}'],
    }
    assert "nvl_nvl72_clique0" not in json.dumps(ray_document(doc))
    (single,) = ray_specs(nvl72_doc((3,), tp=4))
    assert single.strategy == "STRICT_PACK" and single.bundles == [{"GPU": 1.0, "host_nvl72_tray03": 1.0}] * 4


# --- a real local Ray cluster ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray(*args: str, env: dict[str, str]) -> None:
    result = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`ray {' '.join(args)}` failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


@pytest.fixture(scope="session")
def ray_cluster(plans: dict[str, PlanDoc], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Head = the plan's second node, worker = its first, each with the flags `launch ray` prints."""
    import ray  # an ImportError here fails the tests: Ray is in the dev extra

    if not Path(RAY).exists():
        pytest.fail(f"the ray CLI is not at {RAY}; install the dev extra (pip install -e '.[dev]')")
    start = ray_document(plans["multi"])["ray_start"]
    first, second = sorted(start)
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--object-store-memory", str(100 * 1024 * 1024)]
    temp = tmp_path_factory.mktemp("ray")
    try:
        _ray(
            "start", "--head", "--port", str(port), *common, *start[second], "--include-dashboard=false",
            "--disable-usage-stats", "--temp-dir", str(temp), env=env,
        )  # fmt: skip
        _ray("start", "--address", f"127.0.0.1:{port}", *common, *start[first], env=env)
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        yield {"ray": ray, "nodes": {first: json.loads(start[first][3]), second: json.loads(start[second][3])}}
    finally:
        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120, check=False)
            shutil.rmtree(temp, ignore_errors=True)


def _node_with(ray: Any, resource: str) -> str:
    alive = [n for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    assert len(alive) == 1, f"{resource} is on {len(alive)} nodes"
    return str(alive[0]["NodeID"])


def _place(ray: Any, bundles: list[dict[str, float]], strategy: str) -> list[str]:
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    pg = placement_group(bundles, strategy=strategy)
    try:
        ready, _ = ray.wait([pg.ready()], timeout=30)
        assert ready, f"placement group {bundles[:1]}... did not become ready in 30 s"
        table = placement_group_table(pg)
        return [str(table["bundles_to_node_id"][i]) for i in range(len(bundles))]
    finally:
        remove_placement_group(pg)


def test_multi_node_group_lands_where_the_plan_says(plans: dict[str, PlanDoc], ray_cluster: dict[str, Any]) -> None:
    ray = ray_cluster["ray"]
    (spec,) = ray_specs(plans["multi"])
    nodes = _place(ray, spec.bundles, spec.strategy)
    ranks = sorted(plans["multi"].placements[0].ranks, key=lambda r: r.rank)
    for i, (bundle, r) in enumerate(zip(spec.bundles, ranks, strict=True)):
        (resource,) = (k for k in bundle if k != "GPU")
        assert resource in ray_cluster["nodes"][r.node]
        assert nodes[i] == _node_with(ray, resource), f"bundle {i} (rank on {r.node}) landed elsewhere"
    assert len(set(nodes)) == 2


def test_single_node_group_lands_on_the_planned_domain(plans: dict[str, PlanDoc], ray_cluster: dict[str, Any]) -> None:
    """A TP=4 placement on the plan's second node (the Ray head) must not land on the first."""
    ray = ray_cluster["ray"]
    doc = plans["multi"]
    base = doc.placements[0]
    second = sorted(ray_cluster["nodes"])[1]
    ranks = tuple(Rank(rank=i, node=second, gpu=4 + i, stage=0, tp_rank=i) for i in range(4))
    placement = base.model_copy(update={"id": "tp4", "ranks": ranks, "tp": 4, "pp": 1})
    (spec,) = ray_specs(PlanDoc((placement,), doc.request, doc.cluster))
    assert spec.strategy == "STRICT_PACK"
    nodes = _place(ray, spec.bundles, spec.strategy)
    (resource,) = ray_cluster["nodes"][second]
    assert set(nodes) == {_node_with(ray, resource)}
