"""`toposched plan` end to end: the JSON contract, human output and clean failures."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES, RunCli
from toposched.binding.plan_doc import parse_plan, plan_json
from toposched.solver.request import Placement


def test_plan_json_contract(run_cli: RunCli) -> None:
    result = run_cli(
        "plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--slo-tpot-ms", "40", "--replicas", "2", "--json"
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["unplaced"] == []
    assert [p["id"] for p in data["placements"]] == ["plan-0", "plan-1"]
    for p in data["placements"]:
        assert (p["tp"], p["pp"]) == (4, 1)
        assert [r["rank"] for r in p["ranks"]] == [0, 1, 2, 3]
        assert set(p["ranks"][0]) >= {"rank", "node", "gpu"}
        assert p["predicted"]["tpot_ms"] <= 40 and p["predicted"]["ttft_ms"] > 0
    used = [(r["node"], r["gpu"]) for p in data["placements"] for r in p["ranks"]]
    assert len(set(used)) == 8


def test_plan_on_a_capture_with_busy_gpus(run_cli: RunCli) -> None:
    smi = str(FIXTURES / "topo/07_dgx1-v100-1nic-driver440.txt")
    result = run_cli("plan", "--smi", smi, "--gpu", "A100-SXM-40GB", "--model", "llama-3.1-8b", "--tp", "4",
                     "--busy", "0", "--json")  # fmt: skip
    data = json.loads(result.stdout)
    (p,) = data["placements"]
    # GPU 0 is busy, so the only all-pairs-NVLink quad left is 4-7
    assert sorted(r["gpu"] for r in p["ranks"]) == [4, 5, 6, 7]


def test_unplaced_has_reasons_and_exit_1(run_cli: RunCli) -> None:
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--tp", "8", "--busy", "3", "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["placements"] == [] and data["unplaced"][0]["reasons"]


def test_human_output(run_cli: RunCli) -> None:
    result = run_cli(
        "plan", "--preset", "l40s-8x-pcie", "--model", "llama-3.1-70b", "--weight-dtype", "fp8", "--slo-tpot-ms", "80"
    )
    assert result.exit_code == 0
    assert (
        "tp=4" in result.stdout
        and "domain-affinity" in result.stdout
        and "predicted per request: ttft_ms" in result.stdout
    )


def test_bad_input_is_one_line(run_cli: RunCli) -> None:
    cases = [
        (("plan", "--preset", "hgx-h100", "--model", "llama-3-7b"), "did you mean"),
        (("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--tp", "3"), "--tp 3: tp=3 does not divide"),
        (
            ("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--policy", "fastest"),
            "unknown placement policy",
        ),
        (("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--busy", "0,x"), "--busy"),
        (("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--busy", "9"), "not in the topology"),
        (("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--slo-class", "gold"), "--slo-class"),
        (("plan", "--model", "llama-3.1-70b"), "needs a topology"),
    ]
    for args, phrase in cases:
        result = run_cli(*args)
        assert result.exit_code == 2, (args, result.stderr)
        assert phrase in result.stderr, (args, result.stderr)
        assert result.stdout == "" and "Traceback" not in result.stderr


def test_exact_policy_on_a_small_box(run_cli: RunCli) -> None:
    result = run_cli("plan", "--preset", "4gpu-2numa-nvlink-pairs", "--model", "llama-3.1-8b", "--tp", "2",
                     "--replicas", "2", "--policy", "exact", "--json")  # fmt: skip
    data = json.loads(result.stdout)
    pairs = sorted(tuple(sorted(r["gpu"] for r in p["ranks"])) for p in data["placements"])
    assert pairs == [(0, 1), (2, 3)]


def test_exact_keeps_the_cross_domain_budget_like_slo(run_cli: RunCli) -> None:
    # issue 12: exact used to book GPUs 4-7 with the cross-domain budget broken while slo queued it
    args = ("plan", "--preset", "l40s-8x-pcie", "--model", "llama-3.1-70b", "--tp", "4", "--affinity", "none",
            "--budget-gbps", "1", "--json")  # fmt: skip
    for policy in ("slo", "exact"):
        result = run_cli(*args, "--policy", policy)
        assert result.exit_code == 1, (policy, result.stderr)
        data = json.loads(result.stdout)
        assert data["placements"] == [], policy
        assert [u["status"] for u in data["unplaced"]] == ["queued"], policy
    roomy = run_cli(*args[:-3], "--budget-gbps", "256", "--json", "--policy", "exact")
    assert roomy.exit_code == 0, roomy.stderr
    (placement,) = json.loads(roomy.stdout)["placements"]
    assert all(c["held"] for c in placement["constraints"] if c["name"] != "slo")


def test_policy_help_lists_the_registry(run_cli: RunCli) -> None:
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--policy", "exactly")
    assert result.exit_code == 2 and "exact" in result.stderr and "Traceback" not in result.stderr


def test_simulate_refuses_exact_above_its_cluster_limit_in_one_line(run_cli: RunCli) -> None:
    result = run_cli("simulate", "--scenario", "seed-256", "--policies", "slo,exact", "--json")
    assert result.exit_code == 2
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert "256 GPUs" in result.stderr and "at most 128" in result.stderr


def test_simulate_runs_exact_on_a_small_scenario(run_cli: RunCli) -> None:
    result = run_cli("simulate", "--scenario", "small", "--policies", "exact", "--requests", "10", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["policies"]["exact"]["requests"] == 10


# --- issue 14 item 9: a plan is checked when it is read back ---------------------------------------------


def _two_replicas(run_cli: RunCli) -> dict[str, Any]:
    args = ("--preset", "hgx-h100", "--model", "llama-3.1-8b", "--tp", "4", "--replicas", "2", "--json")
    result = run_cli("plan", *args)
    assert result.exit_code == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = doc
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[int(last) if isinstance(target, list) else last] = value

    return edit


def _share_gpu(doc: dict[str, Any]) -> None:
    doc["placements"][1]["ranks"][0]["gpu"] = doc["placements"][0]["ranks"][0]["gpu"]


def _unknown_key(doc: dict[str, Any]) -> None:
    doc["placements"][0]["tp_size"] = 8


def _hbm_total(doc: dict[str, Any]) -> None:
    doc["placements"][0]["hbm_per_gpu"]["total"] += 1


def _hbm_over(doc: dict[str, Any]) -> None:
    hbm = doc["placements"][0]["hbm_per_gpu"]
    hbm["total"] += 200 * 2**30 - hbm["kv"]
    hbm["kv"] = 200 * 2**30


P0, P1 = "placements.0", "placements.1"
TAMPERED: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("tp 3 with 4 ranks", _set(f"{P0}.tp", 3), f"{P0}.ranks: 4 ranks for tp=3 x pp=1 (needs 3)"),
    (
        "a GPU in two placements",
        _share_gpu,
        f"{P1}.ranks.0: GPU hgx-h100/0 holds ranks of placements plan-0 and plan-1",
    ),
    ("stage 5 on pp=1", _set(f"{P0}.ranks.1.stage", 5), f"{P0}.ranks.1: rank 1 with tp=4 is not stage 5"),
    ("a GPU not in the cluster", _set(f"{P0}.ranks.0.gpu", 42), "placement plan-0 names GPU hgx-h100/42, not in"),
    ("a node not in the cluster", _set(f"{P0}.ranks.0.node", "h9"), "placement plan-0 names node h9, not in"),
    ("the same id twice", _set(f"{P1}.id", "plan-0"), f"{P1}.id: placement plan-0 appears twice"),
    ("HBM over the GPU", _hbm_over, "GiB per GPU is more than the 79.6 GiB of GPU hgx-h100/0"),
    ("HBM total edited", _hbm_total, f"{P0}.hbm_per_gpu.total: "),
    ("negative bytes", _set(f"{P0}.hbm_per_gpu.weights", -1), f"{P0}.hbm_per_gpu.weights: weights=-1"),
    ("an unknown key", _unknown_key, f"{P0}.tp_size: not a key of the plan schema"),
    ("an unknown KV dtype", _set(f"{P0}.kv_dtype", "fp4"), f"{P0}.kv_dtype: 'fp4' is not one of"),
    ("ep not dividing tp", _set(f"{P0}.ep", 3), f"{P0}.ep: ep=3 does not divide tp=4"),
    ("stages without layers", _set(f"{P0}.stage_layers", [1, 2]), f"{P0}.stage_layers: must list the 1"),
    ("an unknown weight dtype", _set("request.weight_dtype", "fp6"), "request.weight_dtype: unknown weight dtype"),
]


@pytest.mark.parametrize(("case", "edit", "message"), TAMPERED, ids=[c for c, _, _ in TAMPERED])
def test_a_tampered_plan_is_refused_in_one_line(
    run_cli: RunCli, tmp_path: Path, case: str, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    doc = _two_replicas(run_cli)
    edit(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    for command in (("launch", "vllm"), ("launch", "sglang"), ("launch", "k8s"), ("launch", "ray")):
        result = run_cli(*command, "--plan", str(path))
        lines = result.stderr.splitlines()
        assert result.exit_code == 2 and result.stdout == "", (case, command, result.stderr)
        assert lines[0].startswith(f"error: {path}: ") and message in lines[0], (case, lines)
        assert len(lines) <= 2 and "Traceback" not in result.stderr


def test_plan_json_is_the_schema_launch_reads(run_cli: RunCli) -> None:
    """Writer and reader are one module: what `plan --json` prints reads back to the same values."""
    doc = _two_replicas(run_cli)
    parsed = parse_plan(doc, "plan.json")
    again = plan_json(parsed.placements, [], parsed.request, parsed.cluster, policy=doc["policy"], source=doc["source"])
    assert again == {**doc, "unplaced": []}
    assert set(doc["placements"][0]) - {"predicted"} == set(Placement.model_fields)


# --- prefill/decode disaggregation ------------------------------------------------------------------

PD = ("plan", "--model", "llama-3.1-70b", "--preset", "cluster-32x-hgx-h100", "--pd-prefill", "2", "--pd-decode", "3")


def test_a_disaggregated_plan_keeps_every_hop_local_on_the_256_gpu_preset(run_cli: RunCli) -> None:
    """Done means (issue 20): every decode instance in a rack holding one of its prefill instances and a
    store; every placement's KV NICs the nearest NICs of its GPUs on their NUMA nodes."""
    result = run_cli(*PD, "--kv-store", "mooncake", "--slo-ttft-ms", "600", "--slo-tpot-ms", "40", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    nodes = {n["name"]: n for n in doc["cluster"]["nodes"]}
    placements = {p["id"]: p for p in doc["placements"]}
    assert sorted(p["role"] for p in placements.values()) == ["decode"] * 3 + ["prefill"] * 2
    store_racks = {s["rack"] for s in doc["stores"]}
    for decode, prefill in doc["disaggregation"]["pairs"].items():
        assert placements[decode]["role"] == "decode" and placements[prefill]["role"] == "prefill"
        decode_racks = {nodes[r["node"]]["rack"] for r in placements[decode]["ranks"]}
        assert decode_racks <= {nodes[r["node"]]["rack"] for r in placements[prefill]["ranks"]}
        assert decode_racks <= store_racks
    assert len(doc["disaggregation"]["pairs"]) == 3
    for p in placements.values():
        for r, device, numa in zip(p["ranks"], p["kv_nics"], p["host_numa"], strict=True):
            node = nodes[r["node"]]
            (gpu,) = [g for g in node["gpus"] if g["index"] == r["gpu"]]
            (nic,) = [n["name"] for n in node["nics"] if n["device"] == device]
            kinds = {nl["nic"]: nl["kind"] for nl in node["nic_links"] if nl["gpu"] == r["gpu"]}
            best = min(kinds.values(), key=["NVLINK", "PIX", "PXB", "PHB", "NODE", "SYS"].index)
            assert kinds[nic] == best != "SYS", (p["id"], r, device)  # nearest, and on the GPU's NUMA node
            assert numa == gpu["numa_node"]


def test_a_disaggregated_plan_in_human_form_names_roles_nics_pairs_and_stores(run_cli: RunCli) -> None:
    result = run_cli(*PD, "--kv-store", "mooncake")
    assert result.exit_code == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "plan-prefill-0 (prefill)" in out and "plan-decode-2 (decode)" in out
    assert "kv_nics mlx5_" in out and "pair: decode plan-decode-0 <- prefill plan-prefill-0" in out
    assert "store (mooncake): node h100-" in out


def test_bad_disaggregation_flags_are_one_line(run_cli: RunCli) -> None:
    base = ("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b")
    cases = [
        ((*base, "--kv-store", "mooncake"), "--kv-store needs a disaggregated plan"),
        ((*base, "--pd-same-rack-required"), "--pd-same-rack-required needs a disaggregated plan"),
        ((*base, "--pd-prefill", "1"), "--pd-decode 0: a disaggregated plan has 1 to 1024 of each role"),
        ((*base, "--pd-prefill", "1", "--pd-decode", "1", "--kv-store", "redis"), "--kv-store 'redis' is not known"),
        ((*base, "--pd-prefill", "1", "--pd-decode", "1", "--replicas", "2"), "--replicas 2 with --pd-prefill"),
    ]
    for args, phrase in cases:
        result = run_cli(*args)
        assert result.exit_code == 2, (args, result.stderr)
        assert phrase in result.stderr and len(result.stderr.splitlines()) <= 2, (args, result.stderr)
        assert result.stdout == "" and "Traceback" not in result.stderr


def test_an_unplaced_decode_exits_1_with_its_reasons(run_cli: RunCli) -> None:
    """One node without racks: decode instances go on the prefill instance's node, until it is full."""
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--tp", "4", "--pd-prefill", "1",
                     "--pd-decode", "2", "--pd-same-rack-required", "--json")  # fmt: skip
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert [p["role"] for p in doc["placements"]] == ["prefill", "decode"]
    (unplaced,) = doc["unplaced"]
    assert unplaced["request_id"] == "plan-decode" and unplaced["replica"] == 1 and unplaced["reasons"]


