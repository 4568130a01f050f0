"""Mooncake stores of a disaggregated plan: the store processes, each instance's HiCache configuration, and
the real ``mooncake_master`` and store service (mooncake-transfer-engine-non-cuda) taking what the plan emits."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from toposched.binding import mooncake
from toposched.binding.engines import SGLANG_FLAGS, build_launches
from toposched.binding.launch_script import shell_script
from toposched.binding.node_launch import NodeLaunch, PortBook
from toposched.binding.plan_doc import PlanDoc, parse_plan, plan_json
from toposched.errors import InputError
from toposched.solver.pd import Disaggregation, KvStore, place_pd
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.presets import hgx_h100_cluster


def _pd_doc(nodes_per_rack: int = 4, **spec: Any) -> PlanDoc:
    cluster = hgx_h100_cluster(nodes=8, nodes_per_rack=nodes_per_rack)
    request = PlacementRequest(id="plan", model="llama-3.1-70b", slo_ttft_ms=150, slo_tpot_ms=40)
    made = place_pd(Scheduler(cluster), request, Disaggregation(**spec))
    assert not made.outcome.unplaced, made.outcome.unplaced
    doc = plan_json(
        made.outcome.placements, [], request, cluster, policy="slo", source="test", disaggregation=made.layout,
        stores=made.stores,
    )  # fmt: skip
    return parse_plan(json.loads(json.dumps(doc)), "pd.json")


def _launch(doc: PlanDoc, engine: str = "sglang") -> list[NodeLaunch]:
    return build_launches(
        doc.placements, doc.request, doc.cluster, engine,  # type: ignore[arg-type]
        disaggregation=doc.disaggregation, stores=doc.stores,
    )  # fmt: skip


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _rack(doc: PlanDoc, node: str) -> str:
    return doc.cluster.node(node).rack or node


def test_every_instance_uses_the_store_of_its_rack_over_its_kv_nics() -> None:
    doc = _pd_doc(nodes_per_rack=1, prefill=3, decode=3, kv_store="mooncake")
    assert len({s.rack for s in doc.stores}) > 1  # several racks, so choosing the rack's store is tested
    launches = _launch(doc)
    masters = {(x.node, x.port) for x in launches if x.role == "store" and x.argv[0] == "mooncake_master"}
    store_rack = {_rack(doc, s.node) for s in doc.stores}
    by_id = {p.id: p for p in doc.placements}
    for launch in (x for x in launches if x.role in ("prefill", "decode")):
        p, argv = by_id[launch.placement], launch.argv
        assert {a for a in argv if a.startswith("--") and "=" not in a} <= SGLANG_FLAGS
        assert _value(argv, "--hicache-storage-backend") == "mooncake"
        assert ("--enable-hierarchical-cache" in argv) == (p.role == "prefill")
        assert ("--disaggregation-decode-enable-offload-kvcache" in argv) == (p.role == "decode")
        config = json.loads(_value(argv, "--hicache-storage-backend-extra-config"))
        host, port = config["master_server_address"].rsplit(":", 1)
        assert (host, int(port)) in masters
        if p.role == "decode" or _rack(doc, launch.node) in store_rack:
            assert _rack(doc, host) == _rack(doc, launch.node)
        assert config["metadata_server"] == "P2PHANDSHAKE" and config["protocol"] == "rdma"
        assert config["local_hostname"] == launch.node and config["global_segment_size"] == 0
        device = config["device_name"]
        by_tp = {r.tp_rank: nic for r, nic in zip(p.ranks, p.kv_nics, strict=True) if r.node == launch.node}
        got = {int(k): v for k, v in json.loads(device).items()} if device.startswith("{") else None
        assert got == by_tp or (got is None and set(by_tp.values()) == {device})


def test_each_store_runs_its_master_and_store_service_on_its_node() -> None:
    doc = _pd_doc(nodes_per_rack=1, prefill=2, decode=3, kv_store="mooncake")
    launches = _launch(doc)
    stores = [x for x in launches if x.role == "store"]
    assert len(stores) == 2 * len(doc.stores) and launches[: -len(stores)][-1].role == "router"
    for i, store in enumerate(doc.stores):
        master, service = stores[2 * i], stores[2 * i + 1]
        assert (master.placement, service.placement) == (f"plan-store-{i}-master", f"plan-store-{i}")
        assert master.node == service.node == store.node and master.gpus == service.gpus == []
        flags = {a.split("=", 1)[0] for a in master.argv[1:]}
        assert flags == set(mooncake.MASTER_FLAG_SOURCES)
        assert f"--rpc_port={master.port}" in master.argv and "--enable_http_metadata_server=false" in master.argv
        assert service.argv == [*mooncake.STORE_SERVICE_COMMAND, "--port", str(service.port)]
        env = service.env
        assert set(env) == set(mooncake.STORE_ENV_SOURCES)
        assert env["MOONCAKE_MASTER"] == f"{store.node}:{master.port}"
        assert env["MOONCAKE_DEVICE"].split(",") == list(store.nics)
        assert env["MOONCAKE_LOCAL_HOSTNAME"] == store.node and int(env["MOONCAKE_GLOBAL_SEGMENT_SIZE"]) == 64 << 30
        assert "export MOONCAKE_MASTER=" in shell_script(service)  # the script takes the store's variables
    # every port is bound once per node, stores and instances together
    taken = Counter((x.node, port) for x in launches for port in (x.port, x.bootstrap_port) if port is not None)
    metrics = Counter((x.node, int(a.split("=")[1])) for x in stores for a in x.argv if a.startswith("--metrics_port="))
    assert max((taken + metrics).values()) == 1


def test_a_prefill_without_a_store_in_its_rack_uses_the_store_of_its_decode() -> None:
    doc = _pd_doc(nodes_per_rack=1, prefill=2, decode=2, kv_store="mooncake")
    cluster = doc.cluster
    prefill = next(p for p in doc.placements if p.role == "prefill")
    decode_id = next(d for d, f in doc.disaggregation.pairs.items() if f == prefill.id)  # type: ignore[union-attr]
    elsewhere = [n.name for n in cluster.nodes if n.rack != cluster.node(prefill.ranks[0].node).rack]
    decode = next(p for p in doc.placements if p.id == decode_id)
    decode = decode.model_copy(
        update={"ranks": tuple(r.model_copy(update={"node": elsewhere[0]}) for r in decode.ranks)}
    )
    ports = PortBook()
    far = KvStore(node=elsewhere[-1], rack=cluster.node(elsewhere[-1]).rack, nics=("mlx5_0",))
    near = KvStore(node=elsewhere[0], rack=cluster.node(elsewhere[0]).rack, nics=("mlx5_0",))
    endpoints = mooncake.book_stores([far, near], ports)
    chosen = mooncake.store_for(prefill, endpoints, cluster, {decode.id: decode}, {decode.id: prefill.id})
    assert chosen.store == near
    assert mooncake.store_for(prefill, endpoints, cluster, {}, {}).store == far  # no pair: the plan's first
    with pytest.raises(InputError, match="has no KV-cache store"):
        mooncake.store_for(prefill, [], cluster, {}, {})


def test_vllm_runs_the_same_stores_and_stores_need_disaggregation() -> None:
    doc = _pd_doc(prefill=1, decode=1, kv_store="mooncake")
    vllm, sglang = _launch(doc, "vllm"), _launch(doc)
    stores = [(x.placement, x.node, x.argv, x.env) for x in vllm if x.role == "store"]
    assert stores and stores == [(x.placement, x.node, x.argv, x.env) for x in sglang if x.role == "store"]
    assert not any("hicache" in " ".join(x.argv) for x in vllm)  # vLLM reads its store from a file instead
    with pytest.raises(InputError, match="stores were given for a plan without prefill/decode disaggregation"):
        plain = [p.model_copy(update={"role": None, "kv_nics": (), "host_numa": ()}) for p in doc.placements]
        build_launches(plain, doc.request, doc.cluster, "sglang", stores=doc.stores)


# ----------------------------------------------------------------------------------- the real Mooncake


def _master_binary() -> str | None:
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_listening(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}: {proc.stdout.read().decode()[-2000:]}")  # type: ignore[union-attr]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"{what} does not listen on {port} after {timeout} s")


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("master_"))}


@pytest.fixture()
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in reversed(started):  # the store service unmounts its segment from the master before it goes
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# A client as SGLang's MooncakeStore sets itself up from --hicache-storage-backend-extra-config
# (mooncake_store.py: store.setup(local_hostname, metadata_server, per-rank global_segment_size,
# local buffer, protocol, device_name, master_server_address, transfer engine)).
_CLIENT = """
import json, sys
from mooncake.store import MooncakeDistributedStore
config = json.loads(sys.argv[1])
def client():
    store = MooncakeDistributedStore()
    rc = store.setup(config["local_hostname"], config["metadata_server"], config["global_segment_size"], 16 << 20,
                     config["protocol"], config["device_name"], config["master_server_address"], None)
    assert rc == 0, rc
    return store
