"""``toposched calibrate`` end to end: samples in, profile out, errors in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunCli
from tests.perf.test_readers import DATA, exposition_pair
from toposched.cli.calibrate import live_sample
from toposched.perf.profile import load_profile
from toposched.perf.sample_setup import Setup

CSV = """model,gpu,tp,pp,weight_dtype,batch,input_len,output_len,ttft_ms,tpot_ms,tokens_per_s
llama-3.1-8b,H100-SXM,1,1,bf16,1,1024,128,25.1,6.9,140
llama-3.1-8b,H100-SXM,1,1,bf16,16,1024,128,92.4,9.8,1450
llama-3.1-8b,H100-SXM,1,1,bf16,64,1024,128,310,14.1,3900
llama-3.1-8b,H100-SXM,2,1,bf16,1,1024,128,18.0,4.6,210
"""
"""Four illustrative samples (not measurements): enough for the fit and its leave-one-out."""


@pytest.fixture
def csv_file(tmp_path: Path) -> Path:
    f = tmp_path / "bench.csv"
    f.write_text(CSV)
    return f


def test_csv_to_profile(run_cli: RunCli, csv_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = run_cli("calibrate", str(csv_file), "--profile", str(out), "--name", "mine")
    assert result.exit_code == 0, result.stderr
    assert "leave-one-out mean |error|: ttft" in result.stdout
    assert "batch 16, 1024 in / 128 out: TTFT 92.4 ms, TPOT 9.80 ms" in result.stdout
    profile = load_profile(out)
    assert profile.name == "mine" and str(csv_file) in profile.source
    # fitted on all samples, and scoped to what they ran: H100-SXM, Llama, an engine the CSV does not name
    (entry,) = [e for e in profile.entries if e.weight_dtype == "*"]
    assert (entry.gpu, entry.engine, entry.model_family) == ("H100-SXM", "*", "llama")
    assert entry.samples == 4
    assert "H100-SXM / * / * / llama: 4 samples" in result.stdout
    assert set(entry.loo_mean_abs_error) == {"ttft", "tpot", "throughput"}
    assert f"eta_mem={entry.config.eta_mem:g}" in result.stdout


def test_json_and_mixed_formats(run_cli: RunCli, csv_file: Path) -> None:
    result = run_cli("calibrate", str(csv_file), str(DATA / "vllm-result.json"), "--model", "llama-3.1-8b", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert [s["batch"] for s in data["samples"]] == [1, 16, 64, 1, 16]
    assert data["samples"][-1]["engine"] == "vllm"
    assert data["profile"]["entries"][0]["samples"] == 5


def test_samples_only_fits_nothing(run_cli: RunCli, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = run_cli(
        "calibrate", str(DATA / "sglang-results.jsonl"), "--gpu", "H100-SXM", "--samples-only", "--json",
        "--profile", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert [s["tp"] for s in json.loads(result.stdout)["samples"]] == [2, 2]
    assert not out.exists()


def test_fit_not_available_still_reads_samples(
    run_cli: RunCli, csv_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "toposched.perf.calibrate", None)  # import fails
    result = run_cli("calibrate", str(csv_file))
    assert result.exit_code == 2 and "fitting is not available" in result.stderr
    assert run_cli("calibrate", str(csv_file), "--samples-only").exit_code == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "needs benchmark files or --metrics-url"),
        (("--format", "xml", "f"), "--format 'xml'"),
        (("--tp", "0", "f"), "--tp: Input should be greater than or equal to 1"),
        ((str(DATA / "vllm-append.json"),), "vllm-append.json:1: the file does not say which gpu"),
        (("--metrics-url", "ftp://x/metrics"), "not an http(s) URL"),
        ((str(DATA / "samples.csv"), "--profile", "/no/such/dir/p.json"), "no such directory"),
        ((str(DATA / "samples.csv"), "--link", "carrier-pigeon"), "samples.csv:2: unknown link kind 'carrier-pigeon'"),
        (("--metrics-url", "http://127.0.0.1:9/metrics", "--window", "0"), "--window must be from 1"),
    ],
)
def test_errors_are_one_line(run_cli: RunCli, args: tuple[str, ...], message: str) -> None:
    result = run_cli("calibrate", *args)
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_unknown_model_names_the_sample(run_cli: RunCli, tmp_path: Path) -> None:
    f = tmp_path / "b.csv"
    f.write_text(CSV.replace("llama-3.1-8b,H100-SXM,2", "no-such-model,H100-SXM,2"))
    result = run_cli("calibrate", str(f))
    assert result.exit_code == 2 and "b.csv:5: unknown model 'no-such-model'" in result.stderr


def test_live_window_scrapes_twice() -> None:
    bodies = iter(exposition_pair("vllm"))
    naps: list[float] = []
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=next(bodies)))
    s = live_sample("http://127.0.0.1:8000/metrics", 30, Setup(gpu="H100-SXM"), sleep=naps.append, transport=transport)
    assert naps == [30]
    assert (s.engine, s.batch, s.input_len, s.output_len) == ("vllm", 8, 512, 64)
    assert s.ttft_ms == pytest.approx(30.0) and s.tpot_ms == pytest.approx(8.0)
    assert s.tokens_per_s is not None and s.tokens_per_s <= 20 * 64 / 30


def test_metrics_url_adds_a_live_sample(run_cli: RunCli, monkeypatch: pytest.MonkeyPatch) -> None:
    from toposched.cli import calibrate
    from toposched.perf.prometheus import parse_exposition

    scrapes = iter(exposition_pair("sglang"))
    monkeypatch.setattr(calibrate, "scrape", lambda url, transport=None: parse_exposition(next(scrapes), source=url))
    result = run_cli(
        "calibrate", "--metrics-url", "http://127.0.0.1:30000/metrics", "--window", "1", "--gpu", "H100-SXM",
        "--samples-only", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    (s,) = json.loads(result.stdout)["samples"]
    assert (s["engine"], s["batch"], s["input_len"], s["source"]) == (
        "sglang",
        8,
        512,
        "http://127.0.0.1:30000/metrics",
    )
    assert s["tpot_ms"] == pytest.approx(8.0)