def _p2p_capture(path: Path, status: str, gpus: int = 8) -> str:
    """An ``nvidia-smi topo -p2p r`` matrix with ``status`` on every pair."""
    head = "\t" + "\t".join(f"GPU{i}" for i in range(gpus))
    rows = [f" GPU{i}\t" + "\t".join("X" if i == j else status for j in range(gpus)) for i in range(gpus)]
    path.write_text("\n".join([head, *rows]) + "\n")
    return str(path)


def test_plan_takes_a_p2p_capture_that_changes_the_pcie_link(run_cli: RunCli, tmp_path: Path) -> None:
    args = ("plan", "--preset", "l40s-8x-pcie", "--model", "llama-3.1-8b", "--tp", "4", "--json")
    on = run_cli(*args, "--p2p", _p2p_capture(tmp_path / "ok.txt", "OK"))
    off = run_cli(*args, "--p2p", _p2p_capture(tmp_path / "gns.txt", "GNS"))
    assert on.exit_code == 0 and off.exit_code == 0, on.stderr + off.stderr
    (p_on,), (p_off,) = json.loads(on.stdout)["placements"], json.loads(off.stdout)["placements"]
    assert (p_on["link"], p_off["link"]) == ("pcie4", "pcie4-nop2p")
    assert p_off["predicted"]["ttft_ms"] > p_on["predicted"]["ttft_ms"]
    alone = run_cli("plan", "--model", "llama-3.1-8b", "--p2p", str(tmp_path / "ok.txt"))
    assert alone.exit_code == 2 and "--p2p adds peer-to-peer status to a topology source" in alone.stderr


