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
  engine_version, kv_dtype, link, ep, num_requests, max_batched_tokens (the engine's prompt tokens per
  pass), output_dist (``fixed`` or ``exponential``: outputs of the dataset's own lengths), ttft_at
  (``client`` or ``engine``).
  An empty measurement cell means not measured.
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
from pathlib import Path
from typing import Any, Literal

from toposched.errors import InputError
from toposched.inputs import load_json, read_text
from toposched.perf.prometheus import observe, parse_exposition, window_sample
from toposched.perf.sample_setup import Setup, make_sample
from toposched.perf.samples import Sample

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
CSV_OPTIONAL: tuple[str, ...] = (
    "engine", "engine_version", "kv_dtype", "link", "ep", "num_requests", "max_batched_tokens", "output_dist",
    "ttft_at",
)  # fmt: skip

# ---------------------------------------------------------------------------------------------- common


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
            for key in ("tp", "pp", "ep", "batch", "input_len", "output_len", "num_requests", "max_batched_tokens"):
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
    "detect_format",
    "read_all",
    "read_samples",
]
