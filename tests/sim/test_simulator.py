"""The cluster simulator: determinism, conservation, failures, traces, timeouts, the CLI contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import RunCli
from toposched.errors import InputError, SpecError
from toposched.sim.run import make_arrivals, read_trace, run_policy, simulate
from toposched.sim.scenario import Arrivals, Failure, Lengths, Scenario, load_scenario

SMALL = Scenario(
    name="t",
    cluster="2xhgx-h100",
    model="llama-3.1-70b",
    requests=120,
    arrivals=Arrivals(rate_per_s=30.0),
    input_len=Lengths(mean=256, dist="uniform"),
    output_len=Lengths(mean=64, dist="uniform"),
    slo_ms=40.0,
    slo_mix={"interactive": 0.5, "batch": 0.5},
    batch=8,
)


def _stable(metrics: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in metrics.items() if k not in ("wall_s", "events_per_s")}


def test_same_seed_same_result_and_different_seed_differs() -> None:
    a = simulate(SMALL, ["slo", "random"], seed=3)
    b = simulate(SMALL, ["slo", "random"], seed=3)
    c = simulate(SMALL, ["slo", "random"], seed=4)
    assert {k: _stable(v.metrics) for k, v in a.items()} == {k: _stable(v.metrics) for k, v in b.items()}
    assert _stable(a["random"].metrics) != _stable(c["random"].metrics)


def test_topology_awareness_keeps_requests_in_one_domain() -> None:
    results = simulate(SMALL, ["slo", "random"], seed=1)
    slo, rnd = results["slo"].metrics, results["random"].metrics
    assert slo["completed"] == rnd["completed"] == 120
    assert slo["intra_domain_rate"] == 1.0
    assert rnd["intra_domain_rate"] < 1.0
    assert slo["p99_ms"] <= rnd["p99_ms"]


def test_failure_drains_and_replaces_and_everything_is_accounted_for() -> None:
    scenario = SMALL.model_copy(update={"failures": (Failure(at_s=1.0, gpu="hgx-h100-0/1"),), "requests": 200})
    result = run_policy(scenario, "slo", seed=2)  # raises AssertionError if conservation breaks
    m = result.metrics
    assert m["replacements"] == 1
    assert m["migrations"] >= 1
    assert m["completed"] + m["timed_out"] + m["rejected"] == 200


def test_overload_times_out_and_conservation_still_holds() -> None:
    scenario = SMALL.model_copy(
        update={"arrivals": Arrivals(rate_per_s=500.0), "timeout_s": 0.5, "requests": 300, "autoscale": False}
    )
    m = run_policy(scenario, "slo", seed=0).metrics
    assert m["timed_out"] > 0
    assert m["completed"] + m["timed_out"] + m["rejected"] == 300
    assert m["slo_attainment"] < 1.0


def test_bursty_arrivals_come_in_bursts() -> None:
    steady = make_arrivals(SMALL.model_copy(update={"requests": 2000}), seed=0)
    bursty = make_arrivals(
        SMALL.model_copy(update={"requests": 2000, "arrivals": Arrivals(kind="bursty", rate_per_s=30.0,
                                                                        burst_every_s=20, burst_length_s=5)}),
        seed=0,
    )  # fmt: skip
    in_burst = sum(1 for r in bursty if (r.arrival_s % 20) < 5)
    assert in_burst / len(bursty) > 0.5  # 5 s of every 20 at 4x the rate hold most arrivals
    assert bursty[-1].arrival_s < steady[-1].arrival_s


def test_trace_replay(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "timestamp,model,input_len,output_len,slo_class\n0.5,m,128,32,interactive\n0.1,m,256,16,batch\n2,m,64,8,batch\n"
    )
    reqs = read_trace(str(trace))
    assert [(r.arrival_s, r.slo_class) for r in reqs] == [(0.1, "batch"), (0.5, "interactive"), (2.0, "batch")]
    m = run_policy(SMALL.model_copy(update={"trace": str(trace)}), "slo").metrics
    assert m["requests"] == 3 and m["completed"] == 3
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,input_len,output_len,slo_class\n1,abc,3,batch\n")
    with pytest.raises(InputError, match="line 2"):
        read_trace(str(bad))
    with pytest.raises(InputError, match="missing column"):
        (tmp_path / "short.csv").write_text("timestamp,input_len\n")
        read_trace(str(tmp_path / "short.csv"))


def test_scenario_files_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "s.yaml"
    good.write_text("name: mine\ncluster: 2xhgx-h100\nmodel: llama-3.1-8b\nrequests: 10\n")
    assert load_scenario(str(good)).requests == 10
    bad = tmp_path / "b.yaml"
    bad.write_text("cluster: 2xhgx-h100\nmodel: llama-3.1-8b\narrivals: {rate_per_s: -1}\n")
    with pytest.raises(SpecError, match=r"arrivals\.rate_per_s"):
        load_scenario(str(bad))
    with pytest.raises(InputError, match="did you mean"):
        load_scenario("seed-265")


def test_cli_contract_seed_256(run_cli: RunCli) -> None:
    result = run_cli("simulate", "--scenario", "seed-256", "--policies", "random,slo", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    for name in ("random", "slo"):
        m = data["policies"][name]
        assert {"p50_ms", "p99_ms", "intra_domain_rate", "slo_attainment", "completed"} <= set(m)
        assert 0 <= m["intra_domain_rate"] <= 1 and 0 <= m["slo_attainment"] <= 1
        assert m["completed"] == 4096
    assert data["policies"]["slo"]["intra_domain_rate"] == 1.0
    assert data["policies"]["random"]["p99_ms"] > data["policies"]["slo"]["p99_ms"]


def test_cli_report_and_bad_input(run_cli: RunCli, tmp_path: Path) -> None:
    result = run_cli("simulate", "--scenario", "small", "--policies", "slo,random", "--requests", "60",
                     "--out", str(tmp_path / "r"))  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert {p.name for p in (tmp_path / "r").iterdir()} == {
        "latency_cdf.png", "queue_over_time.png", "report.md", "report.html"
    }  # fmt: skip
    assert "| slo |" in (tmp_path / "r" / "report.md").read_text()
    bad = run_cli("simulate", "--scenario", "small", "--policies", "slo,fastest")
    assert bad.exit_code == 2 and "unknown placement policy" in bad.stderr


def test_nvlink_down_changes_the_domain_map_and_moves_only_affected_instances() -> None:
    scenario = SMALL.model_copy(
        update={"failures": (Failure(at_s=1.0, gpu="hgx-h100-0/1", kind="nvlink-down"),), "requests": 200}
    )
    from toposched.sim.engine import Simulation
    from toposched.sim.run import make_arrivals
    from toposched.sim.scenario import load_cluster
    from toposched.solver.request import PlacementRequest
    from toposched.solver.scheduler import Scheduler

    scheduler = Scheduler(load_cluster(scenario.cluster))
    template = PlacementRequest(
        id="sim",
        model=scenario.model,
        max_model_len=512,
        input_len=256,
        output_len=64,
        concurrent_seqs=scenario.batch,
        slo_tpot_ms=scenario.slo_ms,
    )
    sim = Simulation(scenario, scheduler, template, "slo", 0)
    sim.run(make_arrivals(scenario, 0))
    domains = scheduler.index.dmap.domains
    node0 = next(d for d in domains if d.nodes == ("hgx-h100-0",))
    assert "hgx-h100-0/1" not in node0.gpus and len(node0.gpus) == 7
    assert sim.replacements == 1  # only the TP group that used GPU 1's NVLinks moved
    assert all(r.state in ("done", "timed_out", "rejected") for r in sim.requests.values())
    assert not scheduler.placements and not scheduler.ledger.reservations()