def test_plan_json_carries_each_instances_operating_point(run_cli: RunCli) -> None:
    """Issue 32's contract: max_num_seqs, max_num_batched_tokens, goodput and predicted {ttft_ms, tpot_ms, batch}."""
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--tp", "4", "--slo-tpot-ms", "40",
                     "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    (p,) = json.loads(result.stdout)["placements"]
    assert p["max_num_seqs"] == p["predicted"]["batch"] and p["max_num_seqs"] > 8
    assert p["max_num_batched_tokens"] >= p["max_num_seqs"] and p["goodput_tokens_per_s"] > 0
    assert p["predicted"]["ttft_ms"] < p["predicted"]["batch_prefill_ms"]  # one request's TTFT, labelled apart
    assert "capacity" not in json.loads(result.stdout) or json.loads(result.stdout)["capacity"] is None


def test_launch_runs_the_plans_operating_point_unchanged(run_cli: RunCli, tmp_path: Path) -> None:
    plan = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--slo-tpot-ms", "40", "--json")
    (p,) = json.loads(plan.stdout)["placements"]
    path = tmp_path / "plan.json"
    path.write_text(plan.stdout)
    flags = {
        "vllm": ("--max-num-seqs", "--max-num-batched-tokens"),
        "sglang": ("--max-running-requests", "--chunked-prefill-size"),
        "trtllm": ("--max_batch_size", "--max_num_tokens"),
    }
    for engine, (seqs, tokens) in flags.items():
        out = run_cli("launch", engine, "--plan", str(path), "--format", "json")
        assert out.exit_code == 0, out.stderr
        argv = json.loads(out.stdout)["launches"][0]["argv"]
        assert argv[argv.index(seqs) + 1] == str(p["max_num_seqs"]), engine
        assert argv[argv.index(tokens) + 1] == str(p["max_num_batched_tokens"]), engine


