"""Measured samples the cost model is calibrated on: one benchmark result of one setup.

A ``Sample`` is what ``toposched calibrate`` reads from a user's benchmark files (vLLM
``bench serve --save-result`` JSON, SGLang ``bench_serving`` JSONL, the documented CSV, a live
engine's Prometheus ``/metrics``) and what the default profile is fitted on (the published anchors
of ``reference/data/anchors-train.json``). The readers live beside this model (``perf/readers.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from toposched.perf.engine_names import EngineName, EngineVersion, cost_engine


class Sample(BaseModel):
    """One measured setup: what ran (model, GPU, degrees, dtypes, load, lengths) and what was measured."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    source: str = Field(min_length=1, max_length=500, description="file:line, URL or anchor id")
    model: str = Field(min_length=1, max_length=500, description="catalog name, Hugging Face id or config.json path")
    gpu: str = Field(min_length=1, max_length=100, description="GPU table key, e.g. H100-SXM")
    engine: EngineName | None = Field(default=None, max_length=50, description="vllm, sglang, tensorrt-llm, ...")
    engine_version: EngineVersion | None = Field(default=None, max_length=41, description="the engine's version")
    tp: int = Field(default=1, ge=1, le=1024)
    pp: int = Field(default=1, ge=1, le=64)
    ep: int = Field(default=1, ge=1, le=1024)
    weight_dtype: str | None = Field(default=None, max_length=40)
    kv_dtype: str | None = Field(default=None, max_length=40)
    link: str | None = Field(default=None, max_length=40, description="perf link key between TP ranks")
    batch: int = Field(default=1, ge=1, le=1_000_000, description="concurrency / running batch")
    request_rate: float | None = Field(
        default=None, gt=0, le=1e6, description="offered requests/s of an open-loop run; None: closed loop at batch"
    )
    num_requests: int | None = Field(default=None, ge=1, le=1_000_000_000, description="requests in the run")
    input_len: int = Field(ge=1, le=10_000_000)
    output_len: int = Field(ge=1, le=10_000_000)
    output_dist: Literal["fixed", "exponential"] = Field(
        default="fixed",
        description="fixed: every request generates output_len tokens (--ignore-eos, a random dataset); "
        "exponential: lengths vary around the mean output_len (a dataset's own completions, e.g. ShareGPT)",
    )
    ttft_at: Literal["client", "engine"] = Field(
        default="client",
        description="client: TTFT as a benchmark client measures it (vllm bench serve, sglang.bench_serving); "
        "engine: as the engine's own metrics do (its Prometheus TTFT histogram: no HTTP path)",
    )
    max_batched_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="the engine's prompt-token budget per pass (vLLM "
        "--max-num-batched-tokens, SGLang --chunked-prefill-size); None: sample_predict.DEFAULT_MAX_BATCHED_TOKENS",
    )
    ttft_ms: float | None = Field(default=None, gt=0, le=1e9)
    tpot_ms: float | None = Field(default=None, gt=0, le=1e9)
    tokens_per_s: float | None = Field(default=None, gt=0, le=1e12, description="output tokens/s, all GPUs")

    @property
    def cost_engine(self) -> str | None:
        """The engine string the cost model takes: name and version (``perf/engine_names.cost_engine``)."""
        return cost_engine(self.engine, self.engine_version)

    @model_validator(mode="after")
    def _measured(self) -> Sample:
        if self.ttft_ms is None and self.tpot_ms is None and self.tokens_per_s is None:
            raise ValueError("a sample needs at least one of ttft_ms, tpot_ms, tokens_per_s")
        return self


__all__ = ["Sample"]
