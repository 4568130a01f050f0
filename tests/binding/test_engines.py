"""vLLM / SGLang launch plans: only real flags and variables, NUMA-aligned GPUs, safe quoting."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests.binding.builders import make_doc, make_placement, nvl72_doc
from tests.conftest import REFERENCE, RunCli
from toposched.binding.engine_args import FLAG_SOURCES
from toposched.binding.engines import (
    ENV_VARS,
    SGLANG_FLAGS,
    VLLM_FLAGS,
    build_launches,
)
from toposched.binding.launch_script import shell_script
from toposched.binding.node_launch import NodeLaunch
from toposched.binding.plan_doc import load_plan, parse_plan
from toposched.errors import InputError
from toposched.solver.request import Placement, PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.model import Cluster, Fabric, socket_ifname_problem
from toposched.topology.presets import hgx_h100_cluster, load_preset
from toposched.workload import resolve_model

ENGINES_MD = (REFERENCE / "engines.md").read_text()


def _plan(preset: str, model: str, **kw: Any) -> tuple[Scheduler, PlacementRequest, list[Placement]]:
    cluster = hgx_h100_cluster(nodes=2) if preset == "two-nodes" else load_preset(preset)
    s = Scheduler(cluster)
    request = PlacementRequest(model=model, max_model_len=8192, **kw)
    out = s.place(request)
    assert not out.unplaced, out.unplaced
    return s, request, out.placements


def _flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--") and not a.startswith(("--cpunodebind", "--membind"))}


def test_every_emitted_flag_and_variable_is_in_the_reference() -> None:
    # Each allowed flag is written in reference/engines.md, or cites the file of the engine's wheel
    # that defines it (make check-engines runs the engines' own parsers on every argv) ...
    for engine, prefix in (("vllm", "vllm/"), ("sglang", "sglang/srt/")):
        for flag, source in FLAG_SOURCES[engine].items():  # type: ignore[index]
            documented = re.search(re.escape(flag) + r"\b", ENGINES_MD) and source.startswith("engines.md")
            assert documented or source.startswith(prefix), (engine, flag, source)
    assert set(FLAG_SOURCES["vllm"]) == VLLM_FLAGS and set(FLAG_SOURCES["sglang"]) == SGLANG_FLAGS
    for var in ENV_VARS:
        assert var in ENGINES_MD or var == "CUDA_DEVICE_ORDER", var
    # ... and every launch, across engines and shapes, uses only them.
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("hgx-h100", "llama-3.1-70b", {"slo_tpot_ms": 40, "replicas": 2}),
        ("l40s-8x-pcie", "llama-3.1-70b", {"weight_dtype": "fp8", "allowed_tp": (8,), "max_pp": 1}),
        ("two-nodes", "llama-3.1-405b", {"slo_tpot_ms": 60}),
        ("hgx-h200", "mixtral-8x7b", {"ep": 2, "allowed_tp": (2,)}),
    ]
    for preset, model, kw in cases:
        s, request, placements = _plan(preset, model, **kw)
        for engine, allowed in (("vllm", VLLM_FLAGS), ("sglang", SGLANG_FLAGS)):
            for launch in build_launches(placements, request, s.cluster, engine):  # type: ignore[arg-type]
                assert _flags(launch.argv) <= allowed, (engine, _flags(launch.argv) - allowed)
                assert set(launch.env) <= ENV_VARS
    for fictional in ("TP_RANK_MAP", "CUDA_DEVICE_TOPOLOGY", "SYS_GUID", "hicache-dump-topology", "enable-ep-moe"):
        assert all(fictional not in json.dumps(x) for x in (sorted(VLLM_FLAGS), sorted(SGLANG_FLAGS), sorted(ENV_VARS)))


def test_pcie_box_tp4_binds_to_the_numa_node_of_its_gpus() -> None:
    s, request, (p,) = _plan("l40s-8x-pcie", "llama-3.1-70b", weight_dtype="fp8", allowed_tp=(4,), max_pp=1)
    (launch,) = build_launches([p], request, s.cluster, "vllm")
    numa = {s.index.info[r].numa for r in p.gpu_refs}
    assert len(numa) == 1
    (n,) = numa
    assert launch.argv[:3] == ["numactl", f"--cpunodebind={n}", f"--membind={n}"]
    assert launch.env["CUDA_VISIBLE_DEVICES"] == ",".join(str(r.gpu) for r in p.ranks)
    assert launch.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "--quantization" in launch.argv and "--numa-bind" not in launch.argv


def test_two_replicas_on_an_nvswitch_node_are_disjoint_and_numa_aligned() -> None:
    s, request, placements = _plan("hgx-h100", "llama-3.1-70b", slo_tpot_ms=40, replicas=2)
    launches = build_launches(placements, request, s.cluster, "vllm")
    sets = [set(x.env["CUDA_VISIBLE_DEVICES"].split(",")) for x in launches]
    assert len(sets) == 2 and sets[0].isdisjoint(sets[1])
    assert sets[0] | sets[1] == {str(i) for i in range(8)}
    for launch in launches:
        assert len(set(launch.numa_nodes)) == 1 and launch.argv[0] == "numactl"
    assert {launch.port for launch in launches} == {8000, 8001}


def test_spanning_numa_nodes_binds_each_vllm_worker() -> None:
    s, request, (p,) = _plan("l40s-8x-pcie", "llama-3.1-70b", weight_dtype="fp8", allowed_tp=(8,), max_pp=1)
    (launch,) = build_launches([p], request, s.cluster, "vllm")
    i = launch.argv.index("--numa-bind-nodes")
    assert launch.argv[i + 1 : i + 9] == ["0", "0", "0", "0", "1", "1", "1", "1"]
    assert launch.argv[0] == "vllm"


def test_multi_node_pp_across_two_nodes() -> None:
    s, request, (p,) = _plan("two-nodes", "llama-3.1-405b", slo_tpot_ms=60)
    head, worker = build_launches([p], request, s.cluster, "vllm")
    assert (head.node, worker.node) == ("h100-00", "h100-01")
    for launch, rank in ((head, "0"), (worker, "1")):
        argv = launch.argv
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == rank
        assert argv[argv.index("--master-addr") + 1] == "h100-00"
        assert launch.env["NCCL_IB_HCA"] == "=" + ",".join(f"mlx5_{i}" for i in range(8))
        assert launch.env["NCCL_CROSS_NIC"] == "0"
    assert "--headless" not in head.argv and "--headless" in worker.argv
    _, sg_worker = build_launches([p], request, s.cluster, "sglang")
    assert sg_worker.argv[sg_worker.argv.index("--dist-init-addr") + 1] == "h100-00:20000"


# --- TP across the trays of a multi-node NVLink domain (GB200 NVL72; issue 12, defect 5) -------------


def test_vllm_tp8_over_two_nvl72_trays_is_one_multi_node_engine() -> None:
    doc = nvl72_doc((0, 1), tp=8)
    head, worker = build_launches(doc.placements, doc.request, doc.cluster, "vllm")
    assert (head.node, worker.node) == ("nvl72-tray00", "nvl72-tray01")
    for launch, rank in ((head, 0), (worker, 1)):
        argv = launch.argv
        assert argv[:3] == ["vllm", "serve", resolve_model("llama-3.1-405b").hf_id]  # the catalog name's id
        assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
        assert argv[argv.index("--pipeline-parallel-size") + 1] == "1"
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--master-addr") + 1] == "nvl72-tray00"
        assert argv[argv.index("--master-port") + 1] == "29501"
        assert ("--headless" in argv) == (rank == 1)
        # four local workers, one per GPU of the tray, each bound to its GPU's NUMA node
        assert launch.gpus == [0, 1, 2, 3] and launch.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
        i = argv.index("--numa-bind-nodes")
        assert argv[i + 1 : i + 5] == ["0", "0", "1", "1"]
        assert _flags(argv) <= VLLM_FLAGS and set(launch.env) <= ENV_VARS


def test_sglang_tp8_over_two_nvl72_trays() -> None:
    doc = nvl72_doc((0, 1), tp=8)
    launches = build_launches(doc.placements, doc.request, doc.cluster, "sglang")
    assert [x.node for x in launches] == ["nvl72-tray00", "nvl72-tray01"]
    for rank, launch in enumerate(launches):
        argv = launch.argv
        assert argv[argv.index("--tp-size") + 1] == "8" and argv[argv.index("--pp-size") + 1] == "1"
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--dist-init-addr") + 1] == "nvl72-tray00:20000"
        assert launch.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
        assert _flags(argv) <= SGLANG_FLAGS and set(launch.env) <= ENV_VARS


def test_nodes_follow_rank_order_not_tray_order() -> None:
    # TP16 over four trays taken out of order, and TP8 x PP2 (each stage over two trays).
    for trays, tp, pp in (((5, 2, 9, 7), 16, 1), ((3, 1, 4, 0), 8, 2)):
        doc = nvl72_doc(trays, tp=tp, pp=pp)
        launches = build_launches(doc.placements, doc.request, doc.cluster, "vllm")
        assert [x.node for x in launches] == [f"nvl72-tray{t:02d}" for t in trays]
        assert [x.node_rank for x in launches] == [0, 1, 2, 3] and {x.nnodes for x in launches} == {4}
        assert {x.argv[x.argv.index("--master-addr") + 1] for x in launches} == {f"nvl72-tray{trays[0]:02d}"}
        assert [("--headless" in x.argv) for x in launches] == [False, True, True, True]


def test_launch_refuses_layouts_the_engines_cannot_start() -> None:
    cluster = load_preset("gb200-nvl72")
    t0, t1 = cluster.nodes[0].name, cluster.nodes[1].name
    uneven = make_placement([(t0, (0, 1, 2, 3)), (t1, (0, 1))], tp=2, pp=3)
    with pytest.raises(InputError, match="nvl72-tray00 has 4, nvl72-tray01 has 2 GPUs; multi-node engines need"):
        build_launches([uneven], make_doc(cluster).request, cluster, "vllm")
    split = make_placement([(t0, (0, 1)), (t1, (0, 1)), (t0, (2, 3)), (t1, (2, 3))], tp=8)
    with pytest.raises(InputError, match="not contiguous"):
        build_launches([split], make_doc(cluster).request, cluster, "sglang")
    hgx = hgx_h100_cluster(nodes=2)
    half_stages = make_placement([("h100-00", range(6)), ("h100-01", range(6))], tp=4, pp=3)
    with pytest.raises(InputError, match="6 GPUs per node with tp=4: a node must hold whole pipeline stages"):
        build_launches([half_stages], make_doc(hgx).request, hgx, "vllm")


def test_single_node_launch_sets_no_network_nccl_variables() -> None:
    s, request, (p,) = _plan("hgx-h100", "llama-3.1-70b", slo_tpot_ms=40)
    (launch,) = build_launches([p], request, s.cluster, "vllm")
    assert set(launch.env) == {"CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES"}


def test_sglang_refuses_a_kv_dtype_it_does_not_have() -> None:
    s, request, (p,) = _plan("hgx-h100", "llama-3.1-70b", slo_tpot_ms=40)
    int8 = p.model_copy(update={"kv_dtype": "int8"})
    with pytest.raises(InputError, match=r"SGLang 0\.5\.23 does not offer"):
        build_launches([int8], request, s.cluster, "sglang")
    (launch,) = build_launches([int8], request, s.cluster, "vllm")
    assert launch.argv[launch.argv.index("--kv-cache-dtype") + 1] == "int8_per_token_head"


def test_shell_script_quotes_everything(tmp_path: Path) -> None:
    s, request, (p,) = _plan("hgx-h100", "llama-3.1-8b")
    evil = "/models/my model $(touch " + str(tmp_path / "pwned") + ")"
    (launch,) = build_launches([p], request, s.cluster, "vllm", model_path=evil)
    script = shell_script(launch)
    # run the script with `exec` replaced by printing its arguments: nothing may execute
    probe = script.replace("exec ", "printf '%s\\n' ")
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.splitlines()
    assert evil in out
    assert not (tmp_path / "pwned").exists()
    assert shlex.split(script.splitlines()[-1])[1:] == launch.argv


def test_plan_document_round_trip(run_cli: RunCli, tmp_path: Path) -> None:
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--slo-tpot-ms", "40", "--json")
    path = tmp_path / "plan.json"
    path.write_text(result.stdout)
    doc = load_plan(path)
    assert doc.placements[0].tp == 4 and doc.request.model == "llama-3.1-70b"
    with pytest.raises(InputError, match="not a plan"):
        parse_plan({"x": 1}, "p.json")
    data = json.loads(result.stdout)
    data["placements"][0]["ranks"][0]["gpu"] = 42
    with pytest.raises(InputError, match="GPU hgx-h100/42, not in the plan's cluster"):
        parse_plan(data, "p.json")


def test_launch_cli_contract(run_cli: RunCli, tmp_path: Path) -> None:
    plan = run_cli(
        "plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--slo-tpot-ms", "40", "--replicas", "2", "--json"
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.stdout)
    for engine in ("vllm", "sglang"):
        result = run_cli("launch", engine, "--plan", str(path), "--json")
        assert result.exit_code == 0, result.stderr
        launches = json.loads(result.stdout)["launches"]
        assert [x["placement"] for x in launches] == ["plan-0", "plan-1"]
        for x in launches:
            assert {"placement", "node", "env", "argv"} <= set(x)
            assert "CUDA_VISIBLE_DEVICES" in x["env"] and x["argv"][0] == "numactl"
    result = run_cli("launch", "vllm", "--plan", str(path), "--out", str(tmp_path / "scripts"))
    assert sorted(p.name for p in (tmp_path / "scripts").iterdir()) == ["plan-0-hgx-h100.sh", "plan-1-hgx-h100.sh"]
    result = run_cli("launch", "vllm", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--json")
    assert json.loads(result.stdout)["launches"][0]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    bad = run_cli("launch", "vllm", "--plan", str(tmp_path / "missing.json"))
    assert bad.exit_code == 2 and "plan" in bad.stderr and "does not exist" in bad.stderr
    both = run_cli("launch", "vllm", "--plan", str(path), "--model", "x", "--preset", "dgx2")
    assert both.exit_code == 2 and "not both" in both.stderr


def test_shell_script_writes_only_checked_names() -> None:
    s, request, (p,) = _plan("hgx-h100", "llama-3.1-8b")
    (launch,) = build_launches([p], request, s.cluster, "vllm")
    with pytest.raises(ValidationError, match="not a hostname"):
        NodeLaunch.model_validate({**launch.model_dump(), "node": "x\ntouch pwned"})
    # a launch built without validation still cannot put a line into the script
    forged = NodeLaunch.model_construct(**{**launch.model_dump(), "placement": "p\ntouch pwned #"})
    with pytest.raises(InputError, match="placement id"):
        shell_script(forged)
    forged = NodeLaunch.model_construct(**{**launch.model_dump(), "env": {"X=1; touch pwned; Y": "1"}})
    with pytest.raises(InputError, match="environment variable"):
        shell_script(forged)
    comment = shell_script(launch).splitlines()[1]
    assert comment == f"# toposched launch: placement {p.id}, node hgx-h100 (rank 0 of 1), engine vllm"


def test_placement_ids_of_a_long_request_id_are_accepted(run_cli: RunCli, tmp_path: Path) -> None:
    """A 120-character request id is valid; its instance ids ``ID-0``, ``ID-1`` are longer and valid too."""
    plan = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--tp", "4", "--replicas", "2", "--json")
    data = json.loads(plan.stdout)
    rid = "r" * 120
    data["request"]["id"] = rid
    for n, p in enumerate(data["placements"]):
        p["id"], p["request_id"] = f"{rid}-{n}", rid
    doc = parse_plan(data, "p.json")
    assert [p.id for p in doc.placements] == [f"{rid}-0", f"{rid}-1"]
    data["placements"][1]["id"] = f"{rid}-2"  # not an instance of a 2-replica request
    with pytest.raises(InputError, match=r"p.json: placements.1.id: .* is not an instance of request"):
        parse_plan(data, "p.json")
    data["placements"][1]["id"] = f"{rid}-0"
    data["request"]["replicas"] = 3
    with pytest.raises(InputError, match=r"placements.1.id: placement .* appears twice"):
        parse_plan(data, "p.json")


def test_a_nic_without_a_device_name_sets_no_short_hca_list() -> None:
    """A cut NIC legend leaves NICs without names: NCCL_IB_HCA must not list only the named half."""
    s, request, (p,) = _plan("two-nodes", "llama-3.1-405b", slo_tpot_ms=60)
    nodes = tuple(
        n.model_copy(update={"nics": tuple(nic.model_copy(update={"device": None}) if i >= 4 else nic
                                            for i, nic in enumerate(n.nics))})
        for n in s.cluster.nodes
    )  # fmt: skip
    cut = s.cluster.model_copy(update={"nodes": nodes})
    for launch in build_launches([p], request, cut, "vllm"):
        assert "NCCL_IB_HCA" not in launch.env  # NCCL then uses every HCA
        assert launch.env["NCCL_CROSS_NIC"] == "0"
    for launch in build_launches([p], request, s.cluster, "vllm"):  # the full legend still lists all 8
        assert launch.env["NCCL_IB_HCA"] == "=" + ",".join(f"mlx5_{i}" for i in range(8))


# --- issue 14: ports, NCCL, scripts -------------------------------------------------------------------


def _two_on_two_trays() -> tuple[Any, list[Placement], PlacementRequest]:
    """Two TP=4 instances whose heads share tray 0 (GPUs 0-1 and 2-3 of trays 0 and 1), one on tray 2."""
    cluster = load_preset("gb200-nvl72")
    t0, t1, t2 = (n.name for n in cluster.nodes[:3])
    a = make_placement([(t0, (0, 1)), (t1, (0, 1))], tp=4, id="plan-0")
    b = make_placement([(t0, (2, 3)), (t1, (2, 3))], tp=4, id="plan-1")
    c = make_placement([(t2, (0, 1, 2, 3))], tp=4, id="plan-2")
    return cluster, [a, b, c], PlacementRequest(id="plan", model="llama-3.1-405b", replicas=3)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_ports_are_unique_on_every_node_across_the_plan(engine: str) -> None:
    cluster, placements, request = _two_on_two_trays()
    launches = build_launches(placements, request, cluster, engine)  # type: ignore[arg-type]
    by_node: dict[str, list[int]] = {}
    for x in launches:
        by_node.setdefault(x.node, []).extend(p for p in (x.port, x.dist_port) if p is not None)
    # each instance's ports are booked on all of its nodes (host-network pods share the node's ports)
    for node, ports in by_node.items():
        assert len(ports) == len(set(ports)), (node, sorted(ports))
    flag = "--master-port" if engine == "vllm" else "--dist-init-addr"
    heads = [x for x in launches if x.node_rank == 0 and x.nnodes == 2]
    rendezvous = [x.argv[x.argv.index(flag) + 1].rsplit(":", 1)[-1] for x in heads]
    first = "29501" if engine == "vllm" else "20000"
    assert rendezvous[0] == first and len(set(rendezvous)) == 2  # the second instance does not reuse it
    assert [x.port for x in heads] == [8000, 8001]
    # every node of an instance is told the same ports
    for pid in ("plan-0", "plan-1"):
        mine = [x for x in launches if x.placement == pid]
        assert len({(x.port, x.dist_port) for x in mine}) == 1
        assert {x.argv[x.argv.index("--port") + 1] for x in mine} == {str(mine[0].port)}
    # a node no other instance uses starts again from --port
    (lone,) = [x for x in launches if x.placement == "plan-2"]
    assert lone.port == 8000 and lone.dist_port is None and flag not in lone.argv


def test_server_port_never_doubles_as_the_rendezvous_port() -> None:
    cluster, placements, request = _two_on_two_trays()
    head = build_launches(placements[:1], request, cluster, "vllm", base_port=29501)[0]
    assert head.port == 29501 and head.argv[head.argv.index("--master-port") + 1] == "29502"
    with pytest.raises(InputError, match="no free server port from 65535"):
        build_launches(placements, request, cluster, "vllm", base_port=65535)
    with pytest.raises(InputError, match="--port 0 is not a port"):
        build_launches(placements, request, cluster, "vllm", base_port=0)


@pytest.mark.parametrize("ifname", ["eth0", "=eth0", "^docker,lo", "^=docker0", "eth", "enp1s0f0,ib", "bond0.100"])
def test_socket_ifname_reaches_nccl_as_written(ifname: str) -> None:
    s, request, (p,) = _plan("two-nodes", "llama-3.1-405b", slo_tpot_ms=60)
    fabric = s.cluster.fabric or Fabric()
    cluster = s.cluster.model_copy(update={"fabric": fabric.model_copy(update={"socket_ifname": ifname})})
    cluster = Cluster.model_validate(cluster.model_dump())  # through the model's rule
    for launch in build_launches([p], request, cluster, "sglang"):
        assert launch.env["NCCL_SOCKET_IFNAME"] == ifname  # no '=' added: '^' keeps meaning "exclude"


@pytest.mark.parametrize("bad", ["", "=^eth0", "eth0,", "a b", "eth0:1", "a" * 16, "^", "-eth0", "eth0\n", "$(x)"])
def test_socket_ifname_outside_nccl_syntax_is_refused(bad: str) -> None:
    with pytest.raises(ValidationError, match="not an NCCL_SOCKET_IFNAME list"):
        Fabric(socket_ifname=bad)
    assert socket_ifname_problem(bad) is not None and socket_ifname_problem("^docker,lo") is None


def test_gdr_level_is_left_to_nccl() -> None:
    """PXB is NCCL's default on PCIe hosts and disables GPUDirect RDMA over Grace's C2C (GB200)."""
    s, request, placements = _plan("two-nodes", "llama-3.1-405b", slo_tpot_ms=60)
    launches = build_launches(placements, request, s.cluster, "vllm")
    doc = nvl72_doc((0, 1), tp=8)
    launches += build_launches(doc.placements, doc.request, doc.cluster, "vllm")
    assert any("NCCL_IB_HCA" in x.env for x in launches)  # multi-node launches with NICs, PXB-near on HGX
    assert all("NCCL_NET_GDR_LEVEL" not in x.env for x in launches)
    assert "NCCL_NET_GDR_LEVEL" not in ENV_VARS


def test_every_environment_value_is_single_quoted() -> None:
    """``export NCCL_IB_HCA==mlx5_0`` runs, but shellcheck reads ``==`` as a typo (SC1097): quote every value."""
    s, request, (p,) = _plan("two-nodes", "llama-3.1-405b", slo_tpot_ms=60)
    launch = build_launches([p], request, s.cluster, "vllm")[0]
    script = shell_script(launch)
    exports = [line for line in script.splitlines() if line.startswith("export ")]
    assert exports and all(re.fullmatch(r"export [A-Z_]+='[^']*'", line) for line in exports), exports
    assert "export NCCL_IB_HCA='=mlx5_0," in script
    # and the shell still sees the values the launch holds
    probe = script.replace("exec ", "env; printf '%s\\n' ")
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout
    for key, value in launch.env.items():
        assert f"{key}={value}\n" in out
    checker = shutil.which("shellcheck")
    if checker:
        done = subprocess.run([checker, "-"], input=script, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout


def test_several_scripts_need_out(run_cli: RunCli, tmp_path: Path) -> None:
    """Scripts end in ``exec``: printed one after another, ``| sh`` would start only the first."""
    plan = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--tp", "4", "--replicas", "2", "--json")
    path = tmp_path / "plan.json"
    path.write_text(plan.stdout)
    for engine in ("vllm", "sglang"):
        result = run_cli("launch", engine, "--plan", str(path))
        assert result.exit_code == 2 and result.stdout == ""
        lines = result.stderr.splitlines()
        assert lines[0] == (
            "error: the plan needs 2 scripts (2 instance(s) on 2 node launches); printed one after the other "
            "only the first would run"
        )
        assert lines[1:] == ["  fix: pass --out DIR (one script per node and instance) or --format json"]
    one = run_cli("launch", "vllm", "--preset", "hgx-h100", "--model", "llama-3.1-8b")
    assert one.exit_code == 0, one.stderr
    assert one.stdout.startswith("#!/usr/bin/env bash\n") and one.stdout.count("\nexec ") == 1
    subprocess.run(["bash", "-n"], input=one.stdout, text=True, check=True)