def test_an_slo_the_plan_cannot_meet_exits_1_with_a_change_that_would(run_cli: RunCli) -> None:
    result = run_cli("plan", "--preset", "hgx-h200", "--model", "llama-3.1-405b", "--slo-tpot-ms", "30")
    assert result.exit_code == 1
    assert "misses the SLO" in result.stdout and "would meet it: --weight-dtype fp8" in result.stdout
    fixed = run_cli("plan", "--preset", "hgx-h200", "--model", "llama-3.1-405b", "--slo-tpot-ms", "30",
                    "--weight-dtype", "fp8")  # fmt: skip
    assert fixed.exit_code == 0, fixed.stdout


def test_no_ok_slo_line_without_an_slo(run_cli: RunCli) -> None:
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b")
    assert result.exit_code == 0
    assert "slo:" not in result.stdout and "throughput knee" in result.stdout
    with_slo = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--slo-tpot-ms", "40")
    assert "ok slo: TPOT" in with_slo.stdout


def test_request_rate_sizes_the_replicas_or_names_the_missing_gpus(run_cli: RunCli) -> None:
    ok = run_cli("plan", "--preset", "cluster-32x-hgx-h100", "--model", "llama-3.1-70b", "--slo-tpot-ms", "40",
                 "--request-rate", "20", "--json")  # fmt: skip
    assert ok.exit_code == 0, ok.stderr
    doc = json.loads(ok.stdout)
    cap = doc["capacity"]
    assert cap["request_rate_rps"] == 20 and cap["served_rps"] >= 20 and len(doc["placements"]) == cap["replicas"]
    assert cap["gpus"] == sum(len(p["ranks"]) for p in doc["placements"])
    assert sum(p["served_rps"] for p in doc["placements"]) == pytest.approx(cap["served_rps"], rel=1e-3)
    short = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--slo-tpot-ms", "40",
                    "--request-rate", "20")  # fmt: skip
    assert short.exit_code == 1
    (line,) = [x for x in short.stderr.splitlines() if x.startswith("error:")]
    assert "more H100-SXM GPUs are needed" in line
    bad = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--request-rate", "20", "--replicas", "2")
    assert bad.exit_code == 2 and "--request-rate" in bad.stderr


