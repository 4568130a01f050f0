"""The engine is an input of every prediction (issue 34): plan, launch, the service, the simulator and
estimate hand it to the cost model, which picks the calibration profile's entry by it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import RunCli, load_benchmark
from toposched.cli.plan_source import PlanSource
from toposched.perf.coefficients import PerfConfig
from toposched.perf.engine_names import engine_of
from toposched.perf.latency import prefill_launched_from_host
from toposched.perf.profile import Profile, ProfileEntry, save_profile
from toposched.service.config import ServiceConfig
from toposched.service.schemas import PlaceBody
from toposched.service.state import ServiceState
from toposched.sim.deployment import placement_template
from toposched.sim.scenario import Scenario, Tenant
from toposched.topology.sources import SourceRef

SLOW_SGLANG = Profile(
    name="slow-sglang", entries=(ProfileEntry(engine="sglang", config=PerfConfig(step_overhead_ms=50.0)),)
)
"""A profile that prices SGLang's decode steps 50 ms slower and leaves every other engine to the shipped one."""


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "slow-sglang.json"
    save_profile(SLOW_SGLANG, path)
    return path


def test_engine_names_map_to_the_cost_model() -> None:
    assert engine_of("trtllm") == "tensorrt-llm-pytorch"  # what `launch trtllm` starts
    assert engine_of(" SGLang ") == "sglang" and engine_of(None) is None and engine_of("") is None
    assert not prefill_launched_from_host("tensorrt-llm") and not prefill_launched_from_host("nim")
    assert prefill_launched_from_host("trtllm") and prefill_launched_from_host("something-else")


def _plan_tpot(run_cli: RunCli, profile: Path, *extra: str) -> tuple[str, float]:
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--concurrent-seqs", "8",
                     "--profile", str(profile), "--json", *extra)  # fmt: skip
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    return data["request"]["engine"], data["placements"][0]["predicted"]["tpot_ms"]


def test_plan_prices_the_engine_it_is_given(run_cli: RunCli, profile_file: Path) -> None:
    engine, vllm = _plan_tpot(run_cli, profile_file)
    assert engine == "vllm"
    engine, sglang = _plan_tpot(run_cli, profile_file, "--engine", "sglang")
    assert engine == "sglang" and sglang > vllm + 45  # the sglang entry's 50 ms per step
    bad = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--engine", "tgi")
    assert bad.exit_code == 2 and "--engine" in bad.stderr


def test_a_launch_plans_for_its_own_engine(run_cli: RunCli, profile_file: Path, tmp_path: Path) -> None:
    source = PlanSource(model="llama-3.1-8b", preset="hgx-h100", concurrent_seqs=8, profile=profile_file)
    doc = source.resolve("sglang")
    assert doc.request.engine == "sglang"
    assert doc.placements[0].tpot_ms > source.resolve("vllm").placements[0].tpot_ms + 45
    planned = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--engine", "sglang", "--json")
    plan = tmp_path / "plan.json"
    plan.write_text(planned.stdout)
    launched = run_cli("launch", "vllm", "--plan", str(plan), "--format", "json")  # a plan is used as it is
    assert launched.exit_code == 0 and "warning" not in launched.stderr
    assert json.loads(planned.stdout)["request"]["engine"] == "sglang"


def test_the_service_prices_the_engine_of_the_body() -> None:
    config = ServiceConfig.model_validate({"state": "memory", "source": SourceRef(kind="preset", ref="hgx-h100"),
                                           "auth": False, "profile": SLOW_SGLANG})  # fmt: skip
    state = ServiceState(config)
    state.open()
    try:
        tpot = {}
        for engine in ("vllm", "sglang"):
            body = PlaceBody.model_validate(
                {"model": "llama-3.1-8b", "id": f"r-{engine}", "engine": engine, "concurrent_seqs": 8}
            )
            decision = state.call(state.place, body)  # as the API calls it: with the service's profile
            assert decision.status == "placed", decision.reasons
            tpot[engine] = decision.instances[0].placement.tpot_ms
        assert tpot["sglang"] > tpot["vllm"] + 45
        with pytest.raises(ValueError, match="engine"):
            PlaceBody.model_validate({"model": "llama-3.1-8b", "engine": "tgi"})
    finally:
        state.close()
        state.worker.shutdown()


