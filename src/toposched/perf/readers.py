"""Reading measured ``Sample``s from the files users already have, and from a live engine's /metrics.

Formats (``read_samples(path, fmt=...)``; ``auto`` picks by content):

* ``vllm``: ``vllm bench serve --save-result`` JSON (vLLM 0.33.0, ``vllm/benchmarks/serve.py``:
  ``benchmark()`` builds the result dict, ``main()`` adds ``model_id``, ``max_concurrency``,
  ``num_prompts`` and the ``--metadata KEY=VALUE`` pairs at the top level and writes it with
  ``json.dump``; ``--append-result`` writes several such objects, one per line). Read: ``model_id``,
  ``completed``, ``total_input_tokens``, ``total_output_tokens`` (mean lengths per request),
  ``max_concurrency`` (else, for a run at a finite ``request_rate``, the mean concurrency by Little's
  law, ``request_throughput x mean_e2el_ms``; else the measured ``max_concurrent_requests``),
  ``request_rate`` (a number, or ``"inf"``: all requests at once; ignored with a
  ``ramp_up_strategy``), ``mean_ttft_ms``, ``mean_tpot_ms``, ``output_throughput``; ``completed`` is
  the run's request count (``Sample.num_requests``). vLLM does not record the GPU or the degrees: give them
  as options, or as ``--metadata gpu=H100-SXM tp=2`` when running the benchmark (keys ``gpu``,
  ``tp``, ``pp``, ``ep``, ``weight_dtype``, ``kv_dtype``, ``link`` are read from the top level).
* ``sglang``: SGLang 0.5.23 ``python -m sglang.bench_serving --output-file F`` JSONL
  (``sglang/benchmark/serving.py``: ``benchmark()`` appends ``json.dumps(result)`` per run). Read:
  ``server_info`` (the server's ``/server_info``: ``model_path``, ``tp_size``, ``pp_size``,
  ``ep_size``, ``dtype``, ``quantization``, ``kv_cache_dtype``), ``completed`` (the request count),
  ``total_input_tokens``, ``total_output_tokens``, ``max_concurrency`` (else the measured mean
  ``concurrency``), ``request_rate`` (a number; ``inf`` or ``"trace"``: none), ``mean_ttft_ms``,
  ``mean_tpot_ms``, ``output_throughput``. SGLang writes its default rate with ``json.dumps``, as
  ``Infinity``, which is not JSON: that one key's ``Infinity`` is read as ``"inf"``.
* ``csv``: a header line and one sample a row. Columns (``CSV_COLUMNS``): model, gpu, tp, pp,
  weight_dtype, batch, input_len, output_len, ttft_ms, tpot_ms, tokens_per_s; optional engine,
  kv_dtype, link, ep. An empty measurement cell means not measured.
* ``prometheus``: a Prometheus exposition (text format 0.0.4) of a vLLM or SGLang server: one saved
  file is one snapshot (means since the server started); ``window_sample(before, after, ...)`` takes
  two scrapes and uses the histogram deltas between them. Metric names from the engines' sources
  (``PROMETHEUS_METRICS``).

Options (a ``Setup``) fill in what a file does not record and win over what it does. Every input is
read through ``toposched.inputs`` (bounded, UTF-8, strict JSON); bad input is one ``InputError``
naming the file and the line or key.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toposched.errors import InputError, UnknownNameError, first_problem
from toposched.inputs import load_json, read_text
from toposched.perf.hardware import gpu_registry
from toposched.perf.links import link_registry
from toposched.perf.samples import Sample
from toposched.workload.dtypes import parse_kv_dtype, parse_weight_dtype

Format = Literal["auto", "vllm", "sglang", "csv", "prometheus"]
FORMATS: tuple[str, ...] = ("auto", "vllm", "sglang", "csv", "prometheus")

MAX_SAMPLES_BYTES = 16 * 1024 * 1024
"""Largest benchmark file read (a vLLM result saved with ``--save-detailed`` of 10k requests fits)."""
MAX_ROWS = 100_000
"""Most samples one file may hold."""

CSV_COLUMNS: tuple[str, ...] = (
    "model", "gpu", "tp", "pp", "weight_dtype", "batch", "input_len", "output_len", "ttft_ms", "tpot_ms",
    "tokens_per_s",
)  # fmt: skip
CSV_OPTIONAL: tuple[str, ...] = ("engine", "kv_dtype", "link", "ep")

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


class Setup(BaseModel):
    """What ran, given as options: fills in what a file does not record and wins over what it does."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = Field(default=None, min_length=1, max_length=500)
    gpu: str | None = Field(default=None, min_length=1, max_length=100)
    engine: str | None = Field(default=None, min_length=1, max_length=50)
    tp: int | None = Field(default=None, ge=1, le=1024)
    pp: int | None = Field(default=None, ge=1, le=64)
    ep: int | None = Field(default=None, ge=1, le=1024)
    weight_dtype: str | None = Field(default=None, max_length=40)
    kv_dtype: str | None = Field(default=None, max_length=40)
    link: str | None = Field(default=None, max_length=40)
    batch: int | None = Field(default=None, ge=1, le=1_000_000)
    input_len: int | None = Field(default=None, ge=1, le=10_000_000)
    output_len: int | None = Field(default=None, ge=1, le=10_000_000)

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


