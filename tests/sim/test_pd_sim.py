"""Disaggregated runs (``Scenario.pd``): prefill, KV transfer over the links, decode; layouts compared."""

from __future__ import annotations

import json
from collections import deque

import pytest
from pydantic import ValidationError

from tests.conftest import RunCli
from toposched.perf.hardware import get_gpu
from toposched.perf.links import get_link
from toposched.perf.step import StepCost
from toposched.sim.batching import Batcher
from toposched.sim.loading import load_scenario
from toposched.sim.run import PolicyResult, simulate
from toposched.sim.scenario import Pd, Scenario, Tenant
from toposched.sim.workload import SimRequest
from toposched.workload.catalog import resolve_model


def tiny(**pd: object) -> Scenario:
    scenario = load_scenario("pd-tiny")
    assert scenario.pd is not None
    return scenario.model_copy(update={"pd": scenario.pd.model_copy(update=pd)})


@pytest.fixture(scope="module")
def runs() -> dict[str, PolicyResult]:
    return simulate(tiny(), ["slo"])


def test_every_request_is_prefilled_moved_and_decoded(runs: dict[str, PolicyResult]) -> None:
    assert list(runs) == ["slo/same-server", "slo/rack-local", "slo/spread"]
    for name, result in runs.items():
        m = result.metrics  # run_policy has checked conservation (InvariantError otherwise)
        assert m["completed"] == m["requests"] == 300, name
        assert m["instances"] == 8 and m["pd"]["layout"] == name.split("/")[1]
        # TTFT holds the KV transfer: never shorter than the transfer itself
        assert m["ttft_p50_ms"] > m["kv_transfer_p50_ms"] > 0
    scopes = {name: runs[name].metrics["kv_scopes"] for name in runs}
    assert scopes == {
        "slo/same-server": {"same-node": 300},
        "slo/rack-local": {"same-rack": 300},
        "slo/spread": {"cross-rack": 300},
    }


def test_nvlink_moves_kv_faster_and_rack_local_is_no_worse_than_spread(runs: dict[str, PolicyResult]) -> None:
    server, rack, spread = (runs[f"slo/{k}"].metrics for k in ("same-server", "rack-local", "spread"))
    assert server["kv_transfer_p99_ms"] < rack["kv_transfer_p99_ms"] / 5  # NVLink vs 2 NDR NICs
    assert server["ttft_p99_ms"] < rack["ttft_p99_ms"]
    # the model: on a non-blocking spine crossing racks adds the spine's few microseconds only
    assert rack["ttft_p99_ms"] <= spread["ttft_p99_ms"] < rack["ttft_p99_ms"] * 1.01
    assert rack["tpot_p99_ms"] == pytest.approx(spread["tpot_p99_ms"], rel=0.01)


def test_an_oversubscribed_spine_queues_the_transfers_that_cross_it() -> None:
    runs = simulate(tiny(layouts=("rack-local", "spread"), oversubscription=64.0), ["slo"])
    rack, spread = runs["slo/rack-local"].metrics, runs["slo/spread"].metrics
    assert rack["kv_wait_p99_ms"] == 0.0  # one leaf: nothing shares the NICs at this rate
    assert spread["kv_wait_p99_ms"] > 0.0  # every pair's KV through one rack uplink of one NIC's bandwidth
    assert spread["kv_transfer_p99_ms"] > 2 * rack["kv_transfer_p99_ms"]
    assert spread["ttft_p99_ms"] > rack["ttft_p99_ms"]


def test_kv_through_a_store_takes_two_hops() -> None:
    direct = simulate(tiny(layouts=("rack-local",)), ["slo"])["slo/rack-local"].metrics
    store = simulate(tiny(layouts=("rack-local",), kv_via="store"), ["slo"])["slo/rack-local"].metrics
    assert store["completed"] == 300
    assert store["kv_transfer_p50_ms"] > 1.5 * direct["kv_transfer_p50_ms"]


def test_a_prefill_instance_hands_over_and_a_decode_instance_holds_the_kv() -> None:
    cost = StepCost(resolve_model("llama-3.1-8b"), get_gpu("H100"), tp=1, link=get_link("nvlink4"))
    prefill = Batcher(cost, max_seqs=4, max_batched_tokens=8192, kv_capacity=10_000, timeout_s=60, prefill_only=True)
    req = SimRequest(0, 0.0, input_len=1000, output_len=50, slo_class="interactive")
    prefill.waiting.append(req)
    end = prefill.compose(0.0, lambda r: None)
    assert end is not None
    assert prefill.finish(end) == [req] and prefill.kv_used == 0
    assert (req.computed, req.generated, req.first_token_s) == (1000, 1, -1.0)  # first token: at the decode
    decode = Batcher(cost, max_seqs=4, max_batched_tokens=8192, kv_capacity=1000, timeout_s=60)
    decode.waiting = deque([req])
    assert decode.compose(1.0, lambda r: None) is None  # 1,000 tokens held + 1 new do not fit 1,000
    decode.kv_capacity = 1001
    end = decode.compose(1.0, lambda r: None)
    assert end is not None and decode.kv_used == 1001
    decode.finish(end)
    assert req.generated == 2


def test_pd_scenarios_are_checked() -> None:
    base = load_scenario("pd-tiny").model_dump()
    with pytest.raises(ValidationError, match="one tenant"):
        two = [Tenant(name=n, model="llama-3.1-8b", tp=2, slo_ms=100).model_dump() for n in ("a", "b")]
        Scenario.model_validate({**base, "model": None, "tenants": two})
    with pytest.raises(ValidationError, match="no churn and no failures"):
        Scenario.model_validate({**base, "failures": [{"at_s": 1, "gpu": "hgx-h100-00/0"}]})
    with pytest.raises(ValidationError, match="prefill_tp and decode_tp"):
        Scenario.model_validate({**base, "pd": {"prefill": 2, "decode": 2}})
    with pytest.raises(ValidationError, match="must not repeat"):
        Pd(layouts=("spread", "spread"))


def test_a_layout_that_does_not_fit_names_the_instance() -> None:
    from toposched.errors import InputError

    with pytest.raises(InputError, match="layout same-server: decode instance 0 fits no node of prefill"):
        simulate(tiny(layouts=("same-server",), prefill_tp=8), ["slo"])


def test_the_cli_reports_each_layout(run_cli: RunCli) -> None:
    result = run_cli("simulate", "--scenario", "pd-tiny", "--policies", "slo", "--requests", "60", "--json")
    assert result.exit_code == 0, result.stderr
    policies = json.loads(result.stdout)["policies"]
    assert set(policies) == {"slo/same-server", "slo/rack-local", "slo/spread"}
    assert all(p["kv_transfer_p99_ms"] is not None and p["completed"] == 60 for p in policies.values())
    table = run_cli("simulate", "--scenario", "pd-tiny", "--policies", "slo", "--requests", "60")
    assert table.exit_code == 0 and "KV p99" in table.stdout
