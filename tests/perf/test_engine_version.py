"""The engine's version is an input of every prediction (issue 34): plan, the service, the simulator, estimate
and calibrate take it beside the engine, and a calibration profile entry fitted on one version prices only it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.conftest import RunCli
from toposched.errors import InputError
from toposched.perf.coefficients import PerfConfig
from toposched.perf.engine_names import (
    checked_version,
    cost_engine,
    engine_of,
    engine_version,
    version_matches,
    version_of,
)
from toposched.perf.profile import Profile, ProfileEntry, load_profile, save_profile
from toposched.service.config import ServiceConfig
from toposched.service.schemas import PlaceBody
from toposched.service.state import ServiceState
from toposched.sim.deployment import placement_template
from toposched.sim.scenario import Scenario, Tenant
from toposched.topology.sources import SourceRef

SLOW_VLLM_011 = Profile(
    name="slow-vllm-0.11",
    entries=(ProfileEntry(engine="vllm", engine_version="0.11", config=PerfConfig(step_overhead_ms=50.0)),),
)
"""Prices vLLM 0.11.x's decode steps 50 ms slower; every other version and engine keeps the shipped profile."""


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "slow-vllm-0.11.json"
    save_profile(SLOW_VLLM_011, path)
    return path


def test_versions_are_read_as_the_engines_report_them() -> None:
    assert engine_version("v0.11.0") == "0.11.0" and engine_version(" 0.5.3.post3 ") == "0.5.3.post3"
    assert engine_version("1.3.0rc20") == "1.3.0rc20" and engine_version(None) is None and engine_version("") is None
    for bad in ("latest", "0..1", "1 2", "0.1;rm -rf", "0.1/..", "9" * 41):
        with pytest.raises(ValueError, match="is not a version"):
            engine_version(bad)
    with pytest.raises(InputError, match="--engine-version"):
        checked_version("nightly")
    # the cost model's engine string carries both; the name alone is what engine_of gives
    assert cost_engine("trtllm", "v1.0") == "tensorrt-llm-pytorch==1.0" and cost_engine("vllm") == "vllm"
    assert cost_engine(None, "0.11.0") is None
    assert engine_of("vllm==0.11.0") == "vllm" and version_of("vllm==0.11.0") == "0.11.0"
    assert version_of("vllm") is None
    # a scope holds the versions it leads, by whole components
    assert version_matches("0.11", "0.11.2") and version_matches("0.11.0", "0.11.0")
    assert version_matches("0.5.3", "0.5.3.post3")
    assert not version_matches("0.1", "0.11.2") and not version_matches("0.11", "0.12.0")
    assert not version_matches("0.11", None)


def test_a_profile_entry_fitted_on_a_version_prices_only_that_version(tmp_path: Path) -> None:
    entries = (
        ProfileEntry(config=PerfConfig(eta_mem=0.5)),
        ProfileEntry(engine="vllm", config=PerfConfig(eta_mem=0.55)),
        ProfileEntry(engine="vllm", engine_version="v0.11", config=PerfConfig(eta_mem=0.6)),
        ProfileEntry(engine="vllm", engine_version="0.11.2", config=PerfConfig(eta_mem=0.65)),
    )
    assert entries[2].engine_version == "0.11"
    find = Profile(entries=entries).config_for
    assert find("H100-SXM", "bf16", engine="vllm==0.11.2").eta_mem == 0.65  # the most specific version
    assert find("H100-SXM", "bf16", engine="vllm==0.11.0").eta_mem == 0.6
    assert find("H100-SXM", "bf16", engine="vllm==0.12.0").eta_mem == 0.55  # the engine's own entry
    assert find("H100-SXM", "bf16", engine="vllm").eta_mem == 0.55  # no version: no versioned entry
    assert find("H100-SXM", "bf16", engine="sglang==0.11.0").eta_mem == 0.5
    # a GPU entry outranks a version entry of as many named fields
    gpu_first = Profile(entries=(ProfileEntry(gpu="H100-SXM", engine="vllm", config=PerfConfig(eta_mem=0.7)),
                                 *entries))  # fmt: skip
    assert gpu_first.config_for("H100-SXM", "bf16", engine="vllm==0.11.0").eta_mem == 0.7
    with pytest.raises(ValidationError, match="is not a version"):
        ProfileEntry(engine="vllm", engine_version="latest", config=PerfConfig())
    # a profile written before versions (no engine_version key) loads with every entry for any version
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"version": 1, "entries": [{"engine": "vllm", "config": PerfConfig().model_dump()}]}))
    assert load_profile(old).entries[0].engine_version == "*"


def _plan(run_cli: RunCli, profile: Path, *extra: str) -> dict[str, object]:
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--concurrent-seqs", "8",
                     "--profile", str(profile), "--json", *extra)  # fmt: skip
    assert result.exit_code == 0, result.stderr
    data: dict[str, object] = json.loads(result.stdout)
    return data


def _tpot(plan: dict[str, object]) -> float:
    return float(plan["placements"][0]["predicted"]["tpot_ms"])  # type: ignore[index]


