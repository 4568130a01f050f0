"""``toposched calibrate``: fit the cost model's coefficients to the user's own measurements.

Reads samples (``perf/readers.py``: vLLM ``bench serve --save-result`` JSON, SGLang
``bench_serving`` JSONL, the documented CSV, a saved Prometheus exposition, or a live engine's
``/metrics`` over a window), fits a profile (``perf/calibrate.py``: ``fit_profile``), prints the
leave-one-out error per kind and the fitted coefficients, and writes the profile for
``--profile FILE`` of ``plan``, ``simulate``, ``serve`` and ``workload estimate``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError
from rich.markup import escape

from toposched.cli._common import console, err_console, print_json
from toposched.cli.progress import QUIET, Reporter
from toposched.errors import InputError, first_problem
from toposched.perf.profile import Profile, load_profile, save_profile
from toposched.perf.prometheus import observe, scrape, window_sample
from toposched.perf.readers import FORMATS, read_samples
from toposched.perf.sample_setup import Setup
from toposched.perf.samples import Sample

MAX_WINDOW_S = 3600.0

PROFILE = typer.Option(
    None, "--profile", help="Cost-model profile (`toposched calibrate --profile`) [default: shipped].", metavar="FILE"
)
"""``--profile FILE`` of the commands that predict latency (plan, simulate, serve)."""


def profile_option(path: Path | None) -> Profile | None:
    """The profile ``--profile`` names (None: the shipped default)."""
    return load_profile(path) if path is not None else None


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)


def _setup(values: dict[str, Any]) -> Setup:
    try:
        return Setup.model_validate(values)
    except ValidationError as exc:
        problem = first_problem(exc)
        flag = "--" + problem.field.replace("_", "-")
        raise InputError(f"{flag}: {problem.msg} (got {problem.input!r:.60})") from None


def live_sample(url: str, window_s: float, setup: Setup, *, sleep: Any = time.sleep, transport: Any = None) -> Sample:
    """Scrape ``url`` twice, ``window_s`` apart: the engine's means over that window."""
    if not 1 <= window_s <= MAX_WINDOW_S:
        raise InputError(f"--window must be from 1 to {MAX_WINDOW_S:g} seconds (got {window_s:g})")
    start = time.monotonic()
    before = scrape(url, transport=transport)
    sleep(window_s)
    after = scrape(url, transport=transport)
    seconds = max(time.monotonic() - start, window_s)
    return window_sample(observe(after, before, seconds=seconds), setup, where=url[:200])


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def samples_json(samples: list[Sample]) -> list[dict[str, Any]]:
    return [s.model_dump(mode="json", exclude_none=True) for s in samples]


def _engine_label(s: Sample) -> str:
    """`` (vllm 0.11.0)``, `` (vllm)`` or nothing."""
    if not s.engine:
        return ""
    return f" ({s.engine}{' ' + s.engine_version if s.engine_version else ''})"


def _print_samples(samples: list[Sample]) -> None:
    console.print(f"[bold]{len(samples)} sample{'s' if len(samples) != 1 else ''}[/]")
    for s in samples:
        degrees = f"tp={s.tp} pp={s.pp}" + (f" ep={s.ep}" if s.ep > 1 else "")
        console.print(
            f"  {s.source}: {s.model} on {s.gpu} {degrees} {s.weight_dtype or 'model dtype'}"
            f"{_engine_label(s)}, batch {s.batch}, {s.input_len} in / {s.output_len} out: "
            f"TTFT {_fmt(s.ttft_ms, '.1f')} ms, TPOT {_fmt(s.tpot_ms, '.2f')} ms, "
            f"{_fmt(s.tokens_per_s, ',.0f')} tok/s",
            soft_wrap=True,
            markup=False,
        )


def _print_profile(profile: Profile) -> None:
    console.print(
        "Entries by GPU / weight dtype / engine / model family: each prices only those setups (* any); "
        "every other setup keeps the shipped profile's coefficients.",
        soft_wrap=True,
        markup=False,
    )
    for entry in profile.entries:
        loo = ", ".join(f"{k} {v:.1%}" for k, v in entry.loo_mean_abs_error.items()) or "n/a"
        engine = entry.engine + ("" if entry.engine_version == "*" else f" {entry.engine_version}")
        scope = f"{entry.gpu} / {entry.weight_dtype} / {engine} / {entry.model_family}"
        console.print(
            f"[bold]{escape(scope)}[/]: {entry.samples} samples; leave-one-out mean |error|: {loo}", soft_wrap=True
        )
        coeffs = ", ".join(f"{k}={v:g}" for k, v in entry.config.model_dump().items())
        console.print(f"  {coeffs}", soft_wrap=True, markup=False)


