"""An engine's Prometheus ``/metrics`` (vLLM, SGLang): the metric names from the engines' sources, the
exposition parsed, the means over the window between two scrapes (``observe``) as a ``Sample``, and the
scrape itself.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from toposched.errors import InputError
from toposched.perf.sample_setup import Setup, make_sample
from toposched.perf.samples import Sample

# vLLM 0.33.0 vllm/v1/metrics/loggers.py (PrometheusStatLogger.__init__), labels model_name, engine;
# SGLang 0.5.23 sglang/srt/observability/metrics_collector.py (TokenizerMetricsCollector,
# SchedulerMetricsCollector), labels model_name, engine_type, tp_rank, ... . Counters are exposed
# with prometheus_client's ``_total`` suffix.
PROMETHEUS_METRICS: dict[str, dict[str, str]] = {
    "vllm": {
        "ttft": "vllm:time_to_first_token_seconds",
        "tpot": "vllm:request_time_per_output_token_seconds",
        "itl": "vllm:inter_token_latency_seconds",
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "kv_usage": "vllm:kv_cache_usage_perc",
        "prompt_len": "vllm:request_prompt_tokens",
        "output_len": "vllm:request_generation_tokens",
        "generation_tokens": "vllm:generation_tokens_total",
        "prompt_tokens": "vllm:prompt_tokens_total",
        "requests": "vllm:e2e_request_latency_seconds",
    },
    "sglang": {
        "ttft": "sglang:time_to_first_token_seconds",
        "tpot": "sglang:request_time_per_output_token_seconds",
        "itl": "sglang:inter_token_latency_seconds",
        "running": "sglang:num_running_reqs",
        "waiting": "sglang:num_queue_reqs",
        "kv_usage": "sglang:token_usage",
        "generation_tokens": "sglang:generation_tokens_total",
        "prompt_tokens": "sglang:prompt_tokens_total",
        "requests": "sglang:e2e_request_latency_seconds",
    },
}


@dataclass(frozen=True)
class Exposition:
    """One scrape: every sample line as (name, labels) -> value."""

    source: str
    series: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def total(self, name: str) -> float | None:
        """The sum over all label sets of ``name`` (None: no such series; NaN and infinities ignored)."""
        values = [v for (n, _), v in self.series.items() if n == name and math.isfinite(v)]
        return sum(values) if values else None

    def labels(self, label: str, prefix: str) -> set[str]:
        return {dict(lbl).get(label, "") for (n, lbl) in self.series if n.startswith(prefix)} - {""}


def parse_exposition(text: str, *, source: str) -> Exposition:
    """Prometheus text format 0.0.4, read by ``prometheus_client``'s own parser (what both engines expose their
    metrics with); one error naming the line that is not."""
    from prometheus_client.parser import text_string_to_metric_families  # here: plan and estimate start without it

    series: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key in series:
                    raise InputError(f"{source}: series {sample.name[:80]} with these labels appears twice")
                series[key] = float(sample.value)
                if len(series) > 1_000_000:
                    raise InputError(f"{source}: more than 1,000,000 series", fix="scrape one engine")
    except (ValueError, IndexError, KeyError) as exc:
        number, line = _bad_line(text)
        what = "bad labels in" if "label" in str(exc).lower() else "not a Prometheus sample line:"
        raise InputError(f"{source}:{number}: {what} {line[:60]!r}") from None
    if not series:
        raise InputError(f"{source}: no Prometheus samples in it", fix="save the engine's /metrics text")
    return Exposition(source, series)


def _bad_line(text: str) -> tuple[str, str]:
    """(number, text) of the first line the parser refuses on its own: for the error, once the text as a whole
    failed (a line it takes alone but not in its place, e.g. after a TYPE line, gives "?")."""
    from prometheus_client.parser import text_string_to_metric_families

    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                list(text_string_to_metric_families(line + "\n"))
            except (ValueError, IndexError, KeyError):
                return str(number), line.strip()
    return "?", ""


@dataclass(frozen=True)
class Window:
    """What a live engine measured over a window (or since it started: one snapshot)."""

    engine: str
    model: str | None
    seconds: float | None
    requests: float
    ttft_ms: float | None
    tpot_ms: float | None
    running: float | None
    waiting: float | None
    kv_usage: float | None
    input_len: float | None
    output_len: float | None
    tokens_per_s: float | None


def _engine_of(exp: Exposition) -> str:
    for engine in ("vllm", "sglang"):
        if any(n.startswith(engine + ":") for n, _ in exp.series):
            return engine
    raise InputError(f"{exp.source}: no vllm: or sglang: metrics in it", fix="scrape the engine's own /metrics")


def observe(after: Exposition, before: Exposition | None = None, *, seconds: float | None = None) -> Window:
    """The engine's means over the window between two scrapes (``before`` None: since it started)."""
    engine = _engine_of(after)
    names = PROMETHEUS_METRICS[engine]

    def delta(name: str) -> float | None:
        now = after.total(name)
        if now is None:
            return None
        then = before.total(name) if before is not None else 0.0
        d = now - (then or 0.0)
        if d < 0:
            raise InputError(f"{after.source}: {name} went down between the scrapes (the engine restarted)")
        return d

    def mean(hist: str) -> float | None:
        total, count = delta(hist + "_sum"), delta(hist + "_count")
        return total / count if total is not None and count else None

    def gauge(name: str) -> float | None:
        values = [v for v in (e.total(name) for e in (before, after) if e is not None) if v is not None]
        return sum(values) / len(values) if values else None

    requests = delta(names["requests"] + "_count") or 0.0
    ttft = mean(names["ttft"])
    tpot = mean(names["tpot"]) or mean(names["itl"])
    if "prompt_len" in names:
        input_len, output_len = mean(names["prompt_len"]), mean(names["output_len"])
    else:
        prompt, generated = delta(names["prompt_tokens"]), delta(names["generation_tokens"])
        input_len = prompt / requests if prompt is not None and requests else None
        output_len = generated / requests if generated is not None and requests else None
    generated = delta(names["generation_tokens"])
    models = after.labels("model_name", engine + ":")
    if len(models) > 1:
        raise InputError(f"{after.source}: metrics of several models ({', '.join(sorted(models))[:80]})",
                         fix="scrape one engine at a time")  # fmt: skip
    return Window(
        engine=engine,
        model=next(iter(models), None),
        seconds=seconds,
        requests=requests,
        ttft_ms=ttft * 1000 if ttft else None,
        tpot_ms=tpot * 1000 if tpot else None,
        running=gauge(names["running"]),
        waiting=gauge(names["waiting"]),
        kv_usage=gauge(names["kv_usage"]),
        input_len=input_len,
        output_len=output_len,
        tokens_per_s=generated / seconds if generated is not None and seconds and before is not None else None,
    )