def test_plan_prices_the_engine_version_it_is_given(run_cli: RunCli, profile_file: Path) -> None:
    plain = _plan(run_cli, profile_file)
    versioned = _plan(run_cli, profile_file, "--engine-version", "v0.11.0")
    newer = _plan(run_cli, profile_file, "--engine-version", "0.12.0")
    assert versioned["request"]["engine_version"] == "0.11.0"  # type: ignore[index]
    assert _tpot(versioned) > _tpot(plain) + 45  # the 0.11 entry's 50 ms per step
    assert _tpot(newer) == _tpot(plain)
    bad = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--engine-version", "0.11;reboot")
    assert bad.exit_code == 2 and "--engine-version" in bad.stderr and len(bad.stderr.strip().splitlines()) <= 2


def test_the_service_prices_the_engine_version_of_the_body() -> None:
    config = ServiceConfig.model_validate({"state": "memory", "source": SourceRef(kind="preset", ref="hgx-h100"),
                                           "auth": False, "profile": SLOW_VLLM_011})  # fmt: skip
    state = ServiceState(config)
    state.open()
    try:
        tpot = {}
        for version in (None, "0.11.1"):
            body = PlaceBody.model_validate(
                {"model": "llama-3.1-8b", "id": f"r-{version}", "engine_version": version, "concurrent_seqs": 8}
            )
            decision = state.call(state.place, body)
            assert decision.status == "placed", decision.reasons
            tpot[version] = decision.instances[0].placement.tpot_ms
        assert tpot["0.11.1"] > tpot[None] + 45
        with pytest.raises(ValueError, match="is not a version"):
            PlaceBody.model_validate({"model": "llama-3.1-8b", "engine_version": "$(id)"})
    finally:
        state.close()
        state.worker.shutdown()
    # a body without a version keeps the key of the requests booked before the field; a version is another request
    plain = PlaceBody.model_validate({"model": "llama-3.1-8b", "id": "a"})
    assert "engine_version" not in plain.key()
    assert PlaceBody.model_validate({"model": "llama-3.1-8b", "id": "a", "engine_version": "0.11.0"}).key() != (
        plain.key()
    )


def test_a_simulated_tenant_runs_its_engine_version() -> None:
    tenant = Tenant.model_validate(
        {"name": "t", "model": "llama-3.1-8b", "engine": "sglang", "engine_version": "v0.5.7", "slo_factor": 2.0}
    )
    assert tenant.cost_engine == "sglang==0.5.7"
    assert placement_template(tenant, None).cost_engine == "sglang==0.5.7"
    scenario = Scenario.model_validate({"cluster": "hgx-h100", "model": "llama-3.1-8b", "engine_version": "0.11.0"})
    assert [t.cost_engine for t in scenario.tenant_list()] == ["vllm==0.11.0"]
    with pytest.raises(ValueError, match="is not a version"):
        Scenario.model_validate({"cluster": "hgx-h100", "model": "llama-3.1-8b", "engine_version": "main"})
    with pytest.raises(ValueError, match="give each tenant its engine"):
        Scenario.model_validate({"cluster": "hgx-h100", "engine_version": "0.11.0", "tenants": [tenant.model_dump()]})


def test_estimate_says_which_version_priced_it(run_cli: RunCli, profile_file: Path) -> None:
    args = ("estimate", "-m", "llama-3.1-8b", "-g", "H100-SXM", "--tp", "1", "--batch", "8", "--input-len",
            "1024", "--output-len", "128", "--profile", str(profile_file))  # fmt: skip
    data = json.loads(run_cli(*args, "--engine-version", "0.11.0", "--json").stdout)
    assert data["engine_version"] == "0.11.0" and data["decode"]["overhead_ms"] == 50.0
    assert data["priced_by"]["entry"]["engine_version"] == "0.11"
    plain = json.loads(run_cli(*args, "--json").stdout)
    assert plain["engine_version"] is None and plain["priced_by"]["shipped"]
    text = run_cli(*args, "--engine-version", "0.11.0").stdout
    assert "Priced for vllm 0.11.0 by profile 'slow-vllm-0.11', entry * / * / vllm 0.11 / *" in text
    bad = run_cli(*args, "--engine-version", "x.y")
    assert bad.exit_code == 2 and "--engine-version" in bad.stderr


