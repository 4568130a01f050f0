"""perf/readers.py: samples from vLLM / SGLang benchmark results, the CSV and engines' /metrics.

The fixture files under data/ carry the keys the engines write (vLLM 0.33.0
``vllm/benchmarks/serve.py``, SGLang 0.5.23 ``sglang/benchmark/serving.py``); the expositions are
made with ``prometheus_client`` (what both engines use) under the metric names and label names of
their sources (vLLM ``vllm/v1/metrics/loggers.py``, SGLang
``sglang/srt/observability/metrics_collector.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from toposched.errors import InputError
from toposched.perf.prometheus import observe, parse_exposition, scrape, window_sample
from toposched.perf.readers import detect_format, read_samples
from toposched.perf.sample_setup import Setup
from toposched.perf.samples import Sample

DATA = Path(__file__).parent / "data"


class EngineMetrics:
    """A live engine's metrics as the engine registers them (names, label names)."""

    def __init__(self, engine: str, model: str = "Qwen/Qwen2.5-7B-Instruct") -> None:
        self.engine = engine
        self.registry = r = CollectorRegistry()
        if engine == "vllm":
            labels = {"model_name": model, "engine": "0"}
            p = "vllm:"
            self.ttft = Histogram(p + "time_to_first_token_seconds", "ttft", list(labels), registry=r).labels(**labels)
            self.itl = Histogram(p + "inter_token_latency_seconds", "itl", list(labels), registry=r).labels(**labels)
            self.tpot = Histogram(p + "request_time_per_output_token_seconds", "tpot", list(labels), registry=r).labels(
                **labels
            )
            self.e2e = Histogram(p + "e2e_request_latency_seconds", "e2e", list(labels), registry=r).labels(**labels)
            self.prompt_len = Histogram(
                p + "request_prompt_tokens", "in", list(labels), buckets=[1, 10, 100, 1000, 10000], registry=r
            ).labels(**labels)
            self.output_len = Histogram(
                p + "request_generation_tokens", "out", list(labels), buckets=[1, 10, 100, 1000, 10000], registry=r
            ).labels(**labels)
            self.prompt = Counter(p + "prompt_tokens", "in", list(labels), registry=r).labels(**labels)
            self.generation = Counter(p + "generation_tokens", "out", list(labels), registry=r).labels(**labels)
            self.running = Gauge(p + "num_requests_running", "run", list(labels), registry=r).labels(**labels)
            Gauge(p + "num_requests_waiting", "wait", list(labels), registry=r).labels(**labels).set(0)
            Gauge(p + "kv_cache_usage_perc", "kv", list(labels), registry=r).labels(**labels).set(0.4)
        else:
            labels = {"model_name": model, "engine_type": "unified"}
            stream = [*labels, "is_streaming"]
            s = {**labels, "is_streaming": "true"}
            sched = {**labels, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
            p = "sglang:"
            self.ttft = Histogram(p + "time_to_first_token_seconds", "ttft", stream, registry=r).labels(**s)
            self.itl = Histogram(p + "inter_token_latency_seconds", "itl", list(labels), registry=r).labels(**labels)
            self.tpot = Histogram(p + "request_time_per_output_token_seconds", "tpot", stream, registry=r).labels(**s)
            self.e2e = Histogram(p + "e2e_request_latency_seconds", "e2e", stream, registry=r).labels(**s)
            self.prompt = Counter(p + "prompt_tokens", "in", stream, registry=r).labels(**s)
            self.generation = Counter(p + "generation_tokens", "out", stream, registry=r).labels(**s)
            self.running = Gauge(p + "num_running_reqs", "run", list(sched), registry=r).labels(**sched)
            Gauge(p + "num_queue_reqs", "q", list(sched), registry=r).labels(**sched).set(0)
            Gauge(p + "token_usage", "kv", list(sched), registry=r).labels(**sched).set(0.4)

    def finish(self, *, ttft_s: float, tpot_s: float, input_len: int, output_len: int, n: int = 1) -> None:
        """``n`` requests finish, as the engine records them."""
        for _ in range(n):
            self.ttft.observe(ttft_s)
            self.tpot.observe(tpot_s)
            for _ in range(output_len - 1):
                self.itl.observe(tpot_s)
            self.e2e.observe(ttft_s + tpot_s * (output_len - 1))
            self.prompt.inc(input_len)
            self.generation.inc(output_len)
            if self.engine == "vllm":
                self.prompt_len.observe(input_len)
                self.output_len.observe(output_len)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def exposition_pair(engine: str) -> tuple[str, str]:
    """Two scrapes: 10 slow requests before, 20 at 30 ms TTFT / 8 ms TPOT, 512 in / 64 out between."""
    m = EngineMetrics(engine)
    m.running.set(4)
    m.finish(ttft_s=1.0, tpot_s=0.1, input_len=100, output_len=10, n=10)
    before = m.text()
    m.running.set(12)
    m.finish(ttft_s=0.030, tpot_s=0.008, input_len=512, output_len=64, n=20)
    return before, m.text()


SETUP = Setup(gpu="H100-SXM", tp=1, weight_dtype="bf16")


# --------------------------------------------------------------------------------------------- files


def test_vllm_result_with_metadata() -> None:
    (s,) = read_samples(DATA / "vllm-result.json")
    assert (s.model, s.gpu, s.tp, s.engine, s.weight_dtype) == (
        "Qwen/Qwen2.5-7B-Instruct",
        "H100-SXM",
        1,
        "vllm",
        "bf16",
    )
    assert (s.batch, s.input_len, s.output_len) == (16, 1024, 128)
    assert (s.ttft_ms, s.tpot_ms, s.tokens_per_s) == (92.4, 9.8, 1450.0)


def test_vllm_append_result_is_one_sample_per_line_and_options_fill_the_setup() -> None:
    samples = read_samples(DATA / "vllm-append.json", setup=SETUP)
    assert [s.batch for s in samples] == [1, 32]
    assert [s.tpot_ms for s in samples] == [6.9, 12.7]
    assert samples[1].source.endswith("vllm-append.json:2")
    assert all(s.gpu == "H100-SXM" for s in samples)


def test_vllm_without_gpu_names_the_file_and_the_option() -> None:
    with pytest.raises(InputError, match=r"vllm-append.json:1: the file does not say which gpu") as exc:
        read_samples(DATA / "vllm-append.json")
    assert exc.value.fix == "pass --gpu (e.g. H100-SXM)"


def _read_text(tmp_path: Path, text: str, name: str = "r.json", setup: Setup | None = None) -> list[Sample]:
    f = tmp_path / name
    f.write_text(text)
    return read_samples(f, setup=setup)


def test_vllm_run_size_and_rate(tmp_path: Path) -> None:
    """``completed`` is the run's request count; ``request_rate`` "inf" is a closed loop; a finite rate
    without --max-concurrency is an open loop at its mean concurrency (Little's law)."""
    (s,) = read_samples(DATA / "vllm-result.json")
    assert (s.num_requests, s.request_rate, s.batch) == (200, None, 16)
    obj = json.loads((DATA / "vllm-result.json").read_text())
    obj.update(request_rate=4.0, max_concurrency=None, request_throughput=3.9, mean_e2el_ms=2500.0)
    (o,) = _read_text(tmp_path, json.dumps(obj))
    assert (o.request_rate, o.num_requests, o.batch) == (4.0, 200, 10)  # 3.9 req/s x 2.5 s
    obj["ramp_up_strategy"] = "linear"  # the rate changes during the run: not one offered rate
    (r,) = _read_text(tmp_path, json.dumps(obj))
    assert r.request_rate is None and r.batch == 16  # the measured peak


def test_sglang_default_rate_written_as_infinity_is_read(tmp_path: Path) -> None:
    """SGLang dumps its default ``request_rate`` float("inf") with json.dumps: ``Infinity``."""
    first = (DATA / "sglang-results.jsonl").read_text().splitlines()[0]
    line = first.replace('"request_rate": "inf"', '"request_rate": Infinity')
    assert "Infinity" in line
    gpu = Setup(gpu="H100-SXM")
    (s,) = _read_text(tmp_path, line, "s.jsonl", gpu)
    assert (s.request_rate, s.num_requests, s.batch) == (None, 200, 8)
    (q,) = _read_text(tmp_path, line.replace("Infinity", "16.0"), "s.jsonl", gpu)
    assert q.request_rate == 16.0
    with pytest.raises(InputError, match=r"s.jsonl: key 'request_rate' is -1.0, not a positive number or 'inf'"):
        _read_text(tmp_path, line.replace("Infinity", "-1.0"), "s.jsonl", gpu)


def test_options_win_over_the_file() -> None:
    (s,) = read_samples(DATA / "vllm-result.json", setup=Setup(tp=2, batch=8))
    assert (s.tp, s.batch) == (2, 8)


def test_sglang_jsonl_reads_the_server_info() -> None:
    samples = read_samples(DATA / "sglang-results.jsonl", setup=Setup(gpu="H100-SXM"))
    assert len(samples) == 2
    s = samples[1]
    assert (s.model, s.tp, s.pp, s.engine, s.weight_dtype, s.kv_dtype) == (
        "meta-llama/Llama-3.1-8B-Instruct", 2, 1, "sglang", "bf16", None,
    )  # fmt: skip
    assert (s.batch, s.input_len, s.output_len, s.ttft_ms, s.tpot_ms) == (64, 1024, 128, 310.5, 11.9)


def test_csv() -> None:
    samples = read_samples(DATA / "samples.csv")
    assert [(s.batch, s.engine, s.tokens_per_s) for s in samples] == [(1, None, 140.0), (16, "vllm", 1450.0)]
    assert samples[0].source.endswith("samples.csv:2")


def test_csv_empty_cells_are_not_measured(tmp_path: Path) -> None:
    f = tmp_path / "a.csv"
    f.write_text("model,gpu,tp,pp,weight_dtype,batch,input_len,output_len,ttft_ms,tpot_ms,tokens_per_s\n"
                 "llama-3.1-8b,h100-sxm,1,1,bf16,4,512,64,,7.5,\n")  # fmt: skip
    (s,) = read_samples(f)
    assert (s.ttft_ms, s.tpot_ms, s.tokens_per_s, s.gpu) == (None, 7.5, None, "H100-SXM")


def test_csv_optional_run_columns(tmp_path: Path) -> None:
    f = tmp_path / "a.csv"
    f.write_text("model,gpu,tp,pp,weight_dtype,batch,input_len,output_len,ttft_ms,tpot_ms,tokens_per_s,"
                 "num_requests,max_batched_tokens,output_dist,ttft_at\n"
                 "llama-3.1-8b,H100-SXM,1,1,bf16,64,200,200,,,3000,1000,16384,exponential,engine\n"
                 "llama-3.1-8b,H100-SXM,1,1,bf16,64,200,200,,,3000,,,,\n")  # fmt: skip
    varied, plain = read_samples(f)
    assert (varied.num_requests, varied.max_batched_tokens, varied.output_dist, varied.ttft_at) == (
        1000, 16384, "exponential", "engine",
    )  # fmt: skip
    assert (plain.num_requests, plain.max_batched_tokens, plain.output_dist, plain.ttft_at) == (
        None, None, "fixed", "client",
    )  # fmt: skip
    bad = tmp_path / "b.csv"
    bad.write_text(f.read_text().replace("exponential", "lognormal"))
    with pytest.raises(InputError, match=r"b.csv:2: output_dist"):
        read_samples(bad)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("bad.csv", "model,gpu,tp\nx,H100-SXM,1\n", r"bad.csv: line 1: missing column\(s\) pp"),
        (
            "bad.csv",
            "model,gpu,tp,pp,weight_dtype,batch,input_len,output_len,ttft_ms,tpot_ms,tokens_per_s\n"
            "m,H100-SXM,1,1,bf16,four,512,64,1,1,1\n",
            r"bad.csv:2: key 'batch' is 'four', not a whole number",
        ),
        (
            "bad.csv",
            "model,gpu,tp,pp,weight_dtype,batch,input_len,output_len,ttft_ms,tpot_ms,tokens_per_s\n"
            "m,H100-SXM,1,1,bf16,4,512,64,,,\n",
            r"bad.csv:2: .*at least one of ttft_ms",
        ),
        (
            "bad.csv",
            "model,gpu,tp,pp,weight_dtype,batch,input_len,output_len,ttft_ms,tpot_ms,tokens_per_s\n"
            "m,Z999,1,1,bf16,4,512,64,1,1,1\n",
            r"bad.csv:2: unknown GPU 'Z999'",
        ),
        ("r.json", '{"model_id": "m", "completed": 3}', r"r.json: key 'total_input_tokens' is missing"),
        ("r.json", '{"model_id": "m", "completed": 3,\n "total_input_tokens": [1]}', r"r.json: key 'total_input_tok"),
        ("r.json", '{"model_id": "m", "completed": 0, "total_input_tokens": 1}', r"r.json: 'completed' is 0"),
        (
            "r.json",
            '{"model_id": "m", "completed": 0.5, "total_input_tokens": 1e308, "total_output_tokens": 1}',
            r"r.json: total_input_tokens / completed is inf tokens per request",
        ),
        ("r.json", '{"model_id": "m", ', r"r.json: line 1, column \d+: not valid JSON"),
        ("s.jsonl", '{"server_info": 3, "completed": 1}\n', r"s.jsonl: key 'server_info' is not an object"),
        ("m.prom", "# TYPE x counter\nvllm:x{a=b} 1\n", r"m.prom:2: bad labels"),
        ("m.prom", 'vllm:x 1\nvllm:y{a="b"} one\n', r"m.prom:2: not a Prometheus sample line|m.prom:2: 'one'"),
        ("m.prom", "# only comments\n", r"m.prom: cannot tell the format|no Prometheus samples"),
        ("x.txt", "hello\n", r"x.txt: cannot tell the format"),
    ],
)
def test_bad_input_is_one_error_naming_the_file(tmp_path: Path, name: str, text: str, message: str) -> None:
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(InputError, match=message):
        read_samples(f)