def test_the_default_engine_keeps_the_keys_of_requests_booked_before_it() -> None:
    """A body without ``engine`` (every request booked before the field) keeps its idempotency key, so a retry
    after the upgrade answers ``existing``, not ``conflict``; another engine is another request."""
    plain = PlaceBody.model_validate({"model": "llama-3.1-8b", "id": "a"})
    assert "engine" not in plain.key()
    assert PlaceBody.model_validate({"model": "llama-3.1-8b", "id": "a", "engine": "vllm"}).key() == plain.key()
    assert PlaceBody.model_validate({"model": "llama-3.1-8b", "id": "a", "engine": "sglang"}).key() != plain.key()


def test_a_simulated_tenant_runs_its_engine() -> None:
    tenant = Tenant.model_validate({"name": "t", "model": "llama-3.1-8b", "engine": "trtllm", "slo_factor": 2.0})
    assert placement_template(tenant, None).engine == "trtllm"
    scenario = Scenario.model_validate({"cluster": "hgx-h100", "model": "llama-3.1-8b", "engine": "sglang"})
    assert [t.engine for t in scenario.tenant_list()] == ["sglang"]
    with pytest.raises(ValueError, match="give each tenant its engine"):
        Scenario.model_validate({"cluster": "hgx-h100", "engine": "sglang", "tenants": [tenant.model_dump()]})


def test_estimate_says_what_priced_it_and_its_terms_add_up(run_cli: RunCli, profile_file: Path) -> None:
    args = ("estimate", "-m", "llama-3.1-70b", "-g", "H100-SXM", "--tp", "4", "--batch", "8", "--input-len",
            "2048", "--output-len", "128", "--profile", str(profile_file), "--json")  # fmt: skip
    out = {}
    for engine in ("vllm", "sglang"):
        result = run_cli(*args, "--engine", engine)
        assert result.exit_code == 0, result.stderr
        out[engine] = json.loads(result.stdout)
    assert out["vllm"]["priced_by"]["shipped"] and out["vllm"]["priced_by"]["profile"] == "default"
    assert out["sglang"]["priced_by"]["profile"] == "slow-sglang"
    assert out["sglang"]["priced_by"]["entry"]["engine"] == "sglang"
    assert out["sglang"]["decode"]["overhead_ms"] == 50.0
    for data in out.values():
        for step in (data["prefill"], data["decode"]):
            assert sum(step[t] for t in step["terms"]) == pytest.approx(step["total_ms"], rel=1e-12)
            assert step["attention_ms"] > 0
    text = run_cli(*args[:-1], "--engine", "sglang")
    assert "Priced for sglang by profile 'slow-sglang', entry * / * / sglang / *" in text.stdout


def test_estimate_and_calibrate_share_one_ttft_definition(run_cli: RunCli) -> None:
    """The TTFT and TPOT estimate prints are the ones calibrate fits a sample's measurements with."""
    from toposched.perf.hardware import get_gpu
    from toposched.perf.latency import resolve_config
    from toposched.perf.sample_predict import predict_sample
    from toposched.perf.samples import Sample
    from toposched.workload.catalog import resolve_model

    for batch in (1, 16):
        result = run_cli("estimate", "-m", "llama-3.1-70b", "-g", "H100-SXM", "--tp", "4", "--batch", str(batch),
                         "--input-len", "1024", "--output-len", "128", "--max-num-batched-tokens", "8192",
                         "--engine", "sglang", "--json")  # fmt: skip
        assert result.exit_code == 0, result.stderr
        shown = json.loads(result.stdout)
        sample = Sample(source="t", model="llama-3.1-70b", gpu="H100-SXM", engine="sglang", tp=4, batch=batch,
                        input_len=1024, output_len=128, ttft_ms=1.0, tpot_ms=1.0)  # fmt: skip
        config = resolve_config(resolve_model("llama-3.1-70b"), get_gpu("H100-SXM"), None, "sglang")
        fitted = predict_sample(sample, config, max_batched_tokens=8192)
        assert shown["ttft_ms"] == pytest.approx(fitted["ttft_ms"], rel=1e-12)
        assert shown["tpot_ms"] == pytest.approx(fitted["tpot_ms"], rel=1e-12)
        # both are a client's TTFT: the client path is in it, and estimate says how much
        assert shown["client_overhead_ms"] == config.client_overhead_ms > 0
        inside = predict_sample(sample.model_copy(update={"ttft_at": "engine"}), config, max_batched_tokens=8192)
        assert shown["ttft_ms"] - inside["ttft_ms"] == pytest.approx(config.client_overhead_ms, rel=1e-9)


