"""The three checks over the scripted NVML: each drift scenario raises exactly its alerts."""

from __future__ import annotations

import pynvml
import pytest

from tests.sidecar.conftest import Scenario, place
from toposched.errors import DiscoveryError
from toposched.sidecar.checks import check_hbm, check_topology, check_traffic, expectations_from_plan
from toposched.sidecar.fake_scenarios import SCENARIOS, ScriptedNvml, build_scenario
from toposched.sidecar.loop import LoopConfig, Sidecar

HGX = "hgx-h100"
# scenario -> cycle -> the alert keys (kind, gpu, subject) that hold at that cycle, on an HGX H100 TP=4 at GPUs 0-3
EXPECTED: dict[str, list[set[tuple[str, str, str]]]] = {
    "steady": [set(), set(), set(), set()],
    "link-down": [set(), set()] + [{("TOPOLOGY_DRIFT", f"{HGX}/1", f"nvlink->{p}") for p in (0, 2, 3)}] * 2,
    "traffic-ramp": [set(), set()]
    + [{("PCIE_BUDGET_WARNING", f"{HGX}/0", "pcie"), ("PCIE_BUDGET_WARNING", f"{HGX}/3", "nvlink")}] * 2,
    "hbm-leak": [set(), set()] + [{("HBM_DRIFT", f"{HGX}/0", "hbm")}] * 2,
}


def test_every_scenario_is_covered() -> None:
    assert set(EXPECTED) == set(SCENARIOS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_scenario_raises_exactly_its_alerts(scenario: Scenario, name: str) -> None:
    fake, exp, _ = scenario(name)
    assert [g.ref for g in exp.gpus] == [f"{HGX}/{i}" for i in range(4)]
    previous = None
    for cycle, want in enumerate(EXPECTED[name]):
        fake.advance(cycle)
        topo = check_topology(fake, exp)
        traffic = check_traffic(fake, exp, previous=previous)
        previous = traffic.samples
        hbm = check_hbm(fake, exp)
        got = {a.key for a in (*topo.alerts, *traffic.alerts, *hbm.alerts)}
        assert got == want, f"cycle {cycle}"


def test_nvlink_rate_is_read_per_link_with_scope_id(scenario: Scenario) -> None:
    fake, exp, _ = scenario("traffic-ramp")
    fake.advance(0)
    first = check_traffic(fake, exp)
    assert all(rate is None for rate in first.nvlink_gbps.values())  # no rate from one sample
    fake.calls.clear()
    fake.advance(1)
    second = check_traffic(fake, exp, previous=first.samples)
    tx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    assert {f"field {tx}/{link}" for link in range(18)} <= set(fake.calls)
    assert second.nvlink_gbps[3] == pytest.approx(450 * 0.6, rel=1e-3)
    assert second.nvlink_gbps[0] == pytest.approx(450 * 0.1, rel=1e-3)


def test_bare_field_id_reads_link_zero_only() -> None:
    fake = ScriptedNvml.for_node(place()[0].cluster.nodes[0])
    fake.nvmlInit()
    fake.nvlink_gbps[0] = 18.0
    fake.advance(1)
    (bare,) = fake.nvmlDeviceGetFieldValues(0, [pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX])
    both = fake.nvmlDeviceGetFieldValues(0, [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 5)])
    assert bare.scopeId == 0 and both[0].scopeId == 5 and bare.value.ullVal == both[0].value.ullVal > 0


def test_direct_links_drift_at_both_ends() -> None:
    scheduler, placement = place("4gpu-2numa-nvlink-pairs", tp=2)
    exp = expectations_from_plan(placement, scheduler.cluster)
    node = scheduler.cluster.node(exp.node)
    assert not node.nvswitch
    fake = build_scenario("link-down", node, exp)
    fake.nvmlInit()
    a, b = (g.index for g in exp.gpus)
    fake.advance(0)
    assert check_topology(fake, exp).alerts == ()
    fake.advance(2)
    keys = {x.key for x in check_topology(fake, exp).alerts}
    assert keys == {("TOPOLOGY_DRIFT", g.ref, f"nvlink->{p}") for g, p in ((exp.gpus[0], b), (exp.gpus[1], a))}


def test_fabric_clique_change_is_drift(scenario: Scenario) -> None:
    fake, exp, _ = scenario("steady")
    for gpu in fake.gpus:
        gpu.fabric = ("00000000-0000-0000-0000-00000000000a", 1)
    fake.advance(0)
    baseline = check_topology(fake, exp).fabric
    assert set(baseline.values()) == {"00000000-0000-0000-0000-00000000000a/1"}
    fake.gpus[2].fabric = ("00000000-0000-0000-0000-00000000000a", 7)
    keys = {a.key for a in check_topology(fake, exp, fabric_baseline=baseline).alerts}
    assert keys == {("TOPOLOGY_DRIFT", f"{HGX}/2", "fabric")}


def test_hbm_under_use_is_drift_too(scenario: Scenario) -> None:
    fake, exp, _ = scenario("steady")
    fake.advance(0)
    fake.used[1] = int(exp.gpus[1].reserved_bytes * 0.85)
    assert {a.key for a in check_hbm(fake, exp).alerts} == {("HBM_DRIFT", f"{HGX}/1", "hbm")}
    fake.used[1] = int(exp.gpus[1].reserved_bytes * 0.95)
    assert check_hbm(fake, exp).alerts == ()


def test_nvml_errors_are_translated(scenario: Scenario) -> None:
    fake, exp, _ = scenario("steady")
    fake.nvmlShutdown()
    with pytest.raises(DiscoveryError, match="NVML"):
        check_hbm(fake, exp)


def test_loop_reports_each_alert_once_then_resolves(scenario: Scenario) -> None:
    fake, exp, _ = scenario("hbm-leak")
    events: list[dict[str, object]] = []
    sidecar = Sidecar(
        fake, exp, config=LoopConfig(iterations=4), before_cycle=fake.advance, emit=events.append, sleep=lambda _s: None
    )
    results = sidecar.run()
    assert [len(r.new) for r in results] == [0, 0, 1, 0]
    sidecar.before_cycle = None  # the leak is fixed: the script no longer runs
    fake.used[0] = exp.gpus[0].reserved_bytes
    again = sidecar.cycle(4)
    assert [a.key for a in again.resolved] == [("HBM_DRIFT", f"{HGX}/0", "hbm")]
    kinds = [e["event"] for e in events]
    assert kinds.count("alert") == 1 and kinds.count("resolved") == 1 and kinds.count("check") == 5
    assert all("cpu_seconds" in e for e in events if e["event"] == "check")
    assert len(sidecar.reports) == 1 and sidecar.reports[0].drifted_gpus == (f"{HGX}/0",)
