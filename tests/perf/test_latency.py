"""The TTFT / TPOT cost model and the GPU table."""

from __future__ import annotations

import pytest

from toposched.errors import InputError, UnknownNameError
from toposched.perf import PerfConfig, get_gpu, get_link, gpu_registry, predict_latency
from toposched.perf.allreduce_tables import MEASURED
from toposched.workload.catalog import resolve_model

NV4 = get_link("nvlink4")


def test_gpu_table_names_and_figures() -> None:
    for name in ("H100-SXM", "h200", "A100-SXM-80GB", "b200", "L40S", "GB200", "RTX-4090"):
        assert name in gpu_registry()
    h100 = get_gpu("h100-sxm")
    assert (h100.hbm_bandwidth, h100.bf16_flops, h100.fp8_flops) == (3.35e12, 989e12, 1979e12)
    assert get_gpu("A100").gemm_flops("fp8") == 312e12  # no FP8 tensor cores: BF16 GEMMs
    with pytest.raises(UnknownNameError, match="did you mean 'H200'"):
        get_gpu("H20O")


def test_decode_at_batch_one_is_memory_bound_and_matches_hand_arithmetic() -> None:
    spec = resolve_model("llama-3.3-70b", weight_dtype="fp8")
    cfg = PerfConfig(step_overhead_ms=0.0, kernels_per_layer=0)
    r = predict_latency(spec, get_gpu("H100-SXM"), tp=2, link=NV4, batch=1, input_len=1, output_len=1, config=cfg)
    assert r.decode.bound == "memory"
    # per GPU: FP8 body without embeddings plus a bf16 lm_head shard, at 0.8 x 3.35 TB/s
    body = (spec.params_total - 2 * spec.vocab_size * spec.hidden_size - 81 * spec.hidden_size) / 2
    head = 128_256 * 8192 * 2 / 2
    expect_ms = (body + head) / (0.8 * 3.35e12) * 1e3
    assert r.decode.memory_ms == pytest.approx(expect_ms, rel=0.01)
    # 160 all-reduces of 16 KiB at the vLLM custom all-reduce's measured n=2 time (2**14 B is a table size)
    custom = MEASURED["car_h100_sxm_comm_vllm_0.19.0:vllm_graph"][2]
    assert r.decode.comm_ms == pytest.approx(160 * custom.times_us[14 - custom.first_log2] / 1e3, rel=1e-6)


def test_tp_cuts_tpot_but_not_linearly() -> None:
    spec = resolve_model("llama-3-70b")
    h200 = get_gpu("H200")
    t = {tp: predict_latency(spec, h200, tp=tp, link=NV4, batch=8, input_len=32, output_len=128).tpot_ms
         for tp in (2, 4, 8)}  # fmt: skip
    assert t[2] > t[4] > t[8]
    assert t[8] > t[2] / 4  # communication and fixed costs do not shrink with tp


def test_large_prefill_is_compute_bound_and_pp_adds_handoff() -> None:
    spec = resolve_model("llama-3.1-70b")
    h100 = get_gpu("H100-SXM")
    one = predict_latency(spec, h100, tp=4, link=NV4, batch=4, input_len=4096, output_len=16)
    assert one.prefill.bound == "compute" and one.prefill.p2p_ms == 0
    two = predict_latency(spec, h100, tp=4, pp=2, link=NV4, pp_link=get_link("ib-ndr"), batch=4,
                          input_len=4096, output_len=16)  # fmt: skip
    assert two.decode.p2p_ms > 0 and two.tpot_ms > one.tpot_ms  # PP does not cut per-token latency


def test_cross_node_tp_is_much_slower() -> None:
    spec = resolve_model("llama-3.1-70b")
    h100 = get_gpu("H100-SXM")
    kw = dict(tp=8, batch=1, input_len=512, output_len=64)
    nv = predict_latency(spec, h100, link=NV4, **kw)  # type: ignore[arg-type]
    ib = predict_latency(spec, h100, link=get_link("ib-ndr"), **kw)  # type: ignore[arg-type]
    assert ib.decode.comm_ms > 3 * nv.decode.comm_ms


def test_moe_decode_reads_only_routed_experts() -> None:
    spec = resolve_model("mixtral-8x7b")
    h200 = get_gpu("H200")
    b1 = predict_latency(spec, h200, tp=2, link=NV4, batch=1, input_len=32, output_len=8)
    b64 = predict_latency(spec, h200, tp=2, link=NV4, batch=64, input_len=32, output_len=8)
    assert b1.decode.memory_ms < 0.45 * b64.decode.memory_ms  # 2 of 8 experts vs nearly all


def test_throughput_and_bad_input() -> None:
    spec = resolve_model("llama-3.1-8b")
    r = predict_latency(spec, get_gpu("H200"), tp=1, link=NV4, batch=4, input_len=128, output_len=100)
    assert r.e2e_ms == pytest.approx(r.ttft_ms + 99 * r.tpot_ms)
    assert r.tokens_per_s == pytest.approx(400 / (r.e2e_ms / 1e3))
    with pytest.raises(InputError, match="positive"):
        predict_latency(spec, get_gpu("H200"), tp=1, link=NV4, batch=0)


@pytest.mark.parametrize(
    ("model", "dtype", "gpu", "tp", "batch", "isl", "osl", "measured_ms"),
    [
        ("llama-3.3-70b", "fp8", "H100-SXM", 2, 1, 5000, 500, 18.58),  # NIM ITL, perf-anchors §3.1
        ("llama-3-70b", "bf16", "H200", 4, 8, 32, 128, 2077.53 / 128),  # vLLM nightly, perf-anchors §3.1
    ],
)
def test_decode_anchors_within_25_percent(
    model: str, dtype: str, gpu: str, tp: int, batch: int, isl: int, osl: int, measured_ms: float
) -> None:
    """The shipped default profile on perf-anchors §3.1 decode figures. The NIM ITL row is also an
    anchors-train.json anchor (in-sample for the profile's fit); the vLLM nightly row is not (out of
    sample, and another engine than the TensorRT-LLM rows the profile is fitted on: -18 % measured,
    the issue's "no case worse than 25 %" bound)."""
    spec = resolve_model(model, weight_dtype=dtype)  # type: ignore[arg-type]
    r = predict_latency(spec, get_gpu(gpu), tp=tp, link=NV4, batch=batch, input_len=isl, output_len=osl)
    per_step = r.tpot_ms if batch == 1 else r.e2e_ms / osl
    assert abs(per_step / measured_ms - 1) < 0.25