def _whole(value: float | None) -> int | None:
    """A mean as a whole count of at least 1 (None: not measured, or not a finite number)."""
    return max(1, round(value)) if value and math.isfinite(value) else None


def window_sample(window: Window, setup: Setup, *, where: str) -> Sample:
    """A ``Sample`` from an observed window; the setup (GPU, tp, ...) comes from the options."""
    if window.ttft_ms is None and window.tpot_ms is None:
        raise InputError(f"{where}: no request finished in the window", fix="scrape over a longer --window under load")
    fields: dict[str, Any] = {
        "model": window.model,
        "engine": window.engine,
        "batch": _whole(window.running),
        "input_len": _whole(window.input_len),
        "output_len": _whole(window.output_len),
        "ttft_ms": window.ttft_ms,
        "tpot_ms": window.tpot_ms,
        "tokens_per_s": window.tokens_per_s,
        "ttft_at": "engine",  # the engine's own histogram: no HTTP path (PerfConfig.client_overhead_ms)
    }
    return make_sample(fields, setup, where=where)


MAX_SCRAPE_BYTES = 8 * 1024 * 1024


def scrape(url: str, *, timeout_s: float = 10.0, transport: Any = None) -> Exposition:
    """GET ``url`` (an engine's /metrics) with a bounded body; one line naming the URL on failure."""
    import httpx

    if not re.match(r"^https?://[^\s/]+", url) or len(url) > 2000:
        raise InputError(f"--metrics-url {url[:80]!r} is not an http(s) URL", fix="e.g. http://127.0.0.1:8000/metrics")
    try:
        with httpx.Client(timeout=timeout_s, transport=transport) as client, client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise InputError(f"{url[:80]}: HTTP {resp.status_code}", fix="is it the engine's /metrics?")
            body = bytearray()
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > MAX_SCRAPE_BYTES:
                    raise InputError(f"{url[:80]}: more than {MAX_SCRAPE_BYTES:,} bytes")
    except httpx.HTTPError as exc:
        raise InputError(f"{url[:80]}: cannot scrape: {exc}", fix="check the URL and that the engine runs") from None
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{url[:80]}: the answer is not UTF-8 text") from None
    return parse_exposition(text, source=url[:200])


__all__ = [
    "PROMETHEUS_METRICS",
    "Exposition",
    "Window",
    "observe",
    "parse_exposition",
    "scrape",
    "window_sample",
]