def calibrate(
    files: list[Path] = typer.Argument(
        None, help="Benchmark results: vLLM JSON, SGLang JSONL, CSV, /metrics text.", metavar="FILE..."
    ),
    fmt: str = typer.Option("auto", "--format", help=f"File format: {'|'.join(FORMATS)}."),
    metrics_url: str | None = typer.Option(None, "--metrics-url", help="A live engine's /metrics URL.", metavar="URL"),
    window: float = typer.Option(60.0, "--window", help="Seconds between the two scrapes of --metrics-url."),
    model: str | None = typer.Option(None, "--model", "-m", help="Model (catalog name, HF id, config.json path)."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU type the samples ran on (e.g. H100-SXM)."),
    engine: str | None = typer.Option(None, "--engine", help="Engine (vllm, sglang, ...)."),
    engine_version: str | None = typer.Option(
        None, "--engine-version", help="The engine's version (e.g. 0.11.0): the profile prices only that version."
    ),
    tp: int | None = typer.Option(None, "--tp", help="Tensor-parallel degree."),
    pp: int | None = typer.Option(None, "--pp", help="Pipeline-parallel degree."),
    ep: int | None = typer.Option(None, "--ep", help="Expert-parallel degree."),
    weight_dtype: str | None = typer.Option(None, "--weight-dtype", help="bf16|fp16|fp8|int8|int4."),
    kv_dtype: str | None = typer.Option(None, "--kv-dtype", help="auto|bf16|fp16|fp8|int8|int4."),
    link: str | None = typer.Option(None, "--link", help="Link between the TP ranks (perf link key)."),
    batch: int | None = typer.Option(None, "--batch", help="Concurrency the samples ran at."),
    input_len: int | None = typer.Option(None, "--input-len", help="Prompt length of the samples."),
    output_len: int | None = typer.Option(None, "--output-len", help="Output length of the samples."),
    profile_out: Path | None = typer.Option(None, "--profile", help="Write the fitted profile here.", metavar="OUT"),
    name: str = typer.Option("calibrated", "--name", help="Name recorded in the profile."),
    samples_only: bool = typer.Option(False, "--samples-only", help="Read and print the samples; fit nothing."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quiet: bool = QUIET,
) -> None:
    """Fit the cost model to your benchmark results; print leave-one-out errors; write a profile."""
    setup = _setup(
        {
            "model": model, "gpu": gpu, "engine": engine, "engine_version": engine_version, "tp": tp, "pp": pp,
            "ep": ep, "weight_dtype": weight_dtype, "kv_dtype": kv_dtype, "link": link, "batch": batch,
            "input_len": input_len, "output_len": output_len,
        }
    )  # fmt: skip
    if not 1 <= len(name) <= 200:
        raise InputError("--name must be 1 to 200 characters")
    files = files or []
    if not files and metrics_url is None:
        raise InputError("calibrate needs benchmark files or --metrics-url", fix="e.g. toposched calibrate r.json")
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    if profile_out is not None and not profile_out.parent.is_dir():  # before minutes of fitting
        raise InputError(f"--profile {str(profile_out)[:80]!r}: no such directory", fix="create it first")
    with Reporter("calibrate", quiet=quiet) as progress:
        samples: list[Sample] = []
        for i, f in enumerate(files, 1):
            progress.stage(f"reading {str(f)[:80]}", step=(i, len(files)))
            samples.extend(read_samples(f, fmt=fmt, setup=setup))
        if metrics_url is not None:
            progress.end()
            if not quiet:
                err_console.print(f"scraping {metrics_url[:80]} twice, {window:g} s apart", markup=False)
            progress.stage(f"scraping {metrics_url[:80]} ({window:g} s)")
            samples.append(live_sample(metrics_url, window, setup))
        if not samples:
            raise InputError("the files hold no samples", fix="pass benchmark results with TTFT/TPOT/throughput")
        profile = None
        if not samples_only:
            source = ", ".join([str(f) for f in files] + ([metrics_url] if metrics_url else []))
            profile = _fit(samples, name=name, source=source, progress=progress)
    if profile is None:
        if json_out:
            print_json({"samples": samples_json(samples)})
        else:
            _print_samples(samples)
        return
    if profile_out is not None:
        save_profile(profile, profile_out)
    if json_out:
        print_json({"samples": samples_json(samples), "profile": profile.model_dump(mode="json")})
    else:
        _print_samples(samples)
        _print_profile(profile)
    if profile_out is not None:
        err_console.print(f"wrote {profile_out}", markup=False)


def _fit(samples: list[Sample], *, name: str, source: str, progress: Reporter) -> Profile:
    try:
        from toposched.perf.calibrate import fit_profile
    except ImportError:  # the fitting module is not part of this build
        raise InputError(
            "fitting is not available in this build (toposched.perf.calibrate is missing)",
            fix="use --samples-only to check the samples",
        ) from None
    from toposched.workload import resolve_model

    progress.stage("checking the samples' models")
    checked: set[str] = set()
    for s in samples:  # an unknown model names the sample, not just the model
        if s.model not in checked:
            try:
                resolve_model(s.model)
            except InputError as exc:
                raise InputError(f"{s.source}: {exc.message}", fix=exc.fix or "pass --model") from None
            checked.add(s.model)
    return fit_profile(samples, name=name, source=source[:2000], progress=progress.say)


__all__ = ["PROFILE", "calibrate", "live_sample", "profile_option", "register"]
