"""vLLM launches of a prefill/decode disaggregated plan: ``--kv-transfer-config``, bootstrap ports, no router."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.binding.test_pd_launch import _flags, _pd_doc, _value
from tests.conftest import RunCli
from toposched.binding import mooncake
from toposched.binding.engines import (
    ENV_VARS,
    KV_ENV_SOURCES,
    VLLM_FLAGS,
    build_launches,
    vllm_kv_transfer_config,
)
from toposched.binding.launch_script import shell_script
from toposched.binding.node_launch import NodeLaunch
from toposched.binding.plan_doc import PlanDoc, parse_plan, plan_json
from toposched.errors import InputError
from toposched.solver.pd import Disaggregation, place_pd
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.presets import hgx_h100_cluster


def _launch(doc: PlanDoc) -> list[NodeLaunch]:
    return build_launches(doc.placements, doc.request, doc.cluster, "vllm", disaggregation=doc.disaggregation)


def _kv_config(launch: NodeLaunch) -> dict[str, Any]:
    config = json.loads(_value(launch.argv, "--kv-transfer-config"))
    assert isinstance(config, dict)
    return config


def test_each_instance_gets_the_mooncake_connector_in_its_role_over_its_ranks_nics() -> None:
    doc = _pd_doc(prefill=3, decode=4, kv_store="mooncake")
    launches = _launch(doc)
    assert len(launches) == len(doc.placements) == 7  # one per instance and node, and no router
    by_id = {p.id: p for p in doc.placements}
    for launch in launches:
        p = by_id[launch.placement]
        assert launch.role == p.role and _flags(launch.argv) <= VLLM_FLAGS, _flags(launch.argv) - VLLM_FLAGS
        config = _kv_config(launch)
        assert config["kv_connector"] == "MooncakeConnector"
        assert config["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[str(p.role)]
        extra = config["kv_connector_extra_config"]
        assert extra["mooncake_protocol"] == "rdma"
        # every NIC of the node's ranks, each once, in rank order
        node_nics = [nic for r, nic in zip(p.ranks, p.kv_nics, strict=True) if r.node == launch.node]
        assert extra["device_name"].split(",") == list(dict.fromkeys(node_nics))
        assert set(launch.env) <= ENV_VARS | set(KV_ENV_SOURCES)
        has_port = "VLLM_MOONCAKE_BOOTSTRAP_PORT" in launch.env
        assert has_port == (p.role == "prefill")
        if has_port:
            assert launch.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == str(launch.bootstrap_port)
    # a bootstrap port never shares a node with another instance's server or bootstrap port
    taken = Counter((x.node, port) for x in launches for port in (x.port, x.bootstrap_port) if port is not None)
    assert max(taken.values()) == 1


def test_two_prefill_instances_on_one_node_get_their_own_bootstrap_ports() -> None:
    cluster = hgx_h100_cluster(nodes=1)
    request = PlacementRequest(id="plan", model="llama-3.1-8b")
    made = place_pd(Scheduler(cluster), request, Disaggregation(prefill=2, decode=2))
    assert not made.outcome.unplaced, made.outcome.unplaced
    written = plan_json(
        made.outcome.placements, [], request, cluster, policy="slo", source="t", disaggregation=made.layout
    )
    doc = parse_plan(json.loads(json.dumps(written)), "pd.json")
    prefill = [x for x in _launch(doc) if x.role == "prefill"]
    assert len(prefill) == 2 and len({x.node for x in prefill}) == 1
    assert sorted(int(x.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"]) for x in prefill) == [8998, 8999]


def test_a_multi_node_prefill_instance_sets_its_bootstrap_port_on_every_node() -> None:
    cluster = hgx_h100_cluster(nodes=4)
    request = PlacementRequest(id="plan", model="llama-3.1-405b", slo_tpot_ms=60)
    made = place_pd(Scheduler(cluster), request, Disaggregation(prefill=1, decode=1))
    doc = plan_json(made.outcome.placements, [], request, cluster, policy="slo", source="t", disaggregation=made.layout)
    launches = _launch(parse_plan(doc, "pd.json"))
    prefill = [x for x in launches if x.role == "prefill"]
    assert len(prefill) == 2 and {x.nnodes for x in prefill} == {2}
    # the workers of every node register with the bootstrap server on the head (vLLM's --master-addr)
    assert {x.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] for x in prefill} == {"8998"}
    assert {_value(x.argv, "--master-addr") for x in prefill} == {prefill[0].node}
    assert [x.node_rank for x in prefill] == [0, 1] and "--headless" in prefill[1].argv
    assert {x.dist_port for x in prefill} == {29501}


def test_the_config_is_json_in_one_shell_word() -> None:
    doc = _pd_doc(prefill=1, decode=1)
    launch = _launch(doc)[0]
    script = shell_script(launch)
    command = next(line for line in script.splitlines() if line.startswith("exec "))
    words = shlex.split(command)
    assert json.loads(words[words.index("--kv-transfer-config") + 1]) == _kv_config(launch)


def test_shared_nics_are_listed_once() -> None:
    p = _pd_doc(prefill=1, decode=1).placements[0]
    node, gpus = p.ranks[0].node, [r.gpu for r in p.ranks]
    shared = p.model_copy(update={"kv_nics": tuple(f"mlx5_{i // 2}" for i in range(len(p.ranks)))})  # pairs share
    config = json.loads(vllm_kv_transfer_config(shared, node, gpus))
    assert config["kv_connector_extra_config"]["device_name"] == ",".join(dict.fromkeys(shared.kv_nics))


def test_an_instance_without_a_kv_nic_per_rank_is_refused() -> None:
    doc = _pd_doc(prefill=1, decode=1)
    bare = [p.model_copy(update={"kv_nics": ()}) if p.role == "decode" else p for p in doc.placements]
    with pytest.raises(InputError, match=r"plan-decode is a decode instance without a KV NIC for each rank"):
        build_launches(bare, doc.request, doc.cluster, "vllm", disaggregation=doc.disaggregation)


def test_launch_vllm_writes_a_script_per_instance_and_says_there_is_no_router(run_cli: RunCli, tmp_path: Any) -> None:
    plan = tmp_path / "pd.json"
    made = run_cli("plan", "--model", "llama-3.1-70b", "--preset", "cluster-32x-hgx-h100", "--pd-prefill", "1",
                   "--pd-decode", "2", "--json")  # fmt: skip
    assert made.exit_code == 0, made.stderr
    plan.write_text(made.stdout)
    out = tmp_path / "scripts"
    result = run_cli("launch", "vllm", "--plan", str(plan), "--out", str(out))
    assert result.exit_code == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 3 and not any("router" in n for n in names)
    assert "no router" in result.stderr and "vLLM 0.33.0 ships no prefill/decode proxy" in result.stderr
    assert all("--kv-transfer-config" in (out / n).read_text() for n in names)


# --- the Mooncake store through vLLM's MooncakeStoreConnector ---------------------------------------


def _launch_with_stores(doc: PlanDoc, engine: str = "vllm") -> list[NodeLaunch]:
    return build_launches(
        doc.placements, doc.request, doc.cluster, engine,  # type: ignore[arg-type]
        disaggregation=doc.disaggregation, stores=doc.stores,
    )  # fmt: skip


def test_with_a_store_each_instance_adds_the_store_connector_and_its_config_file() -> None:
    doc = _pd_doc(prefill=3, decode=4, kv_store="mooncake")
    launches = _launch_with_stores(doc)
    sglang = {(x.placement, x.node): x for x in _launch_with_stores(doc, "sglang")}
    by_id = {p.id: p for p in doc.placements}
    instances = [x for x in launches if x.role in ("prefill", "decode")]
    assert len(instances) == 7
    for launch in instances:
        p, role = by_id[launch.placement], {"prefill": "kv_producer", "decode": "kv_consumer"}[str(launch.role)]
        config = _kv_config(launch)
        assert (config["kv_connector"], config["kv_role"]) == ("MultiConnector", role)
        children = config["kv_connector_extra_config"]["connectors"]
        names = [c["kv_connector"] for c in children]
        # prefill: a prefix in the store first; decode: the prefill's KV first, then the store keeps what it made
        want = ["MooncakeStoreConnector", "MooncakeConnector"]
        assert names == (want if launch.role == "prefill" else want[::-1])
        assert {c["kv_role"] for c in children} == {role}
        (p2p,) = [c for c in children if c["kv_connector"] == "MooncakeConnector"]
        (store,) = [c for c in children if c["kv_connector"] == "MooncakeStoreConnector"]
        assert store.get("kv_connector_extra_config", {}) == ({"save_decode_cache": True} if p.role == "decode" else {})
        # the store's settings: a file of the launch, named by MOONCAKE_CONFIG_PATH
        (name,) = launch.files
        assert launch.env["MOONCAKE_CONFIG_PATH"] == name == f"{p.id}-{launch.node}.mooncake.json"
        assert set(launch.env) <= ENV_VARS | set(KV_ENV_SOURCES)
        written = json.loads(launch.files[name])
        assert set(written) <= mooncake.VLLM_STORE_CONFIG_FIELDS
        assert written["mode"] == "standalone-store" and written["global_segment_size"] == 0
        assert (written["metadata_server"], written["protocol"]) == ("P2PHANDSHAKE", "rdma")
        assert written["device_name"] == p2p["kv_connector_extra_config"]["device_name"]
        # the same store as SGLang's HiCache on that instance: the one of its rack
        hicache = json.loads(
            _value(sglang[(launch.placement, launch.node)].argv, "--hicache-storage-backend-extra-config")
        )
        assert written["master_server_address"] == hicache["master_server_address"]
    stores = [x for x in launches if x.role == "store"]
    assert [x.argv for x in stores] == [x.argv for x in sglang.values() if x.role == "store"] and stores
    assert {x.engine for x in stores} == {"vllm"}
    assert not any(x.role == "router" for x in launches)  # still no PD proxy in vLLM 0.33.0


FAKE_NUMACTL = """#!/bin/sh
while [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""
FAKE_VLLM = """#!/bin/sh
printf '%s\\n' "$MOONCAKE_CONFIG_PATH" > "$REC"
cat "$MOONCAKE_CONFIG_PATH" >> "$REC"
"""


def test_launch_vllm_writes_the_store_config_beside_each_script(run_cli: RunCli, tmp_path: Any) -> None:
    made = run_cli("plan", "--model", "llama-3.1-70b", "--preset", "cluster-32x-hgx-h100", "--pd-prefill", "1",
                   "--pd-decode", "2", "--kv-store", "mooncake", "--json")  # fmt: skip
    assert made.exit_code == 0, made.stderr
    plan = tmp_path / "pd.json"
    plan.write_text(made.stdout)
    out = tmp_path / "scripts"
    result = run_cli("launch", "vllm", "--plan", str(plan), "--out", str(out))
    assert result.exit_code == 0, result.stderr
    assert "stores were not launched" not in result.stderr
    configs = sorted(p.name for p in out.glob("*.mooncake.json"))
    scripts = sorted(p.name for p in out.glob("*.sh"))
    assert len(configs) == 3 and len(scripts) == 3 + 2  # an instance's script per node, the store's two
    (tmp_path / "bin").mkdir()
    for tool, body in (("vllm", FAKE_VLLM), ("numactl", FAKE_NUMACTL)):
        (tmp_path / "bin" / tool).write_text(body)
        (tmp_path / "bin" / tool).chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "REC": str(tmp_path / "rec")}
    for config in configs:
        script = out / config.replace(".mooncake.json", ".sh")
        checked = subprocess.run(["shellcheck", "--norc", str(script)], capture_output=True, text=True, check=False)
        assert checked.returncode == 0, checked.stdout
        # run from elsewhere: the script finds its config beside itself, whatever the working directory
        ran = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
        assert ran.returncode == 0, ran.stderr
        path, text = (tmp_path / "rec").read_text().split("\n", 1)
        assert Path(path).resolve() == (out / config).resolve()
        assert json.loads(text) == json.loads((out / config).read_text())
