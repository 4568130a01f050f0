"""``toposched fit`` and ``toposched estimate``: JSON contract, tables, one-line errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, CliResult, RunCli

Run = Callable[..., CliResult]
OPTION_KEYS = {"tp", "pp", "weights_bytes_per_gpu", "kv_bytes_per_token_per_gpu", "kv_tokens_capacity", "fits"}


def test_fit_json_contract_all_options(run_cli: Run) -> None:
    res = run_cli("fit", "--model", "llama-3.1-70b", "--gpu", "H100-SXM", "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    opts = doc["options"]
    assert {(o["tp"], o["pp"]) for o in opts} == {(t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8)}
    for o in opts:
        assert set(o) >= OPTION_KEYS
    by = {(o["tp"], o["pp"]): o for o in opts}
    assert by[(4, 1)]["kv_bytes_per_token_per_gpu"] == 81_920
    assert by[(4, 1)]["fits"] is True and by[(1, 1)]["fits"] is False
    assert doc["kv_bytes_per_token_model"] == 327_680


def test_fit_json_only_given_degrees(run_cli: Run) -> None:
    res = run_cli("fit", "--model", "LLAMA-3-70B", "--gpu", "h100-sxm", "--tp", "8", "--pp", "1", "--json")
    assert res.exit_code == 0, res.stderr
    (opt,) = json.loads(res.stdout)["options"]
    assert (opt["tp"], opt["pp"]) == (8, 1)
    assert abs(opt["weights_bytes_per_gpu"] / 1024**3 - 16.461) < 0.03 * 16.461
    only_tp = json.loads(run_cli("fit", "-m", "llama-3-70b", "-g", "H200", "--tp", "4", "--json").stdout)
    assert {(o["tp"], o["pp"]) for o in only_tp["options"]} == {(4, 1), (4, 2), (4, 4), (4, 8)}


def test_fit_from_config_path_with_dtypes(run_cli: Run) -> None:
    path = str(FIXTURES / "model_configs" / "DeepSeek-V3.json")
    res = run_cli("fit", "--model", path, "--gpu", "H200", "--tp", "8", "--kv-dtype", "fp8",
                  "--max-model-len", "32768", "--pp", "1", "--json")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    (opt,) = json.loads(res.stdout)["options"]
    assert opt["kv_bytes_per_token_per_gpu"] == 35_136 and opt["fits"]


def test_fit_table_lists_options_and_fallbacks(run_cli: Run) -> None:
    # the whole 131,072-token context (the default is 8,192, as plan's): TP2 then needs an FP8 KV cache
    res = run_cli("fit", "--model", "llama-3.1-70b", "--gpu", "H100-SXM", "--pp", "1", "--max-model-len", "131072")
    assert res.exit_code == 0, res.stderr
    assert "327,680 B/token" in res.stdout and "81,920" in res.stdout
    assert "fallbacks for tp=2 pp=1" in res.stdout and "fp8-kv" in res.stdout


def test_estimate_json_contract(run_cli: Run) -> None:
    res = run_cli("estimate", "--model", "llama-3.3-70b", "--gpu", "H100-SXM", "--tp", "2", "--weight-dtype",
                  "fp8", "--batch", "1", "--input-len", "5000", "--output-len", "500", "--json")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert {"ttft_ms", "tpot_ms", "tokens_per_s"} <= set(doc)
    assert doc["link"] == "nvlink4" and 10 < doc["tpot_ms"] < 30 and doc["ttft_ms"] > doc["tpot_ms"]
    assert doc["tokens_per_s"] > 0


def test_estimate_text_and_link_choice(run_cli: Run) -> None:
    res = run_cli("estimate", "-m", "llama-3.1-70b", "-g", "h100-sxm", "--tp", "8", "--link", "ib-ndr",
                  "--batch", "4", "--input-len", "512", "--output-len", "64")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert "link ib-ndr" in res.stdout and "decode step" in res.stdout and "one request's TTFT" in res.stdout


def test_estimate_reports_one_requests_ttft_not_the_batch_prefill(run_cli: Run) -> None:
    """TTFT is per request (what calibrate fits); the whole batch's prefill is its own, labelled figure."""
    res = run_cli("estimate", "-m", "llama-3.1-70b", "-g", "H100-SXM", "--tp", "4", "--batch", "8",
                  "--input-len", "1024", "--output-len", "256", "--json")  # fmt: skip
    doc = json.loads(res.stdout)
    assert doc["batch_prefill_ms"] > 4 * doc["ttft_ms"]  # 8 prompts at once vs one prompt among 7 decodes
    assert doc["tpot_ms"] > doc["decode_step_ms"]  # arriving prompts ride along the decode steps
    one = json.loads(run_cli("estimate", "-m", "llama-3.1-70b", "-g", "H100-SXM", "--tp", "4", "--batch", "1",
                             "--input-len", "1024", "--output-len", "256", "--json").stdout)  # fmt: skip
    assert one["ttft_ms"] < doc["ttft_ms"] < 2 * one["ttft_ms"]


