"""What the engines are told: the model asked for, and every setting the plan's memory relies on (issue 14)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.binding.builders import make_doc, make_placement
from tests.conftest import RunCli
from toposched.binding.engines import build_launches
from toposched.binding.model_ref import served_model
from toposched.binding.plan_doc import PlanDoc, parse_plan, plan_json
from toposched.binding.ray import ray_specs
from toposched.errors import InputError
from toposched.solver.request import ExpertReport, HbmShare, PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.presets import load_preset
from toposched.workload import MemoryConfig, resolve_model

GIB = 2**30


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _doc(preset: str, model: str, **kw: Any) -> PlanDoc:
    """Plan on a preset and read the document back, as ``plan --json | launch --plan`` does."""
    cluster = load_preset(preset)
    request = PlacementRequest(id="plan", model=model, **kw)
    outcome = Scheduler(cluster).place(request)
    assert outcome.placements, outcome.unplaced
    return parse_plan(plan_json(outcome.placements, [], request, cluster, policy="slo", source=preset), "p.json")


def _argv(doc: PlanDoc, engine: str) -> list[str]:
    (launch,) = build_launches(doc.placements, doc.request, doc.cluster, engine)  # type: ignore[arg-type]
    return launch.argv


# --- item 6: the model asked for is the model served ---------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "served"),
    [
        ("llama-3.1-70b-instruct", "meta-llama/Llama-3.1-70B-Instruct"),
        ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-70B-Instruct"),
        ("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B"),
        ("llama-3-70b-instruct", "meta-llama/Meta-Llama-3-70B-Instruct"),
        ("mixtral-8x7b-instruct", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
        ("qwen2.5-72b-instruct", "Qwen/Qwen2.5-72B-Instruct"),
        ("Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-72B"),
    ],
)
def test_the_model_asked_for_is_the_model_served(asked: str, served: str) -> None:
    assert served_model(asked) == served
    entry_id = resolve_model(asked).hf_id
    assert entry_id is not None
    # the launch of a plan for that name serves it too, on both engines and under Ray
    doc = make_doc(load_preset("hgx-h100"), make_placement([("hgx-h100", range(8))], tp=8), model=asked)
    for engine, flag in (("vllm", "serve"), ("sglang", "--model-path")):
        assert _value(_argv(doc, engine), flag) == served
    (spec,) = ray_specs(doc)
    assert spec.argv[2] == served


def test_a_catalog_name_serves_its_own_id_and_a_path_its_folder(tmp_path: Path) -> None:
    assert served_model("llama-3.1-405b") == resolve_model("llama-3.1-405b").hf_id
    config = tmp_path / "my model" / "config.json"
    config.parent.mkdir()
    config.write_text((Path(__file__).parents[2] / "src/toposched/data/models/Meta-Llama-3.1-8B.json").read_text())
    assert served_model(str(config)) == str(config.parent)
    assert served_model(str(config.parent)) == str(config.parent)
    with pytest.raises(InputError, match="did you mean"):
        served_model("llama-3.1-70b-instruc")


# --- item 7: every setting the plan relies on -----------------------------------------------------------


def test_an_fp8_plan_keeps_its_memory_plan_on_both_engines() -> None:
    """405B in FP8 on 8 H100: SGLang used to get none of it and load BF16 (810 GB) into 640 GB."""
    doc = _doc("hgx-h100", "llama-3.1-405b", weight_dtype="fp8", max_model_len=16384, concurrent_seqs=12)
    (p,) = doc.placements
    hbm = p.hbm_per_gpu
    cfg = MemoryConfig()
    sglang = _argv(doc, "sglang")
    assert _value(sglang, "--quantization") == "fp8"
    assert _value(sglang, "--context-length") == "16384"
    assert _value(sglang, "--max-running-requests") == "12"
    assert _value(sglang, "--chunked-prefill-size") == str(cfg.max_num_batched_tokens)
    # SGLang's static fraction is (weights + KV pool) / GPU memory; the plan's total is memory x 0.92
    fraction = float(_value(sglang, "--mem-fraction-static"))
    assert fraction == math.floor((hbm.weights + hbm.kv) / hbm.total * cfg.gpu_memory_utilization * 1000) / 1000
    assert 0.5 < fraction < cfg.gpu_memory_utilization
    vllm = _argv(doc, "vllm")
    # a BF16 checkpoint quantized while loading: vLLM 0.33's fp8 method reads FP8 checkpoints only
    # (quantization/fp8.py raises "no longer supports online quantization"); fp8_per_tensor does it
    assert _value(vllm, "--quantization") == "fp8_per_tensor"
    assert _value(vllm, "--max-model-len") == "16384"
    assert _value(vllm, "--gpu-memory-utilization") == "0.92"
    assert _value(vllm, "--max-num-seqs") == "12"
    assert _value(vllm, "--max-num-batched-tokens") == str(cfg.max_num_batched_tokens)
    assert _value(vllm, "--shutdown-timeout") == "30"  # drain on SIGTERM (vLLM's default 0 aborts at once)
    for argv in (sglang, vllm):
        assert "--dtype" not in argv and "--kv-cache-dtype" not in argv


def test_fallbacks_and_dtypes_reach_the_engines() -> None:
    doc = _doc("hgx-h100", "llama-3.1-8b", allowed_tp=(1,))
    (p,) = doc.placements
    # the activation-checkpointing fallback sized the activation peak for its smaller token budget
    # (a plan made before operating points, which carries no token budget of its own)
    ckpt = p.model_copy(
        update={"fallbacks": ("fp8-kv", "activation-checkpointing"), "kv_dtype": "fp8", "max_num_batched_tokens": None}
    )
    for engine, flag in (("vllm", "--max-num-batched-tokens"), ("sglang", "--chunked-prefill-size")):
        argv = build_launches([ckpt], doc.request, doc.cluster, engine)[0].argv  # type: ignore[arg-type]
        assert _value(argv, flag) == str(MemoryConfig().checkpoint_batched_tokens)
        assert _value(argv, "--kv-cache-dtype") == ("fp8" if engine == "vllm" else "fp8_e4m3")
    # FP16 asked of a BF16 checkpoint -> --dtype; INT4 from a BF16 checkpoint cannot be made while loading
    fp16 = doc.request.model_copy(update={"weight_dtype": "fp16"})
    for engine in ("vllm", "sglang"):
        argv = build_launches([p], fp16, doc.cluster, engine)[0].argv  # type: ignore[arg-type]
        assert _value(argv, "--dtype") == "float16" and "--quantization" not in argv
    int4 = doc.request.model_copy(update={"weight_dtype": "int4"})
    with pytest.raises(InputError, match=r"plans int4 weights, but llama-3\.1-8b is a bf16 checkpoint"):
        build_launches([p], int4, doc.cluster, "sglang")
    # an explicit 16-bit KV cache is the model's dtype ("auto"), or refused when it is not
    bf16_kv = p.model_copy(update={"kv_dtype": "bf16"})
    assert "--kv-cache-dtype" not in build_launches([bf16_kv], doc.request, doc.cluster, "vllm")[0].argv
    fp16_kv = p.model_copy(update={"kv_dtype": "fp16"})
    with pytest.raises(InputError, match="plans a fp16 KV cache, but the engine computes in bf16"):
        build_launches([fp16_kv], doc.request, doc.cluster, "vllm")


def test_vllm_refuses_an_ep_it_cannot_express() -> None:
    """vLLM's EP group is the whole TP group (EP = TP x DP); SGLang has --ep-size."""
    cluster = load_preset("hgx-h200")
    p = make_placement([("hgx-h200", range(4))], tp=4, model="mixtral-8x7b").model_copy(update={"ep": 2})
    request = PlacementRequest(id="plan", model="mixtral-8x7b", ep=2)
    with pytest.raises(InputError, match="ep=2 with tp=4; vLLM has no expert-parallel size"):
        build_launches([p], request, cluster, "vllm")
    (launch,) = build_launches([p], request, cluster, "sglang")
    assert _value(launch.argv, "--ep-size") == "2"