def test_files_are_read_bounded(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is not a regular file"):
        read_samples("/dev/zero")


def test_detect_format() -> None:
    assert [detect_format((DATA / n).read_text(), source=n) for n in (
        "vllm-result.json", "vllm-append.json", "sglang-results.jsonl", "samples.csv", "vllm-metrics.prom",
    )] == ["vllm", "vllm", "sglang", "csv", "prometheus"]  # fmt: skip


# ---------------------------------------------------------------------------------------- Prometheus


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_window_uses_the_histogram_deltas(engine: str) -> None:
    before, after = exposition_pair(engine)
    w = observe(parse_exposition(after, source="b"), parse_exposition(before, source="a"), seconds=10.0)
    assert w.engine == engine
    assert w.model == "Qwen/Qwen2.5-7B-Instruct"
    assert w.requests == 20
    assert w.ttft_ms == pytest.approx(30.0)
    assert w.tpot_ms == pytest.approx(8.0)
    assert w.input_len == pytest.approx(512) and w.output_len == pytest.approx(64)
    assert w.running == 8  # the gauge's mean over the two scrapes
    assert w.tokens_per_s == pytest.approx(20 * 64 / 10.0)
    s = window_sample(w, SETUP, where="http://e/metrics")
    assert (s.batch, s.input_len, s.output_len, s.engine) == (8, 512, 64, engine)
    assert s.ttft_at == "engine"  # the engine's own histogram: no HTTP path in it


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_one_snapshot_is_the_mean_since_start(engine: str, tmp_path: Path) -> None:
    _, after = exposition_pair(engine)
    f = tmp_path / "m.prom"
    f.write_text(after)
    (s,) = read_samples(f, setup=SETUP)
    assert s.ttft_ms == pytest.approx((10 * 1000 + 20 * 30) / 30)
    assert s.tokens_per_s is None  # one snapshot has no window
    assert s.batch == 12


def test_saved_exposition_fixture_reads() -> None:
    (s,) = read_samples(DATA / "vllm-metrics.prom", setup=SETUP)
    assert s.engine == "vllm" and s.tpot_ms == pytest.approx((10 * 100 + 20 * 8) / 30)  # since start


def test_restart_between_scrapes_is_an_error() -> None:
    before, after = exposition_pair("vllm")
    with pytest.raises(InputError, match="went down between the scrapes"):
        observe(parse_exposition(before, source="b"), parse_exposition(after, source="a"), seconds=1)


def test_non_finite_values_are_ignored() -> None:
    text = (
        "vllm:time_to_first_token_seconds_sum 0.5\nvllm:time_to_first_token_seconds_count 10\n"
        "vllm:num_requests_running NaN\nvllm:request_prompt_tokens_sum +Inf\nvllm:request_prompt_tokens_count 10\n"
    )
    w = observe(parse_exposition(text, source="m"))
    assert w.ttft_ms == pytest.approx(50.0)
    assert (w.running, w.input_len) == (None, None)


def test_no_engine_metrics() -> None:
    with pytest.raises(InputError, match="no vllm: or sglang: metrics"):
        observe(parse_exposition("process_cpu_seconds_total 3\n", source="m"))


def _transport(bodies: Sequence[str], status: int = 200) -> httpx.MockTransport:
    answers = iter(bodies)
    return httpx.MockTransport(lambda request: httpx.Response(status, text=next(answers)))


def test_scrape() -> None:
    _, after = exposition_pair("sglang")
    exp = scrape("http://127.0.0.1:30000/metrics", transport=_transport([after]))
    assert exp.total("sglang:e2e_request_latency_seconds_count") == 30


@pytest.mark.parametrize(
    ("url", "status", "message"),
    [("file:///etc/passwd", 200, "not an http"), ("http://127.0.0.1:1/metrics", 500, "HTTP 500")],
)
def test_scrape_errors(url: str, status: int, message: str) -> None:
    with pytest.raises(InputError, match=message):
        scrape(url, transport=_transport(["x"], status))


def test_fixture_files_carry_the_engines_keys() -> None:
    """The fixtures hold the keys the readers use (guards against editing them into something else)."""
    v = json.loads((DATA / "vllm-result.json").read_text())
    assert {"model_id", "max_concurrency", "completed", "total_input_tokens", "mean_tpot_ms"} <= set(v)
    s = json.loads((DATA / "sglang-results.jsonl").read_text().splitlines()[0])
    assert {"server_info", "random_input_len", "concurrency", "mean_ttft_ms"} <= set(s)
