"""The issue-16 latency model terms, the calibration fit and the default profile."""

from __future__ import annotations

import math

import pytest

from tests.perf.synthetic import made_by
from toposched.errors import InputError
from toposched.perf import PerfConfig, get_gpu, get_link, predict_latency
from toposched.perf.calibrate import fit_profile, leave_group_out, leave_one_out
from toposched.perf.fitting import fit_config
from toposched.perf.latency import PassModel, prefill_chunks, roofline
from toposched.perf.links import two_level_link
from toposched.perf.profile import Profile, ProfileEntry, default_profile, use_profile
from toposched.perf.sample_predict import predict_sample, relative_errors
from toposched.perf.samples import Sample
from toposched.perf.step import StepCost
from toposched.workload.catalog import resolve_model
from toposched.workload.memory import kv_bytes_per_token_per_layer

NV4 = get_link("nvlink4")
H100 = get_gpu("H100-SXM")


def test_smooth_roofline_between_sum_and_max() -> None:
    assert roofline(3.0, 4.0, 1.0) == pytest.approx(7.0)
    assert roofline(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert roofline(3.0, 4.0, 16.0) == pytest.approx(4.0, rel=0.01)
    assert roofline(0.0, 0.0, 2.0) == 0.0


def test_chunked_prefill_is_the_sum_of_budget_sized_passes() -> None:
    assert prefill_chunks(2, 3000, 4096) == [[(0, 3000), (0, 1096)], [(1096, 1904)]]
    assert prefill_chunks(3, 100, None) == [[(0, 100)] * 3]
    spec = resolve_model("llama-3.1-8b")
    cfg = PerfConfig()
    kw = dict(tp=1, link=NV4, batch=4, input_len=3000, output_len=10, config=cfg)
    whole = predict_latency(spec, H100, **kw)  # type: ignore[arg-type]
    chunked = predict_latency(spec, H100, max_batched_tokens=2048, **kw)  # type: ignore[arg-type]
    assert whole.prefill_passes == 1 and chunked.prefill_passes == math.ceil(4 * 3000 / 2048)
    cost = StepCost(spec, H100, tp=1, link=NV4, config=cfg)
    passes = prefill_chunks(4, 3000, 2048)
    assert chunked.ttft_ms == pytest.approx(sum(cost.step_ms(chunks=p) for p in passes), rel=1e-9)
    assert chunked.ttft_ms > whole.ttft_ms  # six passes pay six overheads and re-read the weights
    assert chunked.tpot_ms == whole.tpot_ms
    with pytest.raises(InputError, match="max_batched_tokens"):
        predict_latency(spec, H100, max_batched_tokens=0, **kw)  # type: ignore[arg-type]


def test_fp8_gemms_use_their_own_efficiency() -> None:
    fp8 = resolve_model("llama-3.1-70b", weight_dtype="fp8")
    bf16 = resolve_model("llama-3.1-70b")
    kw = dict(tp=4, link=NV4, batch=1, input_len=4096, output_len=8)

    def prefill_compute(spec: object, cfg: PerfConfig) -> float:
        return predict_latency(spec, H100, config=cfg, **kw).prefill.compute_ms  # type: ignore[arg-type]

    slow, fast = PerfConfig(eta_flops_fp8=0.3), PerfConfig(eta_flops_fp8=0.6)
    assert prefill_compute(fp8, slow) > 1.5 * prefill_compute(fp8, fast)
    assert prefill_compute(bf16, slow) == prefill_compute(bf16, fast)  # BF16 GEMMs do not use it
    # A100 has no FP8 tensor cores: FP8 weights run BF16 GEMMs at the BF16 efficiency
    a100 = get_gpu("A100-SXM-80GB")
    one = predict_latency(fp8, a100, config=slow, **kw).prefill.compute_ms  # type: ignore[arg-type]
    two = predict_latency(fp8, a100, config=fast, **kw).prefill.compute_ms  # type: ignore[arg-type]
    assert one == two


def test_moe_grouped_gemm_tiles_and_routing_kernels() -> None:
    moe = resolve_model("mixtral-8x7b")
    dense = resolve_model("llama-3.1-8b")
    kw = dict(tp=2, link=NV4, batch=1, input_len=64, output_len=8)
    small, big = PerfConfig(moe_tile_m=1.0), PerfConfig(moe_tile_m=128.0)
    d_small = predict_latency(moe, H100, config=small, **kw).decode  # type: ignore[arg-type]
    d_big = predict_latency(moe, H100, config=big, **kw).decode  # type: ignore[arg-type]
    assert d_big.compute_ms > 10 * d_small.compute_ms  # 2 experts x 128 padded rows vs 2 x 1 row
    assert d_big.memory_ms == d_small.memory_ms
    r1 = predict_latency(dense, H100, config=small, **kw).decode  # type: ignore[arg-type]
    r2 = predict_latency(dense, H100, config=big, **kw).decode  # type: ignore[arg-type]
    assert r1 == r2  # dense models have no grouped GEMM
    with_routing = predict_latency(moe, H100, config=PerfConfig(moe_layer_us=100.0), **kw)  # type: ignore[arg-type]
    without = predict_latency(moe, H100, config=PerfConfig(moe_layer_us=0.0), **kw)  # type: ignore[arg-type]
    assert with_routing.decode.small_kernels_ms - without.decode.small_kernels_ms == pytest.approx(32 * 0.1)


def test_mla_has_its_own_term() -> None:
    ds = resolve_model("deepseek-v3", weight_dtype="fp8")
    llama = resolve_model("llama-3.1-70b")
    h200 = get_gpu("H200")
    kw = dict(tp=8, link=NV4, batch=1, input_len=1600, output_len=600)
    a, b = PerfConfig(mla_layer_us=0.0), PerfConfig(mla_layer_us=50.0)
    gap = predict_latency(ds, h200, config=b, **kw).tpot_ms - predict_latency(ds, h200, config=a, **kw).tpot_ms  # type: ignore[arg-type]
    assert gap == pytest.approx(61 * 0.05)
    assert predict_latency(llama, h200, config=a, **kw).tpot_ms == predict_latency(llama, h200, config=b, **kw).tpot_ms  # type: ignore[arg-type]
    # absorbed MLA decode attention: 2 (2 x 512 + 64) FLOPs per head and context token, not 4 x 192
    long = predict_latency(ds, h200, config=a, tp=8, link=NV4, batch=64, input_len=8000, output_len=2)
    short = predict_latency(ds, h200, config=a, tp=8, link=NV4, batch=64, input_len=1000, output_len=2)
    per_token = (long.decode.attention_ms - short.decode.attention_ms) * 1e-3 / (64 * 7000)
    flops = 2 * (2 * 512 + 64) * 128 * 61 / 8
    kv_bytes = kv_bytes_per_token_per_layer(ds, 8) * 61
    expect = flops / (h200.bf16_flops * a.eta_attn) + kv_bytes / (h200.hbm_bandwidth * a.eta_kv)
    assert per_token == pytest.approx(expect, rel=0.01)
    assert long.decode.compute_ms == short.decode.compute_ms  # attention is its own kernel, not a GEMM


def test_prediction_uses_the_active_profile() -> None:
    spec = resolve_model("llama-3.1-8b")
    kw = dict(tp=1, link=NV4, batch=2, input_len=100, output_len=10)
    slow = Profile(entries=(ProfileEntry(gpu="H100-SXM", config=PerfConfig(step_overhead_ms=50.0)),))
    base = predict_latency(spec, H100, **kw)  # type: ignore[arg-type]
    with use_profile(slow):
        inside = predict_latency(spec, H100, **kw)  # type: ignore[arg-type]
        elsewhere = predict_latency(spec, get_gpu("H200"), **kw)  # type: ignore[arg-type]
        step = StepCost(spec, H100, tp=1, link=NV4)
        assert step.decode_ms(2, 105) == pytest.approx(inside.tpot_ms, rel=1e-9)
    assert inside.decode.overhead_ms == 50.0
    # no entry for H200 in the user's profile: the shipped default profile's coefficients
    assert elsewhere.decode.overhead_ms == default_profile().config_for("H200", "bf16").step_overhead_ms
    assert base.decode.overhead_ms == default_profile().config_for("H100-SXM", "bf16").step_overhead_ms


def _synthetic(cfg: PerfConfig) -> list[Sample]:
    return made_by(cfg)


def test_fit_recovers_the_coefficients_that_made_the_samples() -> None:
    truth = PerfConfig(eta_mem=0.7, step_overhead_ms=1.5, prefill_overhead_ms=6.0)
    samples = _synthetic(truth)
    fields = ("eta_mem", "step_overhead_ms", "prefill_overhead_ms")
    fitted = fit_config(samples, base=PerfConfig(), fields=fields)
    assert fitted.eta_mem == pytest.approx(0.7, rel=0.03)
    assert fitted.step_overhead_ms == pytest.approx(1.5, abs=0.15)
    assert fitted.prefill_overhead_ms == pytest.approx(6.0, abs=0.6)
    assert all(abs(e) < 0.02 for s in samples for e in relative_errors(s, fitted).values())
    # leave-one-out: every held-out sample is still predicted (refit on the other five)
    loo = leave_one_out(samples, fields=fields)
    assert [s.source for s, _ in loo] == [s.source for s in samples]
    assert all(set(errs) == {"ttft", "tpot", "throughput"} for _, errs in loo)
    assert max(abs(e) for _, errs in loo for e in errs.values()) < 0.05


def test_leave_group_out_holds_out_a_whole_group() -> None:
    truth = PerfConfig(eta_mem=0.7, step_overhead_ms=1.5)
    samples = _synthetic(truth)
    by_gpu = leave_group_out(samples, lambda s: s.gpu, fields=("eta_mem", "step_overhead_ms"))
    assert [s.source for s, _ in by_gpu] == [s.source for s in samples]  # every GPU has others to fit on
    # one truth: any group predicts it (within 10 %: without the H100 rows, two samples are left, on which
    # eta_mem and step_overhead_ms trade against each other and the fit's weak pull to the defaults; 8 %)
    assert max(abs(e) for _, errs in by_gpu for e in errs.values()) < 0.10
    # a held-out group is not in its own fit: samples 4 times slower on one GPU come out about 4x too fast
    slow = [s.model_copy(update={"tpot_ms": s.tpot_ms * 4}) if s.gpu == "H200" else s for s in samples]
    errors = dict((s.source, e) for s, e in leave_group_out(slow, lambda s: s.gpu, fields=("step_overhead_ms",)))
    assert errors["s5"]["tpot"] < -0.6
    assert leave_group_out(samples, lambda s: "all", fields=("eta_mem",)) == []  # nothing left to fit on


def test_fit_stays_within_bounds_and_rejects_bad_fields() -> None:
    # samples ten times slower than any bounded config can make them: the fit pins to a bound
    samples = [
        s.model_copy(update={"tpot_ms": (s.tpot_ms or 0.0) * 10, "ttft_ms": None, "tokens_per_s": None})
        for s in _synthetic(PerfConfig())
    ]
    fitted = fit_config(samples, fields=("eta_mem",))
    assert 0.3 <= fitted.eta_mem < 0.32
    with pytest.raises(InputError, match="no field"):
        fit_config(samples, fields=("eta_nothing",))
    with pytest.raises(InputError, match="bounded float"):
        fit_config(samples, fields=("kernels_per_layer",))
    with pytest.raises(InputError, match="no samples"):
        fit_config([])


def test_fit_profile_records_leave_one_out_errors() -> None:
    samples = _synthetic(PerfConfig(step_overhead_ms=1.0))
    profile = fit_profile(samples, name="t", source="synthetic", fields=("step_overhead_ms",), scoped=False)
    (shared,) = [e for e in profile.entries if e.gpu == "*"]
    assert shared.samples == 6 and set(shared.loo_mean_abs_error) == {"ttft", "tpot", "throughput"}
    # H100-SXM has 4 samples: enough for its own entry when one field is fitted (2 per field)
    assert {(e.gpu, e.weight_dtype) for e in profile.entries} >= {("*", "*"), ("H100-SXM", "bf16")}
    assert profile.config_for("H100-SXM", "bf16").step_overhead_ms == pytest.approx(1.0, abs=0.05)
    one = fit_profile(samples[:1], name="t", source="one", fields=("step_overhead_ms",), scoped=False)
    assert one.entries[0].samples == 1 and one.entries[0].loo_mean_abs_error == {}  # nothing to hold out


def test_a_calibrated_profile_prices_only_what_it_was_fitted_on() -> None:
    """A user's profile (scoped, calibrate's default) has no catch-all: one shared entry per GPU, engine and
    model family its samples ran; any other setup falls back to the shipped profile."""
    samples = [s.model_copy(update={"engine": "vllm"}) for s in _synthetic(PerfConfig(step_overhead_ms=40.0))]
    profile = fit_profile(samples, name="mine", source="synthetic", fields=("step_overhead_ms",))
    assert all(e.gpu != "*" and e.engine == "vllm" and e.model_family == "llama" for e in profile.entries)
    assert {e.gpu for e in profile.entries} == {"H100-SXM", "A100-SXM-80GB", "H200"}
    llama, deepseek = resolve_model("llama-3.1-70b"), resolve_model("deepseek-v3")
    kw = dict(tp=8, link=NV4, batch=4, input_len=1000, output_len=100)
    shipped = default_profile().config_for("H200", "fp8").step_overhead_ms
    with use_profile(profile):
        fitted = predict_latency(llama, get_gpu("H200"), engine="vllm", **kw)  # type: ignore[arg-type]
        other_family = predict_latency(deepseek, get_gpu("H200"), engine="vllm", **kw)  # type: ignore[arg-type]
        other_engine = predict_latency(llama, get_gpu("H200"), engine="sglang", **kw)  # type: ignore[arg-type]
        other_gpu = predict_latency(llama, get_gpu("B200"), engine="vllm", **kw)  # type: ignore[arg-type]
    assert fitted.decode.overhead_ms == pytest.approx(40.0, abs=1.0)
    assert other_family.decode.overhead_ms == shipped  # DeepSeek-V3 is not repriced by a Llama calibration
    assert other_engine.decode.overhead_ms == shipped
    assert other_gpu.decode.overhead_ms == default_profile().config_for("B200", "bf16").step_overhead_ms


def test_the_most_specific_profile_entry_wins() -> None:
    entries = (
        ProfileEntry(config=PerfConfig(eta_mem=0.5)),
        ProfileEntry(engine="sglang", config=PerfConfig(eta_mem=0.55)),
        ProfileEntry(gpu="H100-SXM", config=PerfConfig(eta_mem=0.6)),
        ProfileEntry(gpu="H100-SXM", engine="sglang", config=PerfConfig(eta_mem=0.65)),
        ProfileEntry(gpu="H100-SXM", engine="sglang", model_family="llama", config=PerfConfig(eta_mem=0.7)),
    )
    p = Profile(entries=entries)
    find = p.config_for
    assert find("H100-SXM", "bf16", engine="sglang", family="llama").eta_mem == 0.7
    assert find("H100-SXM", "bf16", engine="sglang", family="qwen2").eta_mem == 0.65
    assert find("H100-SXM", "bf16", engine="vllm", family="llama").eta_mem == 0.6  # no sglang entry applies
    # as specific as each other (one named field): the GPU outranks the engine, the first entry wins a tie
    assert Profile(entries=(entries[1], entries[2])).config_for("H100-SXM", "bf16", engine="sglang").eta_mem == 0.6
    assert Profile(entries=(entries[2], entries[1])).config_for("H100-SXM", "bf16", engine="sglang").eta_mem == 0.6
    twins = (ProfileEntry(gpu="H200", config=PerfConfig(eta_mem=0.4)), ProfileEntry(gpu="H200", config=PerfConfig()))
    assert Profile(entries=twins).config_for("H200", "bf16").eta_mem == 0.4
    assert find("H200", "bf16", engine="sglang").eta_mem == 0.55
    assert find("H200", "bf16", engine=None).eta_mem == 0.5  # an unnamed engine is matched by * only
    assert Profile(entries=entries[1:2]).find("H200", "bf16") is None
    # an entry's engine is the cost model's name; a name no prediction uses is refused
    assert ProfileEntry(engine="TRTLLM", config=PerfConfig()).engine == "tensorrt-llm-pytorch"
    with pytest.raises(ValueError, match=r"vllm-0\.6\.3"):
        ProfileEntry(engine="vllm-0.6.3", config=PerfConfig())
    versioned = _synthetic(PerfConfig())[0].model_copy(update={"engine": "vllm-0.6.3"})
    with pytest.raises(InputError, match=r"engine 'vllm-0\.6\.3' is not one the cost model knows"):
        fit_profile([versioned], name="t", source="t", fields=("eta_mem",))


def test_default_profile_is_shipped_with_its_leave_one_out_errors() -> None:
    """The shipped profile (fitted on anchors-train.json by benchmarks/anchors_loo.py) loads and says
    what it was fitted on; the accuracy figures themselves are leave-one-out, in docs/cost-model.md."""
    profile = default_profile()
    assert profile.name == "default" and "anchors-train.json" in profile.source
    shared = profile.entries[0]
    assert shared.gpu == "*" and shared.samples > 20
    assert set(shared.loo_mean_abs_error) == {"ttft", "tpot", "throughput"}


def test_l40s_box_defaults_to_p2p_on() -> None:
    on, off = get_link("pcie4"), get_link("pcie4-nop2p")
    assert get_gpu("L40S").native_link == "pcie4"
    big = 64 * 2**20
    assert off.allreduce_us(big, 4) > 2 * on.allreduce_us(big, 4)
    assert off.allreduce_us(big, 8) > 5 * on.allreduce_us(big, 8)
    # the same measured n=2 curve (the AIC box's n=2 is P2P on; only its n=4/8 are not)
    assert on.allreduce_us(big, 2) == pytest.approx(off.nccl_measured[2].time_us(big, 2), rel=1e-9)


def test_decode_step_is_linear_in_context() -> None:
    """The simulator's macro steps charge k steps at the mid context: exact only if a decode step's
    time is linear in the KV it reads, which the smooth roofline must not break."""
    cost = StepCost(resolve_model("llama-3.1-70b"), H100, tp=4, link=NV4, config=PerfConfig(roofline_p=3.0))
    a, b, c = (cost.decode_ms(16, ctx) for ctx in (1000.0, 3000.0, 5000.0))
    assert b - a > 0
    assert c - b == pytest.approx(b - a, rel=1e-12)


def _probe(**kw: object) -> Sample:
    base: dict[str, object] = dict(source="p", model="llama-3.1-8b", gpu="H100-SXM", weight_dtype="bf16",
                                   input_len=1000, output_len=200)  # fmt: skip
    return Sample.model_validate(base | kw)


def test_ttft_under_load_waits_half_a_step_of_the_running_batch() -> None:
    cfg = PerfConfig()
    model = PassModel(resolve_model("llama-3.1-8b"), H100, tp=1, pp=1, link=NV4, pp_link=NV4, cfg=cfg)
    alone = predict_sample(_probe(batch=1, ttft_ms=1.0), cfg)["ttft_ms"]
    first = model.step(chunks=[(0, 1000)])
    assert first is not None and alone == pytest.approx(first.total_ms, rel=1e-9)  # nothing running: no wait
    loaded = predict_sample(_probe(batch=5, ttft_ms=1.0), cfg)["ttft_ms"]
    running = model.step(decode_seqs=4, decode_context=4 * 1100)
    mixed = model.step(decode_seqs=4, decode_context=4 * 1100, chunks=[(0, 1000)])
    assert running is not None and mixed is not None
    assert loaded == pytest.approx(running.total_ms / 2 + mixed.total_ms, rel=1e-9)


def test_throughput_of_a_finite_run_counts_its_waves_and_its_arrival_rate() -> None:
    cfg = PerfConfig()
    steady = predict_sample(_probe(batch=100, tokens_per_s=1.0), cfg)["tokens_per_s"]
    whole = predict_sample(_probe(batch=100, num_requests=300, tokens_per_s=1.0), cfg)["tokens_per_s"]
    assert whole == pytest.approx(steady, rel=1e-9)  # three full waves
    # 101 requests: a full wave and a wave of one, which takes nearly as long as a decode-bound full one
    ragged = predict_sample(_probe(batch=100, num_requests=101, tokens_per_s=1.0), cfg)["tokens_per_s"]
    assert 0.5 * steady < ragged < 0.8 * steady
    # open loop well under capacity: the run serves its arrivals, 250 over 250 s, plus the last one's latency
    offered = predict_sample(_probe(batch=4, request_rate=1.0, num_requests=250, tokens_per_s=1.0), cfg)
    assert 0.99 * 1.0 * 200 < offered["tokens_per_s"] < 1.0 * 200
    # an endless run under capacity serves what arrives (2 requests/s is at batch 4's capacity since the
    # GEMM kernels' fixed cost, PerfConfig.gemm_us: 1.5)
    endless = predict_sample(_probe(batch=4, request_rate=1.5, tokens_per_s=1.0), cfg)["tokens_per_s"]
    assert endless == pytest.approx(1.5 * 200)


def test_comm_scale_applies_to_all_reduces_except_over_pcie() -> None:
    spec = resolve_model("llama-3.1-70b")
    l40s = get_gpu("L40S")

    def comm(gpu: object, link: object, tp: int, scale: float) -> float:
        model = PassModel(spec, gpu, tp=tp, pp=1, link=link, pp_link=link, cfg=PerfConfig(comm_scale=scale))  # type: ignore[arg-type]
        return model.allreduce_ms(512)

    assert comm(H100, NV4, 4, 1.2) == pytest.approx(1.2 * comm(H100, NV4, 4, 1.0), rel=1e-12)
    assert comm(H100, NV4, 4, 1.0) == pytest.approx(2 * 80 * NV4.allreduce_us(512 * 8192 * 2, 4) * 1e-3)
    pcie = get_link("pcie4")
    assert comm(l40s, pcie, 4, 1.2) == comm(l40s, pcie, 4, 1.0) > 0  # PCIe: the table as measured/derived
    assert comm(H100, NV4, 1, 1.2) == 0.0
    across = two_level_link("ib-ndr", "nvlink4", 4)  # TP8 over two nodes: never cheaper than inside one
    assert comm(H100, across, 8, 1.2) == pytest.approx(1.2 * comm(H100, across, 8, 1.0), rel=1e-12)
    assert comm(H100, across, 8, 1.2) > comm(H100, NV4, 8, 1.2)


def test_host_launch_cost_of_a_prefill_depends_on_the_engine() -> None:
    spec = resolve_model("llama-3.1-8b")
    cfg = PerfConfig(prefill_kernel_factor=5.0)
    kw = dict(tp=1, link=NV4, batch=1, input_len=512, output_len=8, config=cfg)
    graphs = predict_latency(spec, H100, engine="tensorrt-llm", **kw)  # type: ignore[arg-type]
    nim = predict_latency(spec, H100, engine="nvidia-nim", **kw)  # type: ignore[arg-type]
    python = predict_latency(spec, H100, engine="vllm", **kw)  # type: ignore[arg-type]
    unnamed = predict_latency(spec, H100, **kw)  # type: ignore[arg-type]
    assert graphs.prefill.small_kernels_ms == nim.prefill.small_kernels_ms == graphs.decode.small_kernels_ms
    assert python.prefill.small_kernels_ms == pytest.approx(5.0 * graphs.prefill.small_kernels_ms)
    assert unnamed.ttft_ms == python.ttft_ms  # no engine named: toposched launches vLLM/SGLang
    assert python.tpot_ms == graphs.tpot_ms  # decode steps replay CUDA graphs on both
    step = StepCost(spec, H100, tp=1, link=NV4, config=cfg, engine="tensorrt-llm")
    assert step.prefill_ms(1, 512) == pytest.approx(graphs.ttft_ms, rel=1e-12)


def test_mla_prefill_attention_uses_the_mean_of_its_qk_and_v_head_dims() -> None:
    ds = resolve_model("deepseek-v3", weight_dtype="fp8")
    h200 = get_gpu("H200")
    cfg = PerfConfig()
    model = PassModel(ds, h200, tp=8, pp=1, link=NV4, pp_link=NV4, cfg=cfg)
    step = model.step(chunks=[(0, 4096)])
    assert step is not None
    # a whole prompt reads no earlier KV; causal QK (192 per head) + PV (128 per head) = 2 S^2 x 160 per head,
    # at the efficiency of a 4,096-token prompt (attn_s_half more keys per query token), and one kernel's
    # fixed cost per layer
    flops = 2 * 4096 * (4096 + cfg.attn_s_half) * 128 * (128 + 64 + 128) / 2 * 61 / 8
    expect = flops / (h200.bf16_flops * cfg.eta_attn) + 61 * cfg.attn_us * 1e-6
    assert step.attention_ms == pytest.approx(expect * 1e3, rel=1e-9)


def test_a_rate_above_what_the_concurrency_cap_serves_runs_as_the_closed_loop() -> None:
    cfg = PerfConfig()
    closed = predict_sample(_probe(batch=4, num_requests=400, tokens_per_s=1.0), cfg)["tokens_per_s"]
    flooded = predict_sample(_probe(batch=4, request_rate=1000.0, num_requests=400, tokens_per_s=1.0), cfg)
    assert flooded["tokens_per_s"] == pytest.approx(closed, rel=1e-12)
    endless = predict_sample(_probe(batch=4, request_rate=1000.0, tokens_per_s=1.0), cfg)["tokens_per_s"]
    assert endless < 1000.0 * 200 / 10  # bounded by what 4 sequences serve, not by the offered rate