# --- item 10: a context the model does not have ----------------------------------------------------------


def test_launch_refuses_a_context_longer_than_the_model(run_cli: RunCli, tmp_path: Path) -> None:
    plan = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--tp", "4", "--json")
    data = json.loads(plan.stdout)
    data["request"]["max_model_len"] = 200_000  # a hand-edited (or stale) plan
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    for engine in ("vllm", "sglang"):
        result = run_cli("launch", engine, "--plan", str(path), "--json")
        assert result.exit_code == 2 and result.stdout == ""
        assert "max_model_len 200000 is longer than the 131072-token context of llama-3.1-70b" in result.stderr
        assert "fix: use --max-model-len 131072 or less" in result.stderr
    data["request"]["max_model_len"] = 131_072  # the limit itself is fine
    path.write_text(json.dumps(data))
    result = run_cli("launch", "vllm", "--plan", str(path), "--json")
    assert result.exit_code == 0, result.stderr
    assert _value(json.loads(result.stdout)["launches"][0]["argv"], "--max-model-len") == "131072"


# --- item 11: hot-expert copies are what the engine holds -----------------------------------------------

SKEWED = (0.4, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05)


def test_expert_copies_become_the_engines_redundant_experts() -> None:
    doc = _doc("hgx-h200", "mixtral-8x7b", allowed_tp=(2,), ep=2, expert_replicas=2, expert_hit_rates=SKEWED)
    (p,) = doc.placements
    assert p.experts is not None and p.experts.replicas >= 1 and p.experts.extra_bytes_per_gpu > 0
    slots = p.experts.redundant_experts
    assert slots > 0 and slots % p.ep == 0
    # the reserved bytes are exactly the engine's extra slots: slots/ep experts per EP rank, split tp/ep ways
    spec = resolve_model("mixtral-8x7b")
    per_expert = spec.expert_params() * spec.num_layers * 2  # bf16, every layer is MoE
    assert p.experts.extra_bytes_per_gpu == round(slots / p.ep * per_expert / (p.tp // p.ep))
    vllm = _argv(doc, "vllm")
    assert "--enable-expert-parallel" in vllm and "--enable-eplb" in vllm
    assert json.loads(_value(vllm, "--eplb-config")) == {"num_redundant_experts": slots}
    # SGLang 0.5.23's Mixtral has no redundant experts (srt/models/mixtral.py): refused, not silently lost
    with pytest.raises(InputError, match=r"SGLang 0\.5\.23 has no redundant experts for 'mixtral' models"):
        _argv(doc, "sglang")
    # without copies there is nothing to reserve and nothing to ask for
    plain = _doc("hgx-h200", "mixtral-8x7b", allowed_tp=(2,), ep=2)
    for engine in ("vllm", "sglang"):
        argv = _argv(plain, engine)
        assert not {"--enable-eplb", "--eplb-config", "--ep-num-redundant-experts"} & set(argv)


def test_sglang_gets_redundant_experts_for_models_that_take_them() -> None:
    cluster = load_preset("hgx-h100")
    experts = ExpertReport(
        ep=8, replicas=5, imbalance_before=2.0, imbalance_after=1.1, extra_bytes_per_gpu=3 * GIB, redundant_experts=8
    )
    p = make_placement([("hgx-h100", range(8))], tp=8, model="qwen3-235b-a22b").model_copy(
        update={"ep": 8, "experts": experts, "hbm_per_gpu": HbmShare(weights=40 * GIB, kv=20 * GIB,
                                                                       activations=GIB, workspace=4 * GIB)}
    )  # fmt: skip
    request = PlacementRequest(id="plan", model="qwen3-235b-a22b", ep=8, weight_dtype="fp8")
    (launch,) = build_launches([p], request, cluster, "sglang")
    assert _value(launch.argv, "--ep-size") == "8"
    assert _value(launch.argv, "--ep-num-redundant-experts") == "8" and "--enable-eplb" in launch.argv
    (launch,) = build_launches([p], request, cluster, "vllm")
    assert json.loads(_value(launch.argv, "--eplb-config")) == {"num_redundant_experts": 8}
