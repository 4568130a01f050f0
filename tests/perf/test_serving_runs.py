"""A benchmark run as the cost model serves it (perf/serving_run.py): varying output lengths drain at a
small batch, a closed loop starts with its first wave at once, and TTFT as a client or the engine sees it."""

from __future__ import annotations

import math

import pytest

from toposched.perf import PerfConfig, get_gpu, get_link
from toposched.perf.latency import PassModel
from toposched.perf.sample_predict import predict_sample
from toposched.perf.samples import Sample
from toposched.perf.serving_run import ServingRun, exponential_lengths
from toposched.workload.catalog import resolve_model

H100 = get_gpu("H100-SXM")
NV4 = get_link("nvlink4")


def _model(name: str = "llama-3.1-8b", tp: int = 1, cfg: PerfConfig | None = None) -> PassModel:
    spec = resolve_model(name)
    return PassModel(spec, H100, tp=tp, pp=1, link=NV4, pp_link=NV4, cfg=cfg or PerfConfig())


def _sample(**kw: object) -> Sample:
    base: dict[str, object] = dict(source="t", model="llama-3.1-8b", gpu="H100-SXM", batch=64, input_len=200,
                                   output_len=200, num_requests=1000, tokens_per_s=1.0)  # fmt: skip
    base.update(kw)
    return Sample.model_validate(base)


def test_exponential_lengths_keep_their_mean_and_are_the_same_every_time() -> None:
    lens = exponential_lengths(197, 984)
    assert len(lens) == 984 and min(lens) >= 1
    assert sum(lens) / len(lens) == pytest.approx(197, rel=0.01)
    assert lens == exponential_lengths(197, 984)
    # an exponential's spread: the longest of ~1000 is about ln(1000) means, the median ln 2 of one
    assert 5 * 197 < max(lens) < 9 * 197
    assert sorted(lens)[len(lens) // 2] == pytest.approx(197 * math.log(2), rel=0.1)
    # not sorted: long and short requests arrive mixed, as a shuffled dataset sends them
    assert lens != sorted(lens) and lens != sorted(lens, reverse=True)
    assert exponential_lengths(10, 0) == []


def test_a_run_of_fixed_lengths_served_one_slot_at_a_time_matches_its_waves() -> None:
    run = ServingRun(_model(), 64, 200, 200, 8192)
    waves = 640 * 200 / (10 * run.batch_ms(64) / 1e3)
    queued = run.tokens_per_s(640, None, [200] * 640)
    assert queued == pytest.approx(waves, rel=0.03)


def test_varying_output_lengths_drain_at_a_small_batch() -> None:
    fixed = predict_sample(_sample(), PerfConfig())["tokens_per_s"]
    varied = predict_sample(_sample(output_dist="exponential"), PerfConfig())["tokens_per_s"]
    # the same tokens, but the longest outputs decode nearly alone after the queue empties
    assert varied < 0.8 * fixed
    run = ServingRun(_model(), 64, 200, 200, 8192)
    lens = exponential_lengths(200, 1000)
    longest = max(lens)
    # the run takes at least the longest request's decode at batch 1 and at most all of them one by one
    assert run.queued_run_ms(lens) > (longest - 1) * run.decode_ms(1)
    assert run.queued_run_ms(lens) < sum(lens) * run.decode_ms(64)


def test_the_drain_interpolates_decode_steps_within_one_percent() -> None:
    for name, tp in (("llama-3.1-70b", 4), ("qwen3-235b-a22b", 8), ("deepseek-v3", 8)):
        run = ServingRun(_model(name, tp), 600, 216, 197, 8192)
        cache: dict[int, float] = {}
        for b in range(1, 600, 7):
            assert run._decode_interpolated(b, cache) == pytest.approx(run.decode_ms(b), rel=0.01), (name, b)


def test_a_closed_loop_starts_with_its_first_wave_at_once() -> None:
    run = ServingRun(_model(), 8, 1024, 256, 8192)
    steady = run.ttft_ms()
    wave = run.first_wave_ttfts_ms()
    assert len(wave) == 8 and min(wave) > steady  # eight prompts in one pass take longer than one
    assert run.mean_ttft_ms(80) == pytest.approx((sum(wave) + 72 * steady) / 80, rel=1e-9)
    assert run.mean_ttft_ms(None) == steady  # an endless run: the start does not count
    assert run.mean_ttft_ms(4) == pytest.approx(sum(run.first_wave_ttfts_ms(4)) / 4, rel=1e-9)  # all at once
    # a budget smaller than the wave: prompts finish pass after pass
    small = ServingRun(_model(), 8, 1024, 256, 2048).first_wave_ttfts_ms()
    assert small == sorted(small) and small[0] < small[-1] and len(small) == 8
    assert ServingRun(_model(), 1, 1024, 256, 8192).mean_ttft_ms(100) == pytest.approx(
        ServingRun(_model(), 1, 1024, 256, 8192).ttft_ms()
    )


def test_client_side_ttft_pays_the_client_overhead_and_engine_side_does_not() -> None:
    cfg = PerfConfig(client_overhead_ms=7.0)
    client = predict_sample(_sample(batch=4, ttft_ms=1.0, tokens_per_s=None), cfg)["ttft_ms"]
    engine = predict_sample(_sample(batch=4, ttft_ms=1.0, tokens_per_s=None, ttft_at="engine"), cfg)["ttft_ms"]
    assert client - engine == pytest.approx(7.0, rel=1e-9)
    run = ServingRun(_model(cfg=cfg), 4, 200, 200, 8192)
    assert run.ttft_ms() - run.ttft_ms(client=False) == pytest.approx(7.0)
    # the decode steps and the throughput do not pay it
    tpot = predict_sample(_sample(batch=4, tpot_ms=1.0, tokens_per_s=None), cfg)["tpot_ms"]
    assert tpot == predict_sample(_sample(batch=4, tpot_ms=1.0, tokens_per_s=None), PerfConfig())["tpot_ms"]


def test_a_sample_budget_is_the_engines_prompt_tokens_per_pass() -> None:
    cfg = PerfConfig()
    wide = predict_sample(_sample(batch=16, input_len=4096, ttft_ms=1.0, tokens_per_s=None), cfg)["ttft_ms"]
    narrow = predict_sample(
        _sample(batch=16, input_len=4096, ttft_ms=1.0, tokens_per_s=None, max_batched_tokens=1024), cfg
    )["ttft_ms"]
    assert narrow > wide  # four chunked passes, each with the running decodes, instead of one
