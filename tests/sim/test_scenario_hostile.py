"""Hostile and damaged scenario files and traces (issue 13 items 13-15): one clear error, bounded work."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import RunCli
from toposched.errors import InputError, SpecError
from toposched.sim.loading import load_cluster, load_scenario
from toposched.sim.run import read_trace, run_policy
from toposched.sim.scenario import MAX_REQUESTS, Failure, Scenario

BASE = "cluster: 2xhgx-h100\nmodel: llama-3.1-8b\nrequests: 20\n"


def _scenario(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def _spec_error(path: Path) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_scenario(str(path))
    assert str(info.value).startswith(str(path)), info.value
    return info.value


@pytest.mark.parametrize(
    ("extra", "key", "phrase"),
    [
        ("arrivals: {rate_per_s: .inf}\n", "arrivals.rate_per_s", "finite"),
        ("slo_ms: .nan\n", "slo_ms", "finite"),
        ("timeout_s: 1.0e300\n", "timeout_s", "less than or equal"),
        ("instance_startup_s: .inf\n", "instance_startup_s", "finite"),
        ("arrivals: {kind: bursty, burst_every_s: 1.0e300}\n", "arrivals.burst_every_s", "less than or equal"),
        ("budget_gbps: .inf\n", "budget_gbps", "finite"),
        ("instances: 1000000000\n", "instances", "from 1 to 1,000,000"),
        ("failures: [{at_s: .inf, gpu: hgx-h100-0/1}]\n", "failures.0.at_s", "finite"),
        ("failures: [{at_s: 1, gpu: 'x'}]\n", "failures.0.gpu", "not a GPU reference"),
        ("failures: [{at_s: 1, gpu: 'bad name/1'}]\n", "failures.0.gpu", "not a hostname"),
        ("slo_mix: {batch: .nan}\n", "slo_mix.batch", "finite"),
        ('name: "a\\nb"\n', "name", "pattern"),
    ],
)
def test_bad_fields_name_the_key(tmp_path: Path, extra: str, key: str, phrase: str) -> None:
    error = _spec_error(_scenario(tmp_path, BASE + extra))
    assert error.path == key and phrase in error.problem, error


def test_request_count_is_bounded(tmp_path: Path) -> None:
    error = _spec_error(_scenario(tmp_path, "cluster: 2xhgx-h100\nmodel: llama-3.1-8b\nrequests: 1000000000\n"))
    assert error.path == "requests" and f"{MAX_REQUESTS}" in error.problem.replace(",", "").replace("_", "")


def test_duplicate_keys_deep_nesting_and_long_numbers(tmp_path: Path) -> None:
    assert "duplicate key 'requests'" in str(_spec_error(_scenario(tmp_path, BASE + "requests: 5\n")))
    assert "nested" in str(_spec_error(_scenario(tmp_path, BASE + "x: " + "[" * 5000 + "]" * 5000 + "\n")))
    assert "too long" in str(_spec_error(_scenario(tmp_path, BASE.replace("20", "9" * 5000))))


def test_odd_files_and_references(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_bytes(b"cluster: 2xhgx-h100\nmodel: \xff\n")
    with pytest.raises(InputError, match="not UTF-8"):
        load_scenario(str(path))
    with pytest.raises(InputError, match="not a regular file"):
        load_scenario("/dev/zero")
    for ref in ("a\x00b", "x" * 5000, ""):
        with pytest.raises(InputError):
            load_scenario(ref)
    with pytest.raises(InputError, match="between 1 and"):
        load_cluster("9" * 100 + "xhgx-h100")
    with pytest.raises(InputError):
        load_cluster("/" + "a/" * 3000)


SMALL = Scenario(name="t", cluster="2xhgx-h100", model="llama-3.1-8b", requests=10, batch=8)


@pytest.mark.parametrize("kind", ["gpu-down", "nvlink-down"])
def test_failure_of_a_gpu_outside_the_cluster_is_refused_before_the_run(kind: str) -> None:
    scenario = SMALL.model_copy(update={"failures": (Failure(at_s=1.0, gpu="nosuch-node/0", kind=kind),)})
    with pytest.raises(InputError, match=r"failures\.0\.gpu: 'nosuch-node/0' is not a GPU of cluster"):
        run_policy(scenario, "slo")


def test_more_instances_than_gpus_is_refused_before_placing() -> None:
    with pytest.raises(InputError, match="instances 100 is more than the 16 GPUs"):
        run_policy(SMALL.model_copy(update={"instances": 100}), "slo")


HEADER = "timestamp,model,input_len,output_len,slo_class\n"


@pytest.mark.parametrize(
    ("rows", "phrase"),
    [
        ("nan,m,1,1,batch\n", "timestamp 'nan' is not a number of seconds"),
        ("inf,m,1,1,batch\n", "timestamp 'inf' is not a number of seconds"),
        ("1_0,m,1,1,batch\n", "timestamp '1_0' is not a number of seconds"),
        ("\u0661,m,1,1,batch\n", "is not a number of seconds"),
        ("1e400,m,1,1,batch\n", "timestamp '1e400' must be"),
        ("-1,m,1,1,batch\n", "timestamp '-1' must be"),
        ("x,m,1,1,batch\n", "not a number of seconds"),
        ("1,m,1\n", "no value in column 'output_len'"),
        ("1,m,1.5,1,batch\n", "input_len '1.5' must be a whole number"),
        ("1,m,0,1,batch\n", "input_len '0' must be a whole number"),
        ("1,m,1," + "9" * 5000 + ",batch\n", "output_len '999"),
        ("1,m,1,1,gold\n", "slo_class 'gold' is not one of"),
        ("1,m,1,1," + "x" * 200_000 + "\n", "not valid CSV"),
        ("", "no requests"),
    ],
)
def test_bad_trace_rows_are_one_error_naming_the_line(tmp_path: Path, rows: str, phrase: str) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + rows)
    with pytest.raises(InputError, match=r"line 2|no requests") as info:
        read_trace(str(trace))
    assert phrase in str(info.value) and str(trace) in str(info.value), info.value


def test_trace_files_are_read_safely(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_bytes(HEADER.encode() + b"1,\xff,1,1,batch\n")
    with pytest.raises(InputError, match="not UTF-8"):
        read_trace(str(trace))
    with pytest.raises(InputError, match="not a regular file"):
        read_trace("/dev/zero")
    trace.write_text(HEADER + "\n1,m,2,3,batch\n\n")  # blank lines are skipped
    assert [(r.input_len, r.output_len) for r in read_trace(str(trace))] == [(2, 3)]


def test_cli_requests_override_is_bounded(run_cli: RunCli) -> None:
    result = run_cli("simulate", "--scenario", "small", "--requests", "1000000000", "--json")
    assert result.exit_code == 2 and "--requests must be from 1 to 1,000,000" in result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr


def test_cli_names_the_scenario_file_for_a_gpu_outside_the_cluster(run_cli: RunCli, tmp_path: Path) -> None:
    path = _scenario(tmp_path, BASE + "failures: [{at_s: 1, gpu: nosuch/0, kind: nvlink-down}]\n")
    result = run_cli("simulate", "--scenario", str(path), "--policies", "slo", "--json")
    assert result.exit_code == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {path}: failures.0.gpu: 'nosuch/0' is not a GPU of cluster")