def test_the_engine_rows_are_set_up_from_their_setups_not_their_outputs(tmp_path: Path) -> None:
    """benchmarks/engines_eval.py: a row's setup (batch, lengths) never comes from its measured latencies or
    throughput; rows it cannot express are left out with a reason."""
    module = load_benchmark("engines_eval")
    rows = json.loads(module.ROWS.read_text())
    samples, left = module.load()
    assert len(samples) + len(left) == len(rows) == 42
    outputs = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "output_throughput_tok_s",
               "request_throughput_req_s", "duration_s", "mean_e2e_s", "output_tput_per_gpu")  # fmt: skip
    for r in rows:  # scale every measured output: the setups must not move
        r["published_value"] *= 3
        for key in outputs:
            if isinstance((r.get("published_secondary") or {}).get(key), int | float):
                r["published_secondary"][key] *= 3
    scaled = tmp_path / "rows.json"
    scaled.write_text(json.dumps(rows))
    again, left_again = module.load(scaled)
    setup = ("model", "gpu", "engine", "tp", "weight_dtype", "batch", "num_requests", "input_len", "output_len")
    assert [s.model_dump(include=set(setup)) for s in again] == [s.model_dump(include=set(setup)) for s in samples]
    assert left_again == left and all(": " in why for why in left)


def test_estimate_prices_a_built_tensorrt_engine_apart_from_the_python_launched_ones(run_cli: RunCli) -> None:
    """``--engine tensorrt-llm`` / ``nim``: TensorRT-LLM's KV rule (as ``trtllm``), and a prefill that runs as one
    enqueued engine, so no host launch cost per kernel: its TTFT is lower than vLLM's and TensorRT-LLM's
    PyTorch backend's (``trtllm``, what ``launch trtllm`` starts), which the model prices alike."""
    args = ("estimate", "-m", "llama-3.1-70b", "-g", "H100-SXM", "--tp", "4", "--batch", "16", "--input-len",
            "2048", "--output-len", "256", "--json")  # fmt: skip
    names = ("vllm", "trtllm", "tensorrt-llm", "nim", "nvidia-nim")  # every name the cost model knows is taken
    out = {e: json.loads(run_cli(*args, "--engine", e).stdout) for e in names}
    assert out["nvidia-nim"] == out["nim"]
    assert out["tensorrt-llm"]["cost_engine"] == "tensorrt-llm" and out["nim"]["cost_engine"] == "nvidia-nim"
    assert out["tensorrt-llm"]["engine"] == out["trtllm"]["engine"] == "trtllm"  # the memory rule
    assert out["tensorrt-llm"]["kv_tokens_capacity"] == out["trtllm"]["kv_tokens_capacity"]
    assert out["tensorrt-llm"]["ttft_ms"] < out["trtllm"]["ttft_ms"] - 10
    assert out["tensorrt-llm"]["prefill"]["small_kernels_ms"] < out["vllm"]["prefill"]["small_kernels_ms"] / 10
    assert out["nim"]["ttft_ms"] == out["tensorrt-llm"]["ttft_ms"]
    assert out["trtllm"]["ttft_ms"] == out["vllm"]["ttft_ms"]  # both launch a prefill op by op from Python
    bad = run_cli(*args, "--engine", "tgi")
    assert bad.exit_code == 2 and "tensorrt-llm or nim" in bad.stderr
