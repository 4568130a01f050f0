"""The operating point of one instance (perf/serving.py): the batch rule, the SLO quantile, the planned rate."""

from __future__ import annotations

import math

import pytest

from toposched.perf.hardware import get_gpu
from toposched.perf.latency import PassModel, resolve_config
from toposched.perf.links import get_link
from toposched.perf.serving import (
    KNEE_FRACTION,
    erlang_c,
    evaluate,
    operating_point,
    planned_rate,
)
from toposched.perf.serving_run import ServingRun
from toposched.workload import resolve_model

W = {"isl": 1024, "osl": 256, "budget": 8192}


def _model(name: str = "llama-3.1-70b", tp: int = 4) -> PassModel:
    spec, gpu = resolve_model(name), get_gpu("H100-SXM")
    link = get_link(gpu.native_link)
    return PassModel(spec, gpu, tp=tp, pp=1, link=link, pp_link=link, cfg=resolve_config(spec, gpu, None))


@pytest.mark.parametrize("slo", [25.0, 40.0, 80.0])
def test_with_a_tpot_slo_the_batch_is_the_largest_that_meets_it(slo: float) -> None:
    m = _model()
    p = operating_point(m, max_batch=400, kv_limited=True, slo_tpot_ms=slo, **W)
    assert p.meets_slo and p.tpot_p95_ms <= slo
    if p.batch < 400:
        nxt = evaluate(m, p.batch + 1, slo_tpot_ms=slo, **W)
        assert not nxt.meets_slo and p.limit == "slo-tpot"
    else:
        assert p.limit == "kv-cache"
    # a scan of every batch finds no larger one meeting it (the binary search's monotone premise)
    assert all(not evaluate(m, b, slo_tpot_ms=slo, **W).meets_slo for b in range(p.batch + 1, min(400, p.batch + 40)))


def test_a_ttft_slo_bounds_the_batch_and_the_rate() -> None:
    m = _model()
    loose = operating_point(m, max_batch=400, kv_limited=True, slo_tpot_ms=80, **W)
    no_wait = evaluate(m, loose.batch, **W).ttft_ms  # one request's TTFT at that batch, nobody queued
    slo = 1.25 * no_wait
    waits = operating_point(m, max_batch=400, kv_limited=True, slo_tpot_ms=80, slo_ttft_ms=slo, **W)
    # the TTFT with no wait meets the SLO at the same batch; the waits at the planned rate use the rest
    assert waits.batch == loose.batch and waits.served_rps < loose.served_rps and waits.ttft_ms <= slo + 1e-6
    slo = 0.85 * no_wait
    tight = operating_point(m, max_batch=400, kv_limited=True, slo_tpot_ms=80, slo_ttft_ms=slo, **W)
    assert tight.batch < loose.batch and tight.limit == "slo-ttft"
    assert evaluate(m, tight.batch + 1, **W).ttft_ms > slo >= evaluate(m, tight.batch, **W).ttft_ms


def test_the_kv_cache_caps_the_batch() -> None:
    p = operating_point(_model(), max_batch=12, kv_limited=True, slo_tpot_ms=80, **W)
    assert (p.batch, p.limit) == (12, "kv-cache")
    q = operating_point(_model(), max_batch=12, kv_limited=False, slo_tpot_ms=80, **W)
    assert q.limit == "engine"


def test_without_an_slo_the_batch_is_the_throughput_knee() -> None:
    m = _model()
    p = operating_point(m, max_batch=360, kv_limited=True, **W)
    top = evaluate(m, 360, **W).throughput_tokens_per_s
    assert p.limit == "knee" and p.meets_slo
    assert p.throughput_tokens_per_s >= KNEE_FRACTION * top
    assert evaluate(m, p.batch - 1, **W).throughput_tokens_per_s < KNEE_FRACTION * top


def test_a_missed_slo_returns_batch_one_not_met() -> None:
    p = operating_point(_model(), max_batch=300, kv_limited=True, slo_tpot_ms=5, **W)
    assert p.batch == 1 and not p.meets_slo and p.goodput_tokens_per_s == 0 and p.served_rps == 0


def test_one_requests_ttft_is_not_the_batch_prefill() -> None:
    p = evaluate(_model(), 8, **W)
    one = evaluate(_model(), 1, **W)
    assert p.batch_prefill_ms > 4 * p.ttft_ms  # eight prompts at once vs one among seven decodes
    assert one.ttft_ms < p.ttft_ms


def test_the_tpot_quantile_adds_the_spread_of_arriving_prompts() -> None:
    run = ServingRun(_model(), 32, 1024, 256, 8192)
    assert run.tpot_ms() < run.tpot_ms(1.645) < run.tpot_ms(3.0)
    single = ServingRun(_model(), 1, 1024, 256, 8192)  # nobody else's prompt rides along
    assert single.tpot_ms() == single.tpot_ms(1.645) == single.decode_ms(1)


def test_erlang_c_known_values() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # textbook M/M/2 at rho 0.5
    assert erlang_c(1000, 900.0) < erlang_c(1000, 990.0) < 1.0  # thousands of servers, no overflow


def test_the_planned_rate_leaves_room_for_random_arrivals() -> None:
    p = operating_point(_model(), max_batch=400, kv_limited=True, slo_tpot_ms=40, slo_ttft_ms=1000, **W)
    assert 0 < p.served_rps < p.full_rps  # below what a batch always full completes
    assert p.goodput_tokens_per_s == pytest.approx(p.served_rps * 256)
    tight = planned_rate(p, slo_ttft_ms=p.ttft_ms + 1)
    loose = planned_rate(p, slo_ttft_ms=p.ttft_ms + 5000)
    assert tight < p.served_rps < loose < p.full_rps
    # at the planned rate, the chance to wait longer than the slack is the 5 % allowed
    c, mu = p.batch, p.full_rps / p.batch
    slack = (1000 - p.ttft_ms) / 1e3
    miss = erlang_c(c, p.served_rps / mu) * math.exp(-(c * mu - p.served_rps) * slack)
    assert miss == pytest.approx(0.05, abs=0.002)


def test_a_decode_instance_has_no_prompt_riding_along_and_a_prefill_instance_runs_passes() -> None:
    m = _model()
    both = evaluate(m, 64, **W)
    decode = evaluate(m, 64, role="decode", **W)
    assert decode.tpot_ms == decode.tpot_p95_ms == ServingRun(m, 64, 1024, 256, 8192).decode_ms(64)
    assert decode.tpot_ms < both.tpot_ms and decode.prefill_load == 0
    prefill = evaluate(m, 4, role="prefill", **W)
    assert prefill.batch == 4 and prefill.ttft_ms == pytest.approx(1.5 * prefill.batch_prefill_ms)
    assert prefill.full_rps == pytest.approx(4 / (prefill.batch_prefill_ms / 1e3))
    assert evaluate(m, 50, role="prefill", **W).batch == 8  # a pass holds 8 prompts of 1,024 tokens
    p = operating_point(m, max_batch=400, kv_limited=True, slo_ttft_ms=400, role="prefill", **W)
    assert p.ttft_ms <= 400 and evaluate(m, p.batch + 1, role="prefill", slo_ttft_ms=400, **W).ttft_ms > 400