# ---------------------------------------------------------------------------------------------- common


def _gpu_key(name: str, where: str) -> str:
    try:
        return gpu_registry().canonical(name)
    except UnknownNameError as exc:
        raise InputError(f"{where}: {exc.message}", fix="pass --gpu with a GPU table key") from None


def _weight(name: str, where: str) -> str:
    try:
        return parse_weight_dtype(name)
    except UnknownNameError as exc:
        raise InputError(f"{where}: {exc.message}", fix="pass --weight-dtype bf16|fp16|fp8|int8|int4") from None


def _kv(name: str, where: str) -> str:
    try:
        return parse_kv_dtype(name)
    except UnknownNameError as exc:
        raise InputError(f"{where}: {exc.message}", fix="pass --kv-dtype") from None


def make_sample(fields: Mapping[str, Any], setup: Setup, *, where: str) -> Sample:
    """A ``Sample`` from what a file gave (``fields``) and the options (``setup``, which win)."""
    data: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
    data.update(setup.given())
    data["source"] = where[:500]
    for key, fix in (("model", "pass --model"), ("gpu", "pass --gpu (e.g. H100-SXM)")):
        if not data.get(key):
            raise InputError(f"{where}: the file does not say which {key} ran", fix=fix)
    data["gpu"] = _gpu_key(str(data["gpu"]), where)
    if data.get("weight_dtype"):
        data["weight_dtype"] = _weight(str(data["weight_dtype"]), where)
    if data.get("kv_dtype"):
        data["kv_dtype"] = _kv(str(data["kv_dtype"]), where)
    if data.get("link"):
        try:
            data["link"] = link_registry().canonical(str(data["link"]))
        except UnknownNameError as exc:
            raise InputError(f"{where}: {exc.message}", fix="pass --link with a perf link key") from None
    for key, fix in (("batch", "pass --batch"), ("input_len", "pass --input-len"), ("output_len", "pass --output-len")):
        if key not in data:
            raise InputError(f"{where}: no {key} in the file", fix=fix)
    try:
        return Sample.model_validate(data)
    except ValidationError as exc:
        problem = first_problem(exc)
        raise InputError(f"{where}: {problem.path or 'sample'}: {problem.msg} (got {problem.input!r:.60})") from None


