"""The MoE term per engine against NVIDIA's fused-MoE tables (aiconfigurator-core 0.12.0;
benchmarks/moe_tables.py --per-engine): one engine-blind MoE term misses them by 26-32 %, a fit per
engine (grouped-GEMM efficiency and HBM fraction per dtype, efficiency falling with thin experts) gets
TensorRT-LLM within 9 %, vLLM's BF16 and block-FP8 within 10 % and SGLang's block FP8 within 9 %."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import load_benchmark
from toposched.perf.coefficients import PerfConfig
from toposched.perf.engine_names import ENGINE_ALIASES, engine_of

# what `benchmarks/moe_tables.py --per-engine` recommends (eta_moe x the dense GEMM efficiency of the
# dtype, mem_moe x eta_mem; no fp8 entry where the engine has no per-tensor FP8 rows)
RECOMMENDED = {
    "vllm": dict(moe_tile_m=45.1, moe_layer_us=21.8, moe_n_half=37.8,
                 eta_moe={"bfloat16": 0.766, "fp8": 0.329, "fp8_block": 0.573},
                 mem_moe={"bfloat16": 1.064, "fp8": 0.196, "fp8_block": 1.135}),
    "sglang": dict(moe_tile_m=19.8, moe_layer_us=7.81, moe_n_half=20.6,
                   eta_moe={"bfloat16": 0.543, "fp8_block": 0.651},
                   mem_moe={"bfloat16": 0.909, "fp8_block": 0.994}),
    "trtllm": dict(moe_tile_m=25.2, moe_layer_us=18.3, moe_n_half=366,
                   eta_moe={"bfloat16": 1.078, "fp8": 1.382, "fp8_block": 0.652},
                   mem_moe={"bfloat16": 1.051, "fp8": 1.060, "fp8_block": 1.073}),
}  # fmt: skip
# mean abs error bounds, in sample / leave-one-GPU-out: measured (2-core AMD EPYC VM) + about a point
BOUNDS = {"vllm": (0.135, 0.185), "sglang": (0.165, 0.175), "trtllm": (0.09, 0.095)}
# dtype cells within 15 % in sample and held out (measured: vLLM BF16 9.4/10.8 %, block FP8 6.5/7.3 %;
# SGLang block FP8 6.5/7.9 %; TensorRT-LLM 5.9/6.1, 6.9/7.0, 9.1/10.3 %)
WITHIN_15 = {("vllm", "bfloat16"), ("vllm", "fp8_block"), ("sglang", "fp8_block"), ("trtllm", "bfloat16"),
             ("trtllm", "fp8"), ("trtllm", "fp8_block")}  # fmt: skip


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    return load_benchmark("moe_tables")


@pytest.fixture(scope="module")
def rows(bench):  # type: ignore[no-untyped-def]
    return bench.load()


@pytest.fixture(scope="module")
def evaluated(bench, rows):  # type: ignore[no-untyped-def]
    return {e: bench.evaluate(rows, e) for e in ("vllm", "sglang", "trtllm")}


def _mae(e: np.ndarray) -> float:
    return float(np.abs(e[~np.isnan(e)]).mean())


def test_the_vectorised_form_is_the_models_moe_layer(bench, rows) -> None:  # type: ignore[no-untyped-def]
    """With no per-engine terms the per-engine form is ``predict_us``'s (the model's MoE layer)."""
    c = PerfConfig()
    plain = bench.EngineFit("any", c.moe_tile_m, c.moe_layer_us, 0.0, 0.0, dict.fromkeys(bench.DTYPES, 1.0),
                            dict.fromkeys(bench.DTYPES, 1.0))  # fmt: skip
    sample = rows[::37]
    ours = bench.engine_predict_us(bench.arrays(sample), plain)
    theirs = [bench.predict_us(r, (c.moe_tile_m, c.moe_layer_us)) for r in sample]
    assert ours == pytest.approx(theirs, rel=1e-9)
    # engine-blind, at PerfConfig's defaults, it misses the tables by a quarter on average
    assert _mae(bench.engine_predict_us(bench.arrays(rows), plain) / bench.arrays(rows)["measured"] - 1) > 0.24


def test_the_per_engine_fit_gives_the_recommended_coefficients(evaluated) -> None:  # type: ignore[no-untyped-def]
    for engine, want in RECOMMENDED.items():
        got = evaluated[engine].fit
        for name in ("moe_tile_m", "moe_layer_us", "moe_n_half"):
            assert getattr(got, name) == pytest.approx(want[name], rel=0.03), (engine, name)
        for name in ("eta_moe", "mem_moe"):
            assert set(getattr(got, name)) == set(want[name]), (engine, name)  # no figure without rows
            for dtype, value in want[name].items():
                assert getattr(got, name)[dtype] == pytest.approx(value, rel=0.03), (engine, name, dtype)


def test_each_engine_is_fitted_in_sample_and_on_a_gpu_it_did_not_see(evaluated) -> None:  # type: ignore[no-untyped-def]
    for engine, (in_bound, held_bound) in BOUNDS.items():
        ev = evaluated[engine]
        assert _mae(ev.in_sample) < in_bound, engine
        assert _mae(ev.held["gpu"]) < held_bound, engine
        assert not np.isnan(ev.held["gpu"]).any()  # every GPU's dtypes are on another GPU too
    for engine, dtype in WITHIN_15:
        ins, held = evaluated[engine].part(dtype)
        assert max(_mae(ins), _mae(held)) < 0.15, (engine, dtype)
    # what the per-engine term does not describe: vLLM's per-tensor FP8 MoE (23.4 % in sample, 34.0 % held
    # out: its H100 and H200 kernels disagree) and SGLang's BF16 Triton MoE (20.3 %)
    assert _mae(evaluated["vllm"].part("fp8")[1]) > 0.25
    assert _mae(evaluated["sglang"].part("bfloat16")[0]) > 0.18


def test_the_width_curve_is_what_a_flat_efficiency_misses(bench, rows, evaluated) -> None:  # type: ignore[no-untyped-def]
    """TensorRT-LLM's thin experts (Qwen3-235B's 1,536 / TP) run far below its wide ones: with a flat
    efficiency of its own (only the dense GEMMs' width curve, ``gemm_n_half``) an expert shape it did not
    see is missed by 15.8 %, with n / (n + moe_n_half) on top by 8.7 %."""
    mine = bench.engine_rows(rows, "trtllm")
    flat = _mae(bench.engine_held_out(mine, "model", bench.FORMS[0]))
    assert flat > 0.15
    assert _mae(evaluated["trtllm"].held["model"]) < 0.095


def test_cells_without_rows_or_beyond_hbm_are_not_fitted(bench, rows, evaluated) -> None:  # type: ignore[no-untyped-def]
    # the DeepSeek-V3 block-FP8 rows of vLLM and SGLang read their experts faster than HBM peak allows
    assert bench.beyond_hbm(rows) == {("vllm", "DeepSeek-V3", "fp8_block"), ("sglang", "DeepSeek-V3", "fp8_block")}
    assert bench.hbm_fraction([r for r in rows if r.engine == "trtllm"]).max() < 1.0
    assert all(r.model != "DeepSeek-V3" or r.dtype != "fp8_block" for r in bench.engine_rows(rows, "vllm"))
    # SGLang has no per-tensor FP8 rows: no figure, and a prediction says so rather than inventing one
    assert not any(r.engine == "sglang" and r.dtype == "fp8" for r in rows)
    fp8 = [r for r in rows if r.engine == "vllm" and r.dtype == "fp8"][:3]
    assert np.isnan(bench.engine_predict_us(bench.arrays(fp8), evaluated["sglang"].fit)).all()


def test_every_engine_of_the_cost_model_has_a_table(bench, evaluated) -> None:  # type: ignore[no-untyped-def]
    assert set(bench.ENGINE_TABLE) == {*ENGINE_ALIASES.values(), None}
    for name in (*ENGINE_ALIASES, None):
        assert bench.ENGINE_TABLE[engine_of(name)] in evaluated
    assert bench.ENGINE_TABLE["nvidia-nim"] == bench.ENGINE_TABLE["tensorrt-llm"] == "trtllm"