prefill, decode = client(), client()
assert prefill.put("toposched-kv", b"kv" * 2048) == 0
print(json.dumps({"got": len(decode.get("toposched-kv"))}))
prefill.close(); decode.close()
"""
# A client as vLLM 0.33.0's MooncakeStoreConnector sets itself up from the file MOONCAKE_CONFIG_PATH names
# (vllm/distributed/mooncake_store.py: MooncakeStoreConfig.from_file, then setup_mooncake_store:
# store.setup(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol, device_name,
# master_server_address)); local_hostname is vLLM's get_ip(), here the loopback. The file leaves
# local_buffer_size to vLLM's default (4 GiB); the client takes 16 MiB, as above.
_VLLM_CLIENT = """
import json, os, sys
from mooncake.store import MooncakeDistributedStore
with open(os.environ["MOONCAKE_CONFIG_PATH"]) as f:
    config = json.load(f)
assert config["mode"] == "standalone-store" and config["global_segment_size"] == 0
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", config["metadata_server"], config["global_segment_size"], 16 << 20,
                 config["protocol"], config["device_name"], config["master_server_address"])
assert rc == 0, rc
got = len(store.get("toposched-kv"))  # what the SGLang-configured instance wrote
assert store.put("toposched-vllm-kv", b"v" * 1024) == 0
print(json.dumps({"got": got, "mine": len(store.get("toposched-vllm-kv"))}))
store.close()
"""


def test_the_real_mooncake_master_and_store_service_take_the_emitted_configuration(
    processes: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    binary = _master_binary()
    if binary is None:
        pytest.skip(
            "mooncake_master is not installed: pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
            "(and apt-get install libibverbs1)"
        )
    # The plan's store, on a node this machine can reach under its name, and TCP: there is no RDMA here.
    settings = mooncake.MooncakeSettings(protocol="tcp", segment_gib=1)
    store = KvStore(node="127.0.0.1", rack=None, nics=("mlx5_0",))
    (endpoint,) = mooncake.book_stores([store], PortBook())
    rpc, metrics, http = _free_ports(3)
    endpoint = replace(endpoint, rpc_port=rpc, metrics_port=metrics, http_port=http)
    master, service = mooncake.store_launches("plan", [endpoint], settings)
    out = subprocess.PIPE
    processes.append(subprocess.Popen([binary, *master.argv[1:]], stdout=out, stderr=subprocess.STDOUT))
    _wait_listening(rpc, processes[0], "mooncake_master")
    _wait_listening(metrics, processes[0], "mooncake_master's metrics server")
    assert _metrics(metrics)["master_total_capacity_bytes"] == 0
    env = {**os.environ, **service.env}
    argv = [sys.executable, *service.argv[1:]]
    processes.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
    _wait_listening(http, processes[1], "mooncake store service")
    # the store service mounted the segment the plan gives it; then an instance writes and another reads
    assert _metrics(metrics)["master_total_capacity_bytes"] == 1 << 30
    doc = _pd_doc(prefill=1, decode=1, kv_store="mooncake")
    p = next(x for x in doc.placements if x.role == "decode")
    extra = mooncake.instance_extra_config(p, "127.0.0.1", endpoint, settings)
    client = subprocess.run([sys.executable, "-c", _CLIENT, extra], capture_output=True, text=True, timeout=60)
    assert client.returncode == 0, client.stderr[-2000:]
    assert json.loads(client.stdout.strip().splitlines()[-1]) == {"got": 4096}
    assert _metrics(metrics)["master_allocated_bytes"] == 4096  # the bytes sit in the store's segment
    # a vLLM instance reaches the same store through the JSON file its launch writes
    config = tmp_path / "plan-decode.mooncake.json"
    config.write_text(mooncake.vllm_store_config("", endpoint, settings))
    env = {**os.environ, "MOONCAKE_CONFIG_PATH": str(config)}
    client = subprocess.run([sys.executable, "-c", _VLLM_CLIENT], env=env, capture_output=True, text=True, timeout=60)
    assert client.returncode == 0, client.stderr[-2000:]
    assert json.loads(client.stdout.strip().splitlines()[-1]) == {"got": 4096, "mine": 1024}
    assert _metrics(metrics)["master_allocated_bytes"] == 4096 + 1024
    assert processes[0].poll() is None and processes[1].poll() is None