def _number(obj: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> float | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise InputError(f"{where}: key {key!r} is missing", fix="is this the engine's benchmark result?")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InputError(f"{where}: key {key!r} is {value!r:.60}, not a non-negative number")
    return float(value)


def _positive(value: float | None) -> float | None:
    """A measured mean; vLLM writes 0 when nothing was measured (``np.mean(tpots or 0)``)."""
    return value if value is not None and value > 0 else None


def _mean_lengths(obj: Mapping[str, Any], where: str) -> tuple[int, int]:
    completed = _number(obj, "completed", where, required=True)
    if not completed:
        raise InputError(f"{where}: 'completed' is 0: no request finished", fix="rerun the benchmark")
    total_in = _number(obj, "total_input_tokens", where, required=True) or 0.0
    total_out = _number(obj, "total_output_tokens", where, required=True) or 0.0
    lengths = []
    for key, total in (("total_input_tokens", total_in), ("total_output_tokens", total_out)):
        mean = total / completed
        if not math.isfinite(mean) or mean > 10_000_000:
            raise InputError(f"{where}: {key} / completed is {mean:.3g} tokens per request, not a length")
        lengths.append(max(1, round(mean)))
    return lengths[0], lengths[1]


_INFINITE_RATE = re.compile(r'("request_rate"\s*:\s*)Infinity\b')


def _records(text: str, source: str) -> list[tuple[str, dict[str, Any]]]:
    """One JSON object, or one per non-blank line (JSONL; vLLM ``--append-result``)."""
    text = _INFINITE_RATE.sub(r'\1"inf"', text)  # SGLang's json.dumps(float("inf")); nothing else
    stripped = text.strip()
    if not stripped:
        raise InputError(f"{source}: the file is empty", fix="pass the benchmark's result file")
    records: list[tuple[str, Any]] = []
    first = stripped.splitlines()[0]
    if _one_document(stripped) or not _one_document(first):  # one (pretty-printed) document
        records.append((source, load_json(stripped, source=source)))
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                where = f"{source}:{number}"
                records.append((where, load_json(line, source=where)))
                if len(records) > MAX_ROWS:
                    raise InputError(f"{source}: more than {MAX_ROWS:,} results", fix="split the file")
    out: list[tuple[str, dict[str, Any]]] = []
    for where, obj in records:
        if not isinstance(obj, dict):
            raise InputError(f"{where}: a benchmark result is a JSON object, not {type(obj).__name__}")
        out.append((where, obj))
    return out


def _one_document(text: str) -> bool:
    """Whether ``text`` is a single (possibly pretty-printed) JSON document."""
    import json

    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _str(obj: Mapping[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"{where}: key {key!r} is {value!r:.60}, not a string")
    return str(value)


def _int(value: Any, key: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise InputError(f"{where}: key {key!r} is {value!r}, not a whole number")
    try:
        return int(str(value).strip())
    except ValueError:
        raise InputError(f"{where}: key {key!r} is {value!r:.60}, not a whole number") from None


def _rate(obj: Mapping[str, Any], where: str) -> float | None:
    """The offered request rate of an open-loop run; None for ``inf`` (all requests at once) or a trace."""
    value = obj.get("request_rate")
    if value is None or (isinstance(value, str) and value.strip().lower() in ("inf", "infinity", "trace")):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InputError(
            f"{where}: key 'request_rate' is {value!r:.60}, not a positive number or 'inf'",
            fix="is this the benchmark's own result file?",
        )
    return float(value)


def _requests(obj: Mapping[str, Any], where: str) -> int | None:
    """The run's request count: the requests that completed (their tokens make the throughput)."""
    completed = _number(obj, "completed", where)
    return max(1, round(completed)) if completed else None


# ------------------------------------------------------------------------------------------------ vLLM

_METADATA_KEYS = ("gpu", "weight_dtype", "kv_dtype", "link")


def vllm_sample(obj: Mapping[str, Any], setup: Setup, *, where: str) -> Sample:
    """One ``vllm bench serve --save-result`` result (vLLM 0.33.0 ``vllm/benchmarks/serve.py``)."""
    input_len, output_len = _mean_lengths(obj, where)
    rate = None if obj.get("ramp_up_strategy") is not None else _rate(obj, where)
    batch = _int(obj.get("max_concurrency"), "max_concurrency", where)
    if batch is None and rate is not None:  # open loop, no cap: the mean concurrency (Little's law)
        throughput = _number(obj, "request_throughput", where)
        e2e_ms = _number(obj, "mean_e2el_ms", where)
        if throughput and e2e_ms:
            batch = max(1, round(throughput * e2e_ms / 1e3))
    if batch is None:  # no --max-concurrency: the peak the benchmark measured
        batch = _int(obj.get("max_concurrent_requests"), "max_concurrent_requests", where)
    fields: dict[str, Any] = {
        "model": _str(obj, "model_id", where),
        "engine": "vllm",
        "batch": batch,
        "request_rate": rate,
        "num_requests": _requests(obj, where),
        "input_len": input_len,
        "output_len": output_len,
        "ttft_ms": _positive(_number(obj, "mean_ttft_ms", where)),
        "tpot_ms": _positive(_number(obj, "mean_tpot_ms", where)),
        "tokens_per_s": _positive(_number(obj, "output_throughput", where)),
    }
    for key in _METADATA_KEYS:  # --metadata KEY=VALUE lands at the top level (serve.py main())
        fields[key] = _str(obj, key, where)
    for key in ("tp", "pp", "ep"):
        fields[key] = _int(obj.get(key), key, where)
    return make_sample(fields, setup, where=where)


# ---------------------------------------------------------------------------------------------- SGLang

# sglang ``--quantization`` methods -> weight dtype (the rest: pass --weight-dtype)
_SGLANG_QUANT = {
    "fp8": "fp8", "w8a8_fp8": "fp8", "modelopt_fp8": "fp8", "compressed-tensors": None,
    "w8a8_int8": "int8", "awq": "int4", "awq_marlin": "int4", "gptq": "int4", "gptq_marlin": "int4",
}  # fmt: skip


def sglang_sample(obj: Mapping[str, Any], setup: Setup, *, where: str) -> Sample:
    """One line of SGLang 0.5.23 ``bench_serving --output-file`` (``sglang/benchmark/serving.py``)."""
    info = obj.get("server_info")
    if info is not None and not isinstance(info, dict):
        raise InputError(f"{where}: key 'server_info' is not an object")
    input_len, output_len = _mean_lengths(obj, where)
    info = info or {}
    iw = f"{where}: server_info"
    batch = _int(obj.get("max_concurrency"), "max_concurrency", where)
    if batch is None:  # no --max-concurrency: the mean concurrency the benchmark measured
        concurrency = _number(obj, "concurrency", where)
        batch = max(1, round(concurrency)) if concurrency else None
    weight: str | None = None
    quant = _str(info, "quantization", iw)
    if quant:
        weight = _SGLANG_QUANT.get(quant.lower())
    else:
        dtype = _str(info, "dtype", iw)
        weight = dtype if dtype and dtype != "auto" else None
    kv = _str(info, "kv_cache_dtype", iw)
    fields: dict[str, Any] = {
        "model": _str(info, "served_model_name", iw) or _str(info, "model_path", iw),
        "engine": "sglang",
        "tp": _int(info.get("tp_size"), "tp_size", iw),
        "pp": _int(info.get("pp_size"), "pp_size", iw),
        "ep": _int(info.get("ep_size"), "ep_size", iw),
        "weight_dtype": weight,
        "kv_dtype": kv if kv and kv != "auto" else None,
        "batch": batch,
        "request_rate": _rate(obj, where),
        "num_requests": _requests(obj, where),
        "input_len": input_len,
        "output_len": output_len,
        "ttft_ms": _positive(_number(obj, "mean_ttft_ms", where)),
        "tpot_ms": _positive(_number(obj, "mean_tpot_ms", where)),
        "tokens_per_s": _positive(_number(obj, "output_throughput", where)),
    }
    return make_sample(fields, setup, where=where)


# ------------------------------------------------------------------------------------------------- CSV


def csv_samples(text: str, setup: Setup, *, source: str) -> list[Sample]:
    """The documented CSV: a header of ``CSV_COLUMNS`` (+ optional ``CSV_OPTIONAL``), one sample a row."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = [h.strip().lower() for h in next(reader)]
    except StopIteration:
        raise InputError(f"{source}: the file is empty", fix="write a header line: " + ",".join(CSV_COLUMNS)) from None
    except csv.Error as exc:
        raise InputError(f"{source}: line 1: not CSV: {exc}") from None
    known = set(CSV_COLUMNS) | set(CSV_OPTIONAL)
    for name in header:
        if name not in known:
            raise InputError(
                f"{source}: line 1: unknown column {name[:40]!r}",
                fix="columns: " + ",".join(CSV_COLUMNS + CSV_OPTIONAL),
            )
    if len(set(header)) != len(header):
        raise InputError(f"{source}: line 1: a column is named twice")
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        raise InputError(
            f"{source}: line 1: missing column(s) {', '.join(missing)}", fix="add them (cells may be empty)"
        )
    out: list[Sample] = []
    try:
        for row in reader:
            line = reader.line_num
            if not any(cell.strip() for cell in row):
                continue
            where = f"{source}:{line}"
            if len(row) != len(header):
                raise InputError(f"{where}: {len(row)} cells, the header has {len(header)}")
            cells = {k: v.strip() for k, v in zip(header, row, strict=True)}
            fields: dict[str, Any] = {k: (v or None) for k, v in cells.items()}
            for key in ("ttft_ms", "tpot_ms", "tokens_per_s"):
                if fields.get(key) is not None:
                    fields[key] = _csv_float(fields[key], key, where)
            for key in ("tp", "pp", "ep", "batch", "input_len", "output_len"):
                fields[key] = _int(fields.get(key), key, where)
            out.append(make_sample(fields, setup, where=where))
            if len(out) > MAX_ROWS:
                raise InputError(f"{source}: more than {MAX_ROWS:,} rows", fix="split the file")
    except csv.Error as exc:
        raise InputError(f"{source}:{reader.line_num}: not CSV: {exc}") from None
    return out


def _csv_float(text: str, key: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{where}: column {key!r} is {text[:40]!r}, not a number") from None
    if not math.isfinite(value):
        raise InputError(f"{where}: column {key!r} is {text[:40]!r}, not a finite number")
    return value


# ------------------------------------------------------------------------------------------ Prometheus

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?[ \t]+(\S+)(?:[ \t]+(-?\d+))?[ \t]*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')


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
    """Prometheus text format 0.0.4; one error naming the line that is not."""
    series: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise InputError(f"{source}:{number}: not a Prometheus sample line: {line[:60]!r}")
        name, body, value_text, _ = m.groups()
        labels: list[tuple[str, str]] = []
        rest = body or ""
        while rest.strip():
            lm = _LABEL.match(rest)
            if lm is None:
                raise InputError(f"{source}:{number}: bad labels in {line[:60]!r}")
            labels.append((lm.group(1), lm.group(2)))
            rest = rest[lm.end() :]
        try:
            value = float(value_text)
        except ValueError:
            raise InputError(f"{source}:{number}: {value_text[:30]!r} is not a number") from None
        key = (name, tuple(sorted(labels)))
        if key in series:
            raise InputError(f"{source}:{number}: series {name} with these labels appears twice")
        series[key] = value
        if len(series) > 1_000_000:
            raise InputError(f"{source}: more than 1,000,000 series", fix="scrape one engine")
    if not series:
        raise InputError(f"{source}: no Prometheus samples in it", fix="save the engine's /metrics text")
    return Exposition(source, series)


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


# ----------------------------------------------------------------------------------------------- files


def detect_format(text: str, *, source: str) -> str:
    """``vllm``, ``sglang``, ``csv`` or ``prometheus`` from the content; one error when none fits."""
    head = text.lstrip()[:4096]
    if head.startswith("{"):
        first = head.splitlines()[0]
        if '"server_info"' in head or '"random_input_len"' in first:
            return "sglang"
        if '"model_id"' in text or '"endpoint_type"' in text:
            return "vllm"
        raise InputError(f"{source}: a JSON result, but neither vLLM's nor SGLang's", fix="pass --format")
    if head.startswith("#") or re.match(r"^(vllm|sglang):", head):
        return "prometheus"
    first_line = head.splitlines()[0].lower() if head else ""
    if "," in first_line and "model" in first_line:
        return "csv"
    raise InputError(f"{source}: cannot tell the format", fix="pass --format vllm|sglang|csv|prometheus")


def read_samples(path: str | Path, *, fmt: str = "auto", setup: Setup | None = None) -> list[Sample]:
    """Every sample in one file."""
    setup = setup or Setup()
    source = str(path)
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    text = read_text(path, what="benchmark file", max_bytes=MAX_SAMPLES_BYTES)
    if fmt == "auto":
        fmt = detect_format(text, source=source)
    if fmt == "csv":
        return csv_samples(text, setup, source=source)
    if fmt == "prometheus":
        return [window_sample(observe(parse_exposition(text, source=source)), setup, where=source)]
    make = vllm_sample if fmt == "vllm" else sglang_sample
    return [make(obj, setup, where=where) for where, obj in _records(text, source)]


def read_all(paths: Sequence[str | Path], *, fmt: str = "auto", setup: Setup | None = None) -> list[Sample]:
    out: list[Sample] = []
    for path in paths:
        out.extend(read_samples(path, fmt=fmt, setup=setup))
    return out


__all__ = [
    "CSV_COLUMNS",
    "CSV_OPTIONAL",
    "FORMATS",
    "PROMETHEUS_METRICS",
    "Exposition",
    "Setup",
    "Window",
    "detect_format",
    "make_sample",
    "observe",
    "parse_exposition",
    "read_all",
    "read_samples",
    "scrape",
    "window_sample",
]
