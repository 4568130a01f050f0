"""Calibration: leave-one-out and leave-group-out errors, and a profile fitted on a user's samples.

``perf/sample_predict.py`` says what the model predicts for a sample, ``perf/fitting.py`` fits the
coefficients; this module holds the validations (``leave_one_out``, ``leave_group_out``) and
``fit_profile`` (what ``toposched calibrate`` and ``benchmarks/anchors_loo.py --write-profile`` write).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from toposched.errors import InputError
from toposched.perf.coefficients import PerfConfig
from toposched.perf.engine_names import engine_of, known_engine
from toposched.perf.fitting import CALIBRATION_FIELDS, Fitter, fit_config, pooled_fitter
from toposched.perf.hardware import get_gpu
from toposched.perf.profile import ANY, Profile, ProfileEntry
from toposched.perf.sample_predict import relative_errors, spec_of
from toposched.perf.samples import Sample

MIN_SAMPLES_PER_FIELD = 2
"""Samples a (GPU, weight dtype) needs per fitted field for its own profile entry (fewer share ``*``)."""


def leave_one_out(
    samples: Sequence[Sample], *, fitter: Fitter | None = None, **kw: Any
) -> list[tuple[Sample, dict[str, float]]]:
    """Relative error per kind of each sample, predicted with the config fitted on all the others
    (``fitter``, default ``pooled_fitter(**kw)``)."""
    fit = fitter or pooled_fitter(**kw)
    out: list[tuple[Sample, dict[str, float]]] = []
    for i, s in enumerate(samples):
        rest = [t for j, t in enumerate(samples) if j != i]
        out.append((s, relative_errors(s, fit(rest)(s))))
    return out


def leave_group_out(
    samples: Sequence[Sample], group_of: Callable[[Sample], str], *, fitter: Fitter | None = None, **kw: Any
) -> list[tuple[Sample, dict[str, float]]]:
    """Relative error per kind of each sample, predicted with the config fitted on the samples of every
    other group (``group_of``: a sample's publication, engine, GPU...): what the model makes of a whole
    source it never saw, where ``leave_one_out`` still fits on the held-out row's siblings. A sample
    whose group holds every sample is left out (nothing to fit on). In the order of ``samples``."""
    fit = fitter or pooled_fitter(**kw)
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(group_of(s), []).append(i)
    errors: dict[int, dict[str, float]] = {}
    for members in groups.values():
        rest = [t for j, t in enumerate(samples) if j not in set(members)]
        if not rest:
            continue
        priced = fit(rest)
        for i in members:
            errors[i] = relative_errors(samples[i], priced(samples[i]))
    return [(samples[i], errors[i]) for i in sorted(errors)]


def mean_abs_by_kind(errors: Sequence[tuple[Sample, dict[str, float]]]) -> dict[str, float]:
    """Mean |relative error| per kind over ``errors`` (kinds with no sample are left out)."""
    by: dict[str, list[float]] = {}
    for _, errs in errors:
        for kind, e in errs.items():
            by.setdefault(kind, []).append(abs(e))
    return {kind: sum(v) / len(v) for kind, v in by.items()}


def fit_profile(
    samples: Sequence[Sample],
    *,
    name: str,
    source: str,
    base: PerfConfig | None = None,
    fields: Sequence[str] = CALIBRATION_FIELDS,
    progress: Callable[[str], None] | None = None,
    scoped: bool = True,
    per_group: bool = True,
) -> Profile:
    """A profile: a shared configuration fitted on all samples, and one entry per (GPU, weight dtype,
    engine, engine version, model family) with at least ``MIN_SAMPLES_PER_FIELD`` samples per fitted field,
    fitted on those alone (from ``base``, so its leave-one-out error never sees the held-out sample); LOO
    errors recorded in each entry.

    ``scoped`` (a user's calibration): the shared configuration is written once per (GPU, engine, engine
    version, model family) the samples ran, so the profile prices only what it saw and everything else falls
    back to the shipped profile (a sample without an engine matches any engine, one without a version any
    version of its engine). Not scoped (the shipped profile,
    fitted on the published anchors): one catch-all ``*`` entry. ``per_group`` False: no entries of
    their own for groups with enough samples (the shipped profile is the pooled fit its held-out figures
    measure)."""
    if not samples:
        raise InputError("no samples to fit a profile on", fix="pass benchmark results with TTFT/TPOT/throughput")
    say = progress or (lambda _msg: None)
    say(f"fitting the shared entry on {len(samples)} samples")
    shared = fit_config(samples, base=base, fields=fields)
    # leave-one-out needs a sample to fit on after one is held out; each refit starts from the shared fit
    refit = pooled_fitter(start=shared, base=base, fields=fields)
    loo = mean_abs_by_kind(leave_one_out(samples, fitter=refit)) if len(samples) > 1 else {}
    scopes = sorted({(g, ANY, e, v, f) for g, _w, e, v, f in map(sample_scope, samples)}) if scoped else [(ANY,) * 5]
    entries = [_entry(scope, shared, len(samples), loo) for scope in scopes]
    groups: dict[tuple[str, str, str, str, str], list[Sample]] = {}
    for s in samples:
        gpu, wdt, engine, version, family = sample_scope(s)
        key = (gpu, wdt, engine, version, family) if scoped else (gpu, wdt, ANY, ANY, ANY)
        groups.setdefault(key, []).append(s)
    for scope, group in sorted(groups.items()):
        if not per_group or len(group) < MIN_SAMPLES_PER_FIELD * len(fields):
            continue
        gpu, wdt, engine, version, family = scope
        at = engine if version == ANY else f"{engine} {version}"
        say(f"fitting {gpu}/{wdt}/{at}/{family} on {len(group)} samples")
        cfg = fit_config(group, base=base, fields=fields)
        errs = mean_abs_by_kind(leave_one_out(group, fitter=pooled_fitter(start=cfg, base=base, fields=fields)))
        entries.append(_entry(scope, cfg, len(group), errs))
    return Profile(name=name, source=source, entries=tuple(entries))


def _entry(scope: tuple[str, str, str, str, str], cfg: PerfConfig, samples: int, loo: dict[str, float]) -> ProfileEntry:
    """A profile entry for ``scope``: (GPU, weight dtype, engine, engine version, model family)."""
    gpu, wdt, engine, version, family = scope
    return ProfileEntry(gpu=gpu, weight_dtype=wdt, engine=engine, engine_version=version, model_family=family,
                        config=cfg, samples=samples, loo_mean_abs_error=loo)  # fmt: skip


def sample_scope(sample: Sample) -> tuple[str, str, str, str, str]:
    """(GPU, weight dtype, engine, engine version, model family) of a sample, ``*`` for an engine, version or
    family it does not name. An engine the cost model does not know is an error: an entry for it would
    never price anything; so is a version without an engine."""
    if sample.engine and not known_engine(sample.engine):
        raise InputError(
            f"sample {sample.source}: engine {sample.engine[:50]!r} is not one the cost model knows",
            fix="name it vllm, sglang, trtllm, tensorrt-llm or nvidia-nim (its version in --engine-version)",
        )
    if sample.engine_version and not sample.engine:
        raise InputError(f"sample {sample.source}: an engine version with no engine", fix="add --engine")
    spec = spec_of(sample)
    engine = engine_of(sample.engine) or ANY
    return (get_gpu(sample.gpu).name, str(spec.weight_dtype), engine, sample.engine_version or ANY,
            spec.model_type or ANY)  # fmt: skip


__all__ = ["fit_profile", "leave_group_out", "leave_one_out", "mean_abs_by_kind", "sample_scope"]