def test_a_base_checkpoint_launch_says_so_and_names_the_chat_model(run_cli: RunCli) -> None:
    base = run_cli("launch", "vllm", "-m", "llama-3.1-70b", "--preset", "hgx-h100", "--format", "json")
    assert base.exit_code == 0, base.stderr
    assert "launches the base checkpoint meta-llama/Llama-3.1-70B" in base.stderr
    assert "--model llama-3.1-70b-instruct" in base.stderr
    chat = run_cli("launch", "vllm", "-m", "llama-3.1-70b-instruct", "--preset", "hgx-h100", "--format", "json")
    assert chat.exit_code == 0 and "base checkpoint" not in chat.stderr
    argv = json.loads(chat.stdout)["launches"][0]["argv"]
    assert "meta-llama/Llama-3.1-70B-Instruct" in argv
    chat_entry = run_cli("launch", "vllm", "-m", "llama-3.3-70b", "--preset", "hgx-h100", "--format", "json")
    assert "base checkpoint" not in chat_entry.stderr  # the entry itself is the Instruct model


def test_pd_auto_picks_the_mode_with_fewer_gpus_and_says_why(run_cli: RunCli, tmp_path: Path) -> None:
    args = ("plan", "--preset", "cluster-32x-hgx-h100", "--model", "llama-3.1-70b", "--slo-tpot-ms", "40",
            "--slo-ttft-ms", "1000", "--pd", "auto", "--json")  # fmt: skip
    low = json.loads(run_cli(*args, "--request-rate", "5").stdout)
    assert low["mode"]["chosen"] == "aggregated" and low["disaggregation"] is None
    assert low["mode"]["aggregated_gpus"] <= low["mode"]["disaggregated_gpus"]  # a tie goes to one pool
    assert low["capacity"]["replicas"] == len(low["placements"])
    high = run_cli(*args, "--request-rate", "60", "--kv-store", "mooncake")
    assert high.exit_code == 0, high.stderr
    doc = json.loads(high.stdout)
    mode = doc["mode"]
    assert mode["chosen"] == "disaggregated" and mode["disaggregated_gpus"] < mode["aggregated_gpus"]
    assert "disaggregated serves the rate with fewer GPUs" in mode["why"] and "KV transfer" in mode["why"]
    roles = [p["role"] for p in doc["placements"]]
    assert roles.count("prefill") == mode["prefill"] and roles.count("decode") == mode["decode"]
    assert sum(len(p["ranks"]) for p in doc["placements"]) == mode["disaggregated_gpus"]
    decode = next(p for p in doc["placements"] if p["role"] == "decode")
    assert decode["max_num_seqs"] > 100 and decode["predicted"]["tpot_ms"] <= 40  # nothing rides along
    assert doc["stores"]
    path = tmp_path / "pd.json"
    path.write_text(high.stdout)
    assert run_cli("launch", "sglang", "--plan", str(path), "--format", "json").exit_code == 0


