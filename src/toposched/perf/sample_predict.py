"""What the cost model predicts for one measured setup (``predict_sample``): the figures a calibration compares.

``predict_sample`` turns one measured setup into the model's figures, compared the way
reference/data/anchors-train.md says:

* ``ttft_ms``: the prefill of one ``input_len`` prompt (chunked by ``max_batched_tokens``); at
  concurrency ``c > 1`` the other ``c - 1`` sequences decode in the same pass (continuous batching),
  and the request first waits, on average, half a decode step of theirs (it arrives mid-iteration).
  A closed loop of ``num_requests`` starts with ``c`` prompts at once: their TTFTs are the passes that
  prefill them together, and the mean over the run counts them (``ServingRun.mean_ttft_ms``).
* ``tpot_ms``: the decode step at batch ``c`` and context ``input_len + output_len / 2``, inflated by
  the prefills of arriving requests: each of the other ``c - 1`` sequences prefills once per
  ``output_len`` steps, in a pass with the decodes (the extra time of that mixed pass).
* ``tokens_per_s``: output tokens/s of ``c`` sequences (all GPUs): ``c x output_len`` over the
  time to prefill all ``c`` prompts in budget-sized passes plus ``output_len - 1`` decode steps. For
  offline maximum-throughput runs the caller sets ``batch`` to the saturated batch (what the KV
  cache and the engine's batch limit allow). A run of ``num_requests`` identical requests runs in
  waves of ``c``; an open-loop run (``request_rate``) serves its arrivals, and no more than the
  closed loop at ``c`` would (``perf/serving_run.py`` ``ServingRun``, the same model the plans' operating points use).
  A run whose outputs vary (``output_dist="exponential"``, a dataset's own completions) is served as its
  requests finish, one slot at a time, down to the longest output (``ServingRun.queued_run_ms``).

The sample's ``engine`` is passed on to the model (``latency.prefill_launched_from_host``: whether a
prefill pays the host-launch cost).
"""

from __future__ import annotations

from toposched.perf.coefficients import PerfConfig
from toposched.perf.hardware import get_gpu
from toposched.perf.latency import PassModel
from toposched.perf.links import get_link
from toposched.perf.samples import Sample
from toposched.perf.serving_run import ServingRun, exponential_lengths
from toposched.workload.catalog import resolve_model
from toposched.workload.dtypes import parse_kv_dtype, parse_weight_dtype
from toposched.workload.spec import ModelSpec

KINDS = ("ttft", "tpot", "throughput")
MEASURED = {"ttft": "ttft_ms", "tpot": "tpot_ms", "throughput": "tokens_per_s"}

DEFAULT_MAX_BATCHED_TOKENS = 8192
"""Batched-token budget of one pass: TensorRT-LLM's build default ``max_num_tokens`` (8192) and
vLLM V1's serving default ``max_num_batched_tokens`` (8192, engines.md §1.1)."""


def spec_of(sample: Sample) -> ModelSpec:
    wdt = parse_weight_dtype(sample.weight_dtype) if sample.weight_dtype else None
    kvd = parse_kv_dtype(sample.kv_dtype) if sample.kv_dtype else None
    return resolve_model(sample.model, weight_dtype=wdt, kv_dtype=kvd)


def predict_sample(
    sample: Sample, config: PerfConfig, *, max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
) -> dict[str, float]:
    """The model's ``ttft_ms``, ``tpot_ms`` and ``tokens_per_s`` for the kinds ``sample`` measured."""
    spec = spec_of(sample)
    gpu = get_gpu(sample.gpu)
    link = get_link(sample.link or gpu.native_link)
    model = PassModel(
        spec, gpu, tp=sample.tp, pp=sample.pp, link=link, pp_link=link, cfg=config, engine=sample.cost_engine
    )
    budget = sample.max_batched_tokens or max_batched_tokens
    run = ServingRun(model, sample.batch, sample.input_len, sample.output_len, budget)
    out: dict[str, float] = {}
    if sample.ttft_ms is not None:
        closed = sample.num_requests if sample.request_rate is None else None
        out["ttft_ms"] = run.mean_ttft_ms(closed, client=sample.ttft_at == "client")
    if sample.tpot_ms is not None:
        out["tpot_ms"] = run.tpot_ms()
    if sample.tokens_per_s is not None:
        lens = (
            exponential_lengths(sample.output_len, sample.num_requests)
            if sample.output_dist == "exponential" and sample.num_requests
            else None
        )
        out["tokens_per_s"] = run.tokens_per_s(sample.num_requests, sample.request_rate, lens)
    return out


def relative_errors(sample: Sample, config: PerfConfig) -> dict[str, float]:
    """``predicted / measured - 1`` per kind the sample measured."""
    pred = predict_sample(sample, config)
    return {kind: pred[key] / getattr(sample, key) - 1 for kind, key in MEASURED.items() if key in pred}


__all__ = ["DEFAULT_MAX_BATCHED_TOKENS", "KINDS", "MEASURED", "predict_sample", "relative_errors", "spec_of"]