def _one_line_error(res: CliResult, text: str) -> None:
    assert res.exit_code != 0
    first = res.stderr.strip().splitlines()[0]
    assert first.startswith("error:") and text in first, res.stderr


def test_unknown_model_did_you_mean(run_cli: Run) -> None:
    res = run_cli("fit", "--model", "lama-3.1-70b", "--gpu", "H100-SXM")
    _one_line_error(res, "did you mean 'llama-3.1-70b'")


def test_unknown_gpu_and_link(run_cli: Run) -> None:
    _one_line_error(run_cli("fit", "--model", "llama-3-8b", "--gpu", "H100-SMX"), "did you mean")
    res = run_cli("estimate", "-m", "llama-3-8b", "-g", "H100-SXM", "--tp", "2", "--link", "nvlink9",
                  "--batch", "1", "--input-len", "8", "--output-len", "8")  # fmt: skip
    _one_line_error(res, "unknown link kind 'nvlink9'")


def test_impossible_tp(run_cli: Run) -> None:
    res = run_cli("fit", "--model", "llama-3.1-70b", "--gpu", "H100-SXM", "--tp", "3")
    _one_line_error(res, "tp=3 does not divide the 64 attention heads")
    res = run_cli("estimate", "-m", "llama-3.1-70b", "-g", "H100-SXM", "--tp", "6", "--batch", "1",
                  "--input-len", "8", "--output-len", "8")  # fmt: skip
    _one_line_error(res, "tp=6")


def test_ep_skips_the_tp_it_does_not_divide(run_cli: Run) -> None:
    res = run_cli("fit", "-m", "mixtral-8x7b", "-g", "A100-SXM-80GB", "--ep", "2", "--pp", "1", "--json")
    assert res.exit_code == 0, res.stderr
    assert [(o["tp"], o["ep"]) for o in json.loads(res.stdout)["options"]] == [(2, 2), (4, 2), (8, 2)]
    forced = run_cli("fit", "-m", "mixtral-8x7b", "-g", "A100-SXM-80GB", "--ep", "2", "--tp", "1")
    assert forced.exit_code == 2 and "fix: use ep=1, or a tp that is a multiple of 2" in forced.stderr
    none_left = run_cli("fit", "-m", "mixtral-8x7b", "-g", "A100-SXM-80GB", "--ep", "16")
    assert none_left.exit_code == 2 and "ep=16 must divide tp=8" in none_left.stderr
    dense = run_cli("fit", "-m", "llama-3.1-8b", "-g", "A100-SXM-80GB", "--ep", "2")
    assert dense.exit_code == 2 and "is dense" in dense.stderr


def test_fits_nowhere(run_cli: Run) -> None:
    res = run_cli("fit", "--model", "llama-3.1-405b", "--gpu", "RTX-4090", "--pp", "1", "--json")
    _one_line_error(res, "fits on RTX-4090 with none of")
    assert all(not o["fits"] for o in json.loads(res.stdout)["options"])


def test_bad_config_path(run_cli: Run) -> None:
    _one_line_error(run_cli("fit", "--model", "./no/such/config.json", "--gpu", "H200"), "no such file")


LLAMA_70B = FIXTURES / "model_configs/Meta-Llama-3.1-70B.json"


def _config(tmp_path: Path, **overrides: object) -> str:
    cfg = json.loads(LLAMA_70B.read_text())
    cfg.update(overrides)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(
    ("overrides", "phrase"),
    [
        ({"num_key_value_heads": 0}, "num_key_value_heads: expected a positive integer"),
        ({"num_key_value_heads": -8}, "num_key_value_heads: expected a positive integer"),
        ({"num_key_value_heads": 128}, "num_key_value_heads: 128 KV heads must divide the 64 attention heads"),
        ({"max_position_embeddings": 0}, "max_position_embeddings: expected a positive integer"),
        ({"hidden_size": "8192"}, "hidden_size: expected a positive integer"),
    ],
)
def test_bad_config_values_are_one_line_errors_in_fit_and_plan(
    run_cli: Run, tmp_path: Path, overrides: dict[str, object], phrase: str
) -> None:
    model = _config(tmp_path, **overrides)
    fit = run_cli("fit", "--model", model, "--gpu", "H100-SXM", "--json")
    _one_line_error(fit, phrase)
    assert fit.exit_code == 2 and fit.stdout == ""
    # the baseline planned KV heads 0 as one head per rank: fewer GPUs than the real model needs
    plan = run_cli("plan", "--preset", "hgx-h100", "--model", model, "--json")
    _one_line_error(plan, phrase)
    assert plan.exit_code == 2 and plan.stdout == ""