def test_pd_auto_needs_a_rate_and_no_fixed_roles(run_cli: RunCli) -> None:
    base = ("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--slo-tpot-ms", "40")
    no_rate = run_cli(*base, "--pd", "auto")
    assert no_rate.exit_code == 2 and "--request-rate" in no_rate.stderr
    bad = run_cli(*base, "--pd", "always", "--request-rate", "5")
    assert bad.exit_code == 2 and "--pd 'always' is not a mode" in bad.stderr
    both = run_cli(*base, "--pd", "auto", "--request-rate", "5", "--pd-prefill", "1", "--pd-decode", "1")
    assert both.exit_code == 2 and "chooses the roles itself" in both.stderr


def test_every_prediction_is_finite_and_the_plan_launches(run_cli: RunCli, tmp_path: Path) -> None:
    """Prompts that dominate the work (2,000 in, 2 out at 64 sequences) still plan finite waits (review of
    issue 32: an unsustainable prefill queue used to write TTFT inf, which the plan file cannot carry)."""
    plan = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--input-len", "2000", "--output-len",
                   "2", "--concurrent-seqs", "64", "--json")  # fmt: skip
    assert plan.exit_code == 0, plan.stderr
    (p,) = json.loads(plan.stdout)["placements"]
    assert all(isinstance(p[k], float) for k in ("ttft_ms", "tpot_ms", "served_rps", "goodput_tokens_per_s"))
    path = tmp_path / "plan.json"
    path.write_text(plan.stdout)
    assert run_cli("launch", "vllm", "--plan", str(path), "--format", "json").exit_code == 0
    estimate = run_cli("estimate", "-m", "llama-3.1-8b", "--gpu", "H100-SXM", "--tp", "1", "--batch", "64",
                       "--input-len", "2000", "--output-len", "2", "--json")  # fmt: skip
    assert "Infinity" not in estimate.stdout and json.loads(estimate.stdout)["ttft_ms"] > 0


