"""The cluster simulator: determinism, conservation, failures, traces, timeouts, reports, the CLI contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import RunCli
from toposched.errors import InputError, SpecError
from toposched.sim.loading import load_scenario
from toposched.sim.run import make_arrivals, read_trace, run_policy, simulate
from toposched.sim.scenario import Arrivals, Failure, Lengths, Scenario, Tenant

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
    return {k: v for k, v in metrics.items() if k not in ("wall_s", "cpu_s", "events_per_s")}


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
    assert slo["intra_domain_rate"] == slo["signals"]["nvlink_affinity_ratio"] == 1.0
    assert rnd["intra_domain_rate"] < 1.0
    assert slo["p99_ms"] <= rnd["p99_ms"]
    # latencies are distributions now: the median and the tail differ
    assert slo["tpot_p50_ms"] < slo["tpot_p99_ms"] and slo["ttft_p50_ms"] < slo["ttft_p99_ms"]


def test_failure_drains_and_replaces_and_everything_is_accounted_for() -> None:
    scenario = SMALL.model_copy(update={"failures": (Failure(at_s=1.0, gpu="hgx-h100-0/1"),), "requests": 200})
    result = run_policy(scenario, "slo", seed=2)  # raises InvariantError if conservation breaks
    m = result.metrics
    assert m["replacements"] == 1 and m["gpu_failures"] == 1
    assert m["requeued_requests"] >= 1
    assert m["completed"] + m["timed_out"] + m["rejected"] == 200 and m["running_at_end"] == 0
    # every instance ends served, abandoned or still waiting (here: the failed one finds no room again)
    assert m["instance_arrivals"] == m["instances_done"] + m["instances_unplaced_at_end"] + m["instances_abandoned"]
    assert m["instances_unplaced_at_end"] == 1


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


def test_lognormal_lengths_have_the_mean_and_stay_bounded() -> None:
    spec = Lengths(dist="lognormal", mean=1000, sigma=0.6)
    sc = SMALL.model_copy(update={"requests": 4000, "input_len": spec})
    lengths = [r.input_len for r in make_arrivals(sc, seed=0)]
    assert 900 < sum(lengths) / len(lengths) < 1050  # clipping at 4x the mean trims the mean a little
    assert max(lengths) <= spec.upper == 4000 and min(lengths) >= 1
    assert len(set(lengths)) > 500


TWO = Scenario(
    name="two",
    cluster="2xhgx-h100",
    tenants=(
        Tenant(name="chat", model="llama-3.1-8b", tp=1, batch=8, slo_ms=60.0, input_len=Lengths(mean=256),
               output_len=Lengths(mean=32)),
        Tenant(name="big", model="llama-3.1-70b", tp=4, batch=8, slo_factor=1.5, input_len=Lengths(mean=256),
               output_len=Lengths(mean=32)),
    ),
    instances=4,
    requests=50,
)  # fmt: skip


def test_trace_replay(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "timestamp,model,input_len,output_len,slo_class\n0.5,m,128,32,interactive\n0.1,m,256,16,batch\n2,m,64,8,batch\n"
    )
    reqs = read_trace(str(trace))
    expected = [(0.1, "batch", 0), (0.5, "interactive", 1), (2.0, "batch", 2)]  # sorted, ids in arrival order
    assert [(r.arrival_s, r.slo_class, r.id) for r in reqs] == expected
    m = run_policy(SMALL.model_copy(update={"trace": str(trace)}), "slo").metrics
    assert m["requests"] == 3 and m["completed"] == 3
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,input_len,output_len,slo_class\n1,abc,3,batch\n")
    with pytest.raises(InputError, match="line 2"):
        read_trace(str(bad))
    with pytest.raises(InputError, match="missing column"):
        (tmp_path / "short.csv").write_text("timestamp,input_len\n")
        read_trace(str(tmp_path / "short.csv"))


def test_trace_rows_go_to_their_tenant(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "timestamp,input_len,output_len,tenant,model\n"
        "0.1,100,10,big,\n0.2,100,10,,llama-3.1-8b\n0.3,100,10,chat,\n0.4,5000,10,chat,\n"
    )  # fmt: skip
    sc = TWO.model_copy(update={"trace": str(trace)})
    reqs = make_arrivals(sc, 0)
    assert [r.tenant for r in reqs] == [1, 0, 0, 0]
    assert [r.slo_class for r in reqs] == ["interactive"] * 4  # the tenants' class: no slo_class column
    m = run_policy(sc, "slo").metrics
    assert m["tenants"]["big"]["requests"] == 1 and m["tenants"]["chat"]["requests"] == 3
    assert m["rejected"] == 1  # 5,010 tokens: longer than the context the chat instances reserve
    assert m["completed"] == 3
    trace.write_text("timestamp,input_len,output_len,tenant\n0.1,100,10,nobody\n")
    with pytest.raises(InputError, match=r"line 2: tenant 'nobody' is not one of chat, big"):
        make_arrivals(sc, 0)
    trace.write_text("timestamp,input_len,output_len\n0.1,100,10\n")
    with pytest.raises(InputError, match="no tenant or model value"):
        make_arrivals(sc, 0)


def test_tenant_slo_factor_is_relative_to_the_in_domain_reference() -> None:
    m = run_policy(TWO.model_copy(update={"requests": 60, "arrivals": Arrivals(rate_per_s=5.0)}), "slo").metrics
    big = m["tenants"]["big"]
    assert big["tp"] == 4 and big["capacity_rps"] > 0
    # slo_factor 1.5 x the in-domain per-token reference; the chat tenant's SLO is in ms
    assert m["tenants"]["chat"]["slo_ms"] == 60.0
    assert 10 < big["slo_ms"] < 200
    assert m["slo_attainment_by_tp"]["1"] is not None and m["slo_attainment_by_tp"]["4"] is not None
    assert m["slo_attainment_by_tp"]["2"] is None  # no TP2 instance served anything


@pytest.mark.parametrize(
    ("text", "key", "phrase"),
    [
        ("cluster: 2xhgx-h100\n", "", "give a model"),
        ("cluster: 2xhgx-h100\nmodel: llama-3.1-8b\ntenants: [{name: a, model: llama-3.1-8b, slo_ms: 5}]\n", "",
         "not both"),
        ("cluster: 2xhgx-h100\ntenants: [{name: a, model: m, slo_ms: 5}, {name: a, model: m, slo_ms: 5}]\n", "",
         "unique"),
        ("cluster: 2xhgx-h100\ntenants: [{name: a, model: m}]\n", "tenants.0", "exactly one of slo_ms"),
        ("cluster: 2xhgx-h100\ntenants: [{name: a, model: m, slo_ms: 5, slo_factor: 2}]\n", "tenants.0", "exactly one"),
        ("cluster: 2xhgx-h100\ntenants: [{name: 'a b', model: m, slo_ms: 5}]\n", "tenants.0.name", "not valid"),
        ("cluster: 2xhgx-h100\ntenants: [{name: a, model: m, slo_ms: 5, tp: 3}]\n", "tenants.0.tp", "power of two"),
        ("cluster: 2xhgx-h100\nmodel: m\ninput_len: {dist: lognormal, mean: 100, max: 10}\n", "input_len",
         "below the mean"),
        ("cluster: 2xhgx-h100\nmodel: m\nchurn: {occupancy: .inf}\n", "churn.occupancy", "finite"),
        ("cluster: 2xhgx-h100\nmodel: m\nchurn: {duration_s: 0}\n", "churn.duration_s", "greater than 0"),
        ("cluster: 2xhgx-h100\nmodel: m\nadmission: {defrag_max_moves: 0}\n", "admission.defrag_max_moves",
         "greater than or equal to 1"),
    ],
)  # fmt: skip
def test_scenario_schema_errors_name_the_key(tmp_path: Path, text: str, key: str, phrase: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_scenario(str(path))
    assert info.value.path == key and phrase in info.value.problem, info.value


def test_scenario_files_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "s.yaml"
    good.write_text("name: mine\ncluster: 2xhgx-h100\nmodel: llama-3.1-8b\nrequests: 10\n")
    assert load_scenario(str(good)).requests == 10
    dense = Path(__file__).parents[2] / "src/toposched/data/scenarios/dense-175b-class.json"
    (tmp_path / "m.json").write_text(dense.read_text())
    multi = tmp_path / "multi.yaml"
    multi.write_text("cluster: 2xhgx-h100\ntenants: [{name: a, model: m.json, slo_ms: 50}]\n")
    assert load_scenario(str(multi)).tenants[0].model == str(tmp_path / "m.json")  # relative to the file
    bad = tmp_path / "b.yaml"
    bad.write_text("cluster: 2xhgx-h100\nmodel: llama-3.1-8b\narrivals: {rate_per_s: -1}\n")
    with pytest.raises(SpecError, match=r"arrivals\.rate_per_s"):
        load_scenario(str(bad))
    with pytest.raises(InputError, match="did you mean"):
        load_scenario("seed-265")


def test_a_tenant_that_fits_nowhere_is_one_error() -> None:
    sc = TWO.model_copy(update={"tenants": (Tenant(name="huge", model="llama-3.1-405b", tp=1, slo_ms=50, batch=8),)})
    with pytest.raises(InputError, match=r"tenant 'huge' .* fits no degree on this cluster"):
        run_policy(sc, "slo")


def test_cli_contract_seed_256(run_cli: RunCli) -> None:
    result = run_cli("simulate", "--scenario", "seed-256", "--policies", "random,slo", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["slo_ms"] == 100.0
    for name in ("random", "slo"):
        m = data["policies"][name]
        assert {"p50_ms", "p99_ms", "intra_domain_rate", "slo_attainment", "completed"} <= set(m)
        assert 0 <= m["intra_domain_rate"] <= 1 and 0 <= m["slo_attainment"] <= 1
        assert m["completed"] == 4096
    assert data["policies"]["slo"]["intra_domain_rate"] == 1.0
    assert data["policies"]["random"]["p99_ms"] > data["policies"]["slo"]["p99_ms"]


def test_cli_contract_churn(run_cli: RunCli) -> None:
    result = run_cli(
        "simulate", "--scenario", "churn-tiny", "--policies", "slo,index-order", "--occupancy", "0.7", "--json"
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["occupancy"] == 0.7 and data["slo_ms"] is None and set(data["tenants"]) == {"small-tp1", "big-tp4"}
    for m in data["policies"].values():
        assert 0 < m["gpu_utilization"] <= 1
        assert set(m["slo_attainment_by_tp"]) >= {"1", "2", "4", "8"}
        assert all(v is None or 0 <= v <= 1 for v in m["slo_attainment_by_tp"].values())
        assert isinstance(m["migrations"], int) and m["migrations"] >= 0
        assert 0 <= m["queued_for_nvlink_rate"] <= 1
        for key in ("requeued_requests", "fallback_placements", "instances_abandoned", "instance_arrivals"):
            assert isinstance(m[key], int) and m[key] >= 0, key
        assert m["completed"] + m["timed_out"] + m["rejected"] == m["requests"] > 0
        assert set(m["signals"]) == {
            "nvlink_affinity_ratio", "cross_domain_budget_ratio_peak", "cross_domain_budget_ratio_mean",
            "compression_ratio", "p99_gap_ms", "migration_ratio",
        }  # fmt: skip
    assert data["policies"]["index-order"]["queued_for_nvlink_rate"] == 0.0  # blind: never waits for NVLink
    bad = run_cli("simulate", "--scenario", "small", "--occupancy", "0.5", "--json")
    assert bad.exit_code == 2 and "has no churn" in bad.stderr


def test_cli_report_and_bad_input(run_cli: RunCli, tmp_path: Path) -> None:
    result = run_cli("simulate", "--scenario", "small", "--policies", "slo,random", "--requests", "60",
                     "--out", str(tmp_path / "r"))  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert {p.name for p in (tmp_path / "r").iterdir()} == {
        "latency_cdf.png", "tenant_slo.png", "domain_occupancy.png", "queue_over_time.png", "gpus_over_time.png",
        "report.md", "report.html",
    }  # fmt: skip
    report = (tmp_path / "r" / "report.md").read_text()
    assert "| slo |" in report and "TTFT p99" in report and "| TP1 | TP2 | TP4 | TP8 |" in report
    bad = run_cli("simulate", "--scenario", "small", "--policies", "slo,fastest")
    assert bad.exit_code == 2 and "unknown placement policy" in bad.stderr


def test_plots_are_step_functions_and_time_plots_have_a_panel_per_policy() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    import numpy as np

    from toposched.sim.report import figures

    results = simulate(SMALL.model_copy(update={"requests": 40}), ["slo", "random"], seed=0)
    figs = figures(SMALL, results)
    try:
        for name in ("latency_cdf.png", "gpus_over_time.png", "queue_over_time.png"):
            lines = [line for ax in figs[name].axes for line in ax.get_lines() if np.asarray(line.get_xdata()).size > 2]
            assert lines, name
            assert all(line.get_drawstyle() == "steps-post" for line in lines), name
        for name in ("gpus_over_time.png", "queue_over_time.png", "domain_occupancy.png"):
            titled = [ax.get_title() for ax in figs[name].axes]
            assert any(t.startswith("slo:") for t in titled) and any(t.startswith("random:") for t in titled), name
    finally:
        for fig in figs.values():
            plt.close(fig)


def test_nvlink_down_changes_the_domain_map_and_moves_only_affected_instances() -> None:
    from toposched.sim.engine import Simulation
    from toposched.sim.loading import load_cluster
    from toposched.sim.run import deployments_for
    from toposched.solver.scheduler import Scheduler

    scenario = SMALL.model_copy(
        update={"failures": (Failure(at_s=1.0, gpu="hgx-h100-0/1", kind="nvlink-down"),), "requests": 200}
    )
    scheduler = Scheduler(load_cluster(scenario.cluster))
    sim = Simulation(scenario, scheduler, deployments_for(scenario, scheduler), "slo", 0)
    sim.run(make_arrivals(scenario, 0))
    domains = scheduler.index.dmap.domains
    node0 = next(d for d in domains if d.nodes == ("hgx-h100-0",))
    assert "hgx-h100-0/1" not in node0.gpus and len(node0.gpus) == 7
    assert sim.replacements == 1  # only the TP group that used GPU 1's NVLinks moved
    assert sim.gpus_available == 16  # the GPU still serves alone
    assert all(r.state in ("done", "timed_out", "rejected") for r in sim.requests)
    assert not scheduler.placements and not scheduler.ledger.reservations()