def test_calibrate_scopes_its_profile_to_the_engine_version(run_cli: RunCli, tmp_path: Path) -> None:
    """A CSV column or ``--engine-version``: the entries a calibration writes carry the version, so another
    version of the engine keeps the shipped coefficients."""
    rows = ["model,gpu,tp,pp,weight_dtype,batch,input_len,output_len,ttft_ms,tpot_ms,tokens_per_s,engine,"
            "engine_version"]  # fmt: skip
    for batch, tpot in ((1, 9.0), (4, 9.5), (8, 10.0), (16, 11.0)):
        rows.append(f"llama-3.1-8b,H100-SXM,1,1,bf16,{batch},1024,128,,{tpot},,vllm,v0.11.0")
    csv = tmp_path / "bench.csv"
    csv.write_text("\n".join(rows) + "\n")
    out = tmp_path / "p.json"
    result = run_cli("calibrate", str(csv), "--profile", str(out))
    assert result.exit_code == 0, result.stderr
    assert {(e.engine, e.engine_version) for e in load_profile(out).entries} == {("vllm", "0.11.0")}
    assert "vllm 0.11.0" in result.stdout
    # the option wins over the file, as every option does
    out2 = tmp_path / "p2.json"
    assert run_cli("calibrate", str(csv), "--engine-version", "0.11.2", "--profile", str(out2)).exit_code == 0
    assert {e.engine_version for e in load_profile(out2).entries} == {"0.11.2"}
    csv.write_text(csv.read_text().replace("v0.11.0", "nightly"))
    bad = run_cli("calibrate", str(csv))
    assert bad.exit_code == 2 and "bench.csv:2" in bad.stderr and "is not a version" in bad.stderr


def test_a_launch_plans_for_the_version_it_is_given(run_cli: RunCli, profile_file: Path, tmp_path: Path) -> None:
    """``--engine-version`` is a plan option: every launch command that plans takes it; a saved plan already
    says the version it was sized for, so both at once is an error."""
    from toposched.cli.plan_source import PlanSource

    source = PlanSource(model="llama-3.1-8b", preset="hgx-h100", concurrent_seqs=8, profile=profile_file,
                        engine_version="0.11.0")  # fmt: skip
    doc = source.resolve("vllm")
    assert doc.request.engine_version == "0.11.0" and doc.request.cost_engine == "vllm==0.11.0"
    planned = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--engine-version", "0.11", "--json")
    plan = tmp_path / "plan.json"
    plan.write_text(planned.stdout)
    both = run_cli("launch", "vllm", "--plan", str(plan), "--engine-version", "0.11.0")
    assert both.exit_code == 2 and "--engine-version" in both.stderr
    assert run_cli("launch", "vllm", "--plan", str(plan), "--format", "json").exit_code == 0


def test_versions_follow_pep_440_where_they_can() -> None:
    """The engines' packages report PEP 440 versions: spellings meet, and a local build label (``+cu128``) is
    the same release to a profile entry."""
    assert engine_version("1.3.0-rc20") == "1.3.0rc20" and engine_version("V0.11.0+CU128") == "0.11.0+cu128"
    assert version_matches("0.11.0", "0.11.0+cu128") and version_matches("0.11", "0.11.3+cu126")
    assert version_matches("1.3.0rc20", "1.3.0rc20+local") and not version_matches("1.3.0rc20", "1.3.0")
    entry = ProfileEntry(engine="vllm", engine_version="0.11.0", config=PerfConfig(eta_mem=0.6))
    assert Profile(entries=(entry,)).find("H100-SXM", "bf16", engine="vllm==0.11.0+cu128") is not None
    with pytest.raises(ValidationError, match="needs the engine"):  # versions of different engines do not compare
        ProfileEntry(engine_version="0.11", config=PerfConfig())


def test_a_version_is_its_own_field_and_belongs_to_its_engine() -> None:
    from toposched.perf.sample_setup import Setup, make_sample
    from toposched.perf.samples import Sample

    row = {"model": "llama-3.1-8b", "gpu": "H100-SXM", "batch": 1, "input_len": 10, "output_len": 10,
           "tpot_ms": 5.0, "engine": "vllm", "engine_version": "0.11.0"}  # fmt: skip
    assert make_sample(row, Setup(), where="f:2").cost_engine == "vllm==0.11.0"
    # --engine naming another engine drops the file's version (it was vLLM's); with --engine-version it is that
    assert make_sample(row, Setup(engine="sglang"), where="f:2").cost_engine == "sglang"
    both = Setup(engine="sglang", engine_version="0.5.7")
    assert make_sample(row, both, where="f:2").cost_engine == "sglang==0.5.7"
    assert make_sample(row, Setup(engine="VLLM"), where="f:2").cost_engine == "vllm==0.11.0"
    with pytest.raises(InputError, match="give its version as engine_version"):
        make_sample({**row, "engine": "vllm==0.11.0"}, Setup(), where="f:2")
    with pytest.raises(ValidationError, match="give its version as engine_version"):
        Sample.model_validate({**row, "source": "s", "engine": "sglang==0.5.7"})


def test_a_k8s_launch_runs_the_version_it_was_priced_for(run_cli: RunCli) -> None:
    args = ("launch", "k8s", "--preset", "hgx-h100", "-m", "llama-3.1-8b", "--engine-version")
    other = run_cli(*args, "0.11.0")  # the default image runs vLLM 0.33.0
    assert other.exit_code == 2 and "priced for vllm 0.11.0 but the image vllm/vllm-openai:v0.33.0" in other.stderr
    assert run_cli(*args, "0.33").exit_code == 0
    assert run_cli(*args, "0.11.0", "--image", "vllm/vllm-openai:v0.11.0").exit_code == 0
    assert run_cli(*args, "0.11.0", "--image", "registry.local:5000/vllm:latest").exit_code == 0  # not a version