def test_a_busy_cluster_queues_an_slo_request_an_empty_one_would_meet(run_cli: RunCli) -> None:
    busy = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--slo-tpot-ms", "7",
                   "--busy", "0,1,2,3,4,5,6", "--json")  # fmt: skip
    assert busy.exit_code == 1
    (u,) = json.loads(busy.stdout)["unplaced"]
    assert u["status"] == "queued" and "meets it" in u["reasons"][1] and "no room now" in u["reasons"][1]
    empty = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--slo-tpot-ms", "7")
    assert empty.exit_code == 0


def test_rate_and_length_mistakes_are_one_line_errors(run_cli: RunCli) -> None:
    base = ("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b")
    huge = run_cli(*base, "--request-rate", "1e6")
    assert huge.exit_code == 2 and "one request places at most 10,000" in huge.stderr
    never = run_cli(*base, "--slo-tpot-ms", "1", "--request-rate", "3", "--json")
    assert never.exit_code == 1 and json.loads(never.stdout)["unplaced"][0]["status"] == "rejected"
    store = run_cli(*base, "--slo-tpot-ms", "40", "--request-rate", "3", "--pd", "auto", "--kv-store", "bogus")
    assert store.exit_code == 2 and "--kv-store 'bogus' is not known" in store.stderr
    long = run_cli(*base, "--output-len", "100000")
    assert long.exit_code == 2 and "is longer than --max-model-len 8192" in long.stderr
    prompt = run_cli(*base, "--input-len", "9000")  # a prompt longer than the context: refused, not cut
    assert prompt.exit_code == 2 and "--input-len 9000 + --output-len 256 is longer" in prompt.stderr


def test_the_human_labels_are_the_json_field_names(run_cli: RunCli) -> None:
    """One naming (issue 38 item 4b): each value the table shows is labelled as ``plan --json`` names it."""
    args = ("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--slo-tpot-ms", "40", "--replicas", "2")
    human = run_cli(*args)
    doc = json.loads(run_cli(*args, "--json").stdout)
    assert human.exit_code == 0, human.stderr
    out = " ".join(human.stdout.split())
    p = doc["placements"][0]
    hbm = p["hbm_per_gpu"]
    gib = 2**30
    for shown in (
        "┃ rank ┃ node ┃ gpu ┃ stage ┃",
        f"hbm_per_gpu: weights {hbm['weights'] / gib:.2f} GiB, kv {hbm['kv'] / gib:.2f} GiB",
        f"total {hbm['total'] / gib:.2f} GiB",
        f"kv_dtype {p['kv_dtype']}, kv_tokens_capacity {p['kv_tokens_capacity']:,}",
        f"max_num_seqs {p['max_num_seqs']} (operating_limit {p['operating_limit']}:",
        f"max_num_batched_tokens {p['max_num_batched_tokens']};",
        f"input_len {doc['request']['input_len']}, output_len {doc['request']['output_len']}",
        f"ttft_ms {p['ttft_ms']:.1f}, tpot_ms {p['tpot_ms']:.2f}, tpot_p95_ms {p['tpot_p95_ms']:.2f}",
        f"goodput_tokens_per_s {p['goodput_tokens_per_s']:,.0f} meeting the SLO, served_rps {p['served_rps']:.2f}",
        f"link {p['link']}, level {p['level']}, cross_domain_gbps {p['cross_domain_gbps']:.2f}",
    ):
        assert shown in out, shown
    for old in (
        "┃ GPU ┃",
        "per GPU:",
        "running sequences",
        "tokens per pass",
        "request: TTFT",
        "output tok/s",
        "over nvlink",
    ):
        assert old not in out, old
    sized = ("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--slo-tpot-ms", "40", "--request-rate", "20")
    cap = json.loads(run_cli(*sized, "--json").stdout)["capacity"]
    assert (
        f"capacity: request_rate_rps {cap['request_rate_rps']:g}; replicas {cap['replicas']} x tp={cap['tp']} "
        f"pp={cap['pp']} on gpu {cap['gpu']} (gpus {cap['gpus']}) at batch {cap['batch']} each: served_rps "
        f"{cap['served_rps']:g} together"
    ) in " ".join(run_cli(*sized).stdout.split())