def test_number_the_json_reader_refuses_is_one_line(run_cli: Run, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(LLAMA_70B.read_text().replace('"hidden_size": 8192', '"hidden_size": NaN'))
    _one_line_error(run_cli("fit", "--model", str(path), "--gpu", "H100-SXM"), "NaN is not a number JSON allows")
    path.write_text(LLAMA_70B.read_text().replace('"hidden_size": 8192', '"hidden_size": ' + "9" * 5000))
    _one_line_error(run_cli("fit", "--model", str(path), "--gpu", "H100-SXM"), "an integer of 5000 digits")


def test_absurd_lengths_are_refused_by_the_flags(run_cli: Run) -> None:
    res = run_cli("estimate", "--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--tp", "1", "--batch", "1",
                  "--input-len", "99999999999", "--output-len", "1")  # fmt: skip
    assert res.exit_code == 2 and "--input-len" in res.stderr and "Traceback" not in res.stderr


H100_REPORTED = round(79.19 * 1024**3)


def test_fit_engine_settings_and_usable_memory(run_cli: Run) -> None:
    base = ("fit", "-m", "llama-3.1-8b", "-g", "H100-SXM", "--tp", "1", "--pp", "1", "--json")
    doc = json.loads(run_cli(*base).stdout)
    # the driver-reported total, and vLLM 0.33's defaults for an H100-class GPU
    assert doc["usable_memory_bytes"] == H100_REPORTED and doc["engine"] == "vllm"
    assert (doc["max_num_seqs"], doc["max_num_batched_tokens"]) == (1024, 8192)
    assert doc["budget_bytes_per_gpu"] == -(-H100_REPORTED * 92 // 100)
    over = json.loads(run_cli(*base, "--usable-memory-gib", "70", "--max-num-seqs", "256").stdout)
    assert over["usable_memory_bytes"] == 70 * 1024**3 and over["max_num_seqs"] == 256
    assert over["budget_bytes_per_gpu"] == -(-70 * 1024**3 * 92 // 100)
    # fewer sampler rows: a smaller activation peak than the default run
    assert over["options"][0]["activation_bytes_per_gpu"] < doc["options"][0]["activation_bytes_per_gpu"]
    sg = json.loads(run_cli(*base, "--engine", "sglang", "--mem-fraction-static", "0.8").stdout)
    assert sg["engine"] == "sglang" and sg["mem_fraction_static"] == 0.8 and sg["gpu_memory_utilization"] is None
    assert sg["options"][0]["activation_bytes_per_gpu"] == 0
    text = run_cli(*base[:-1], "--engine", "sglang").stdout
    assert "sglang sizing, mem_fraction_static default" in text and "79.19 GiB usable" in text


def test_engine_flags_that_do_not_belong_are_refused(run_cli: Run) -> None:
    base = ("fit", "-m", "llama-3.1-8b", "-g", "H100-SXM", "--tp", "1")
    _one_line_error(run_cli(*base, "--engine", "tgi"), "unknown engine 'tgi'")
    _one_line_error(run_cli(*base, "--engine", "sglang", "--gpu-memory-utilization", "0.9"), "vLLM's setting")
    _one_line_error(run_cli(*base, "--mem-fraction-static", "0.8"), "SGLang's setting")
    _one_line_error(run_cli(*base, "--usable-memory-gib", "0"), "--usable-memory-gib must be in")


def test_estimate_prints_latency_with_its_batch_and_lengths(run_cli: Run, tmp_path: Path) -> None:
    args = ("estimate", "-m", "llama-3.1-8b", "-g", "H100-SXM", "--tp", "1", "--batch", "4",
            "--input-len", "512", "--output-len", "64")  # fmt: skip
    res = run_cli(*args)
    assert res.exit_code == 0, res.stderr
    assert "Serving 4 requests at once" in res.stdout and "The prefill of all 4 prompts at once" in res.stdout
    assert "context 544, 512 in + 64 out / 2" in res.stdout
    assert "prefill of all 4 prompts" in res.stdout.splitlines()[2]  # 2,048 tokens: one pass, the table's column
    chunked = run_cli(*args, "--max-num-batched-tokens", "1024")  # two passes: the column is the first one
    assert chunked.exit_code == 0 and "prefill pass 1 of 2" in chunked.stdout.splitlines()[2]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"version": 1, "name": "mine", "entries": []}))
    doc = json.loads(run_cli(*args, "--profile", str(path), "--max-num-batched-tokens", "1024", "--json").stdout)
    assert doc["profile"] == "mine" and doc["max_num_batched_tokens"] == 1024
    assert (doc["batch"], doc["input_len"], doc["output_len"], doc["tpot_context_len"]) == (4, 512, 64, 544)
    path.write_text(json.dumps({"version": 1, "name": ""}))
    _one_line_error(run_cli(*args, "--profile", str(path)), "profile")


def test_a_short_gpu_name_says_which_variant_it_took(run_cli: RunCli) -> None:
    """Issue 38: ``--gpu H100`` was taken as H100-SXM without a word (H100-PCIe: 2.0 TB/s of HBM against 3.35)."""
    args = ("-m", "llama-3.1-8b", "--tp", "1", "--batch", "8", "--input-len", "512", "--output-len", "128")
    short = run_cli("estimate", "--gpu", "H100", *args)
    said = " ".join(short.stderr.split())
    assert short.exit_code == 0 and "note: --gpu H100 is taken as H100-SXM; pass --gpu H100-PCIe" in said
    exact = run_cli("estimate", "--gpu", "H100-SXM", *args)
    assert exact.exit_code == 0 and exact.stderr == "" and exact.stdout == short.stdout
