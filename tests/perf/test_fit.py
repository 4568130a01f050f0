"""The fit (perf/fitting.py, perf/calibrate.py): robust to a few rows the model cannot describe, pooled or
with host costs per engine, warm-started refits, and the fitter that leave-one-out and leave-group-out refit with."""

from __future__ import annotations

import pytest

from tests.perf.synthetic import made_by
from toposched.perf import PerfConfig, fitting
from toposched.perf.calibrate import leave_group_out, leave_one_out
from toposched.perf.fitting import engine_fitter, fit_config, fit_engine_configs, pooled_fitter
from toposched.perf.sample_predict import predict_sample
from toposched.perf.samples import Sample

FIELDS = ("eta_mem", "step_overhead_ms", "prefill_overhead_ms")


def test_a_row_the_model_cannot_describe_moves_the_fit_less_than_least_squares_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    truth = PerfConfig(eta_mem=0.7, step_overhead_ms=1.5, prefill_overhead_ms=6.0)
    clean = made_by(truth) + made_by(truth, tag="t")
    # one row's TTFT three times what the model gives (a warm-up transient in its mean)
    spoiled = [clean[0].model_copy(update={"ttft_ms": 3 * clean[0].ttft_ms}), *clean[1:]]
    robust = fit_config(spoiled, fields=FIELDS)
    monkeypatch.setattr(fitting, "ROBUST_SCALE", 1e6)  # soft-L1 with a huge scale: plain least squares
    plain = fit_config(spoiled, fields=FIELDS)
    assert abs(robust.prefill_overhead_ms - 6.0) < 0.6 * abs(plain.prefill_overhead_ms - 6.0)
    assert robust.eta_mem == pytest.approx(0.7, rel=0.03)

    def worst_other(cfg: PerfConfig) -> float:
        return max(abs(predict_sample(s, cfg)["ttft_ms"] / s.ttft_ms - 1) for s in spoiled[1:] if s.ttft_ms)

    assert worst_other(robust) < worst_other(plain)


def test_host_costs_per_engine_recover_each_engines_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # a weak pull towards the pool (the shipped 1.0 shrinks hard: the published rows did not carry more)
    monkeypatch.setattr(fitting, "ENGINE_PRIOR_WEIGHT", 0.03)
    fast = made_by(PerfConfig(eta_mem=0.7, step_overhead_ms=0.5, prefill_overhead_ms=3.0), "tensorrt-llm", "f")
    slow = made_by(PerfConfig(eta_mem=0.7, step_overhead_ms=3.0, prefill_overhead_ms=20.0), "vllm", "v")
    pooled, per_engine = fit_engine_configs(fast + slow, fields=FIELDS)
    assert set(per_engine) == {"tensorrt-llm", "vllm"}
    assert per_engine["vllm"].prefill_overhead_ms > 2 * per_engine["tensorrt-llm"].prefill_overhead_ms
    assert per_engine["vllm"].step_overhead_ms > per_engine["tensorrt-llm"].step_overhead_ms
    # the physics is shared: one eta_mem for both
    assert per_engine["vllm"].eta_mem == per_engine["tensorrt-llm"].eta_mem == pooled.eta_mem
    assert pooled.eta_mem == pytest.approx(0.7, rel=0.05)
    # a single pooled fit cannot tell them apart, the per-engine one is closer on both
    one = fit_config(fast + slow, fields=FIELDS)
    priced = engine_fitter(fields=FIELDS)(fast + slow)

    def err(config_of: object, rows: list[Sample]) -> float:
        return max(abs(e) for s in rows for e in _errs(s, config_of(s)).values())  # type: ignore[operator]

    assert err(priced, fast + slow) < err(lambda _s: one, fast + slow)
    # an engine with fewer than MIN_ENGINE_SAMPLES rows has no host costs of its own: priced by the pool
    few = fast + slow[:2]
    assert set(fit_engine_configs(few, fields=FIELDS)[1]) == {"tensorrt-llm"}


def _errs(s: Sample, cfg: PerfConfig) -> dict[str, float]:
    pred = predict_sample(s, cfg)
    return {k: pred[k] / getattr(s, k) - 1 for k in pred}


def test_a_warm_refit_lands_where_a_cold_one_does() -> None:
    truth = PerfConfig(eta_mem=0.7, step_overhead_ms=1.5, prefill_overhead_ms=6.0)
    rows = made_by(truth)
    full = fit_config(rows, fields=FIELDS)
    cold = fit_config(rows[1:], fields=FIELDS)
    warm = fit_config(rows[1:], fields=FIELDS, start=full)
    for f in FIELDS:
        assert getattr(warm, f) == pytest.approx(getattr(cold, f), rel=0.02)
    # leave-one-out with a warm pooled fitter equals the cold one within the fit's tolerance
    a = dict((s.source, e) for s, e in leave_one_out(rows, fields=FIELDS))
    b = dict((s.source, e) for s, e in leave_one_out(rows, fitter=pooled_fitter(warm=rows, fields=FIELDS)))
    assert a.keys() == b.keys()
    assert all(abs(a[k][kind] - b[k][kind]) < 0.01 for k in a for kind in a[k])


def test_leave_group_out_with_per_engine_host_costs_prices_a_held_out_engine_by_the_pool() -> None:
    fast = made_by(PerfConfig(step_overhead_ms=0.5, prefill_overhead_ms=3.0), "tensorrt-llm", "f")
    slow = made_by(PerfConfig(step_overhead_ms=3.0, prefill_overhead_ms=20.0), "vllm", "v")
    held = dict(leave_group_out(fast + slow, lambda s: str(s.engine), fitter=engine_fitter(fields=FIELDS)))
    # vLLM held out: fitted on TensorRT-LLM alone, its decode steps come out too fast
    assert all(held[s]["tpot"] < -0.05 for s in slow if s.batch == 1)
