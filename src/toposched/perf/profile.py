"""Calibration profiles: the cost model's coefficients per GPU, weight dtype, engine and model family.

A ``Profile`` maps a scope (GPU, weight dtype, engine, model family; ``*`` matches any) to a
``PerfConfig``. ``toposched calibrate`` writes one from the user's own benchmarks, with entries scoped
to what the benchmarks ran (the GPUs, engines and model families seen: never a catch-all), so a profile
fitted on a Llama run on vLLM does not reprice DeepSeek-V3 or TensorRT-LLM; the shipped default
(``data/profiles/default.json``) is fitted on the published anchors and prices everything else.
``active_entry`` is what ``predict_latency`` and ``StepCost`` use when no ``PerfConfig`` is passed: the
most specific matching entry of the profile set with ``use_profile`` (a context variable, so nothing
leaks between runs or threads), else of the default profile, else ``PerfConfig()``; its ``Priced`` says
which profile and entry that was (``toposched estimate`` prints it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from toposched.errors import InputError, first_problem
from toposched.inputs import load_json, read_text
from toposched.perf.coefficients import PerfConfig
from toposched.perf.engine_names import ENGINE_ALIASES, engine_of, engine_version, version_matches, version_of

ANY = "*"


class ProfileEntry(BaseModel):
    """Coefficients for one GPU type and weight dtype (``*`` matches any)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    gpu: str = Field(default=ANY, min_length=1, max_length=100)
    weight_dtype: str = Field(default=ANY, min_length=1, max_length=40)
    engine: str = Field(default=ANY, min_length=1, max_length=50, description="cost engine (``engine_of``) or *")
    engine_version: str = Field(
        default=ANY,
        min_length=1,
        max_length=41,
        description="the engine version it was fitted on, or *: holds the versions it leads (0.11 holds 0.11.2)",
    )
    model_family: str = Field(
        default=ANY, min_length=1, max_length=100, description="config.json model_type (llama, deepseek_v3, ...) or *"
    )
    config: PerfConfig
    samples: int = Field(default=0, ge=0, description="samples the entry was fitted on")

    @field_validator("config", mode="before")
    @classmethod
    def _older_profiles(cls, value: object) -> object:
        """A profile written before the attention term was measured (no ``attn_s_half``) prices attention
        as it was fitted with: a flat ``eta_attn``, the KV read at ``eta_mem``, no kernel floors (else its
        ``eta_attn`` would meet the tables' curve and floors and price prefill attention up to 5x slower); one
        written before the GEMM width curve (no ``gemm_n_half``) keeps its flat GEMM efficiencies."""
        if isinstance(value, dict) and "eta_attn" in value and "attn_s_half" not in value:
            old = {"attn_s_half": 0.0, "attn_us": 0.0, "attn_us_decode": 0.0, "attn_seq_ns": 0.0}
            value = {**old, "eta_kv": value.get("eta_mem", PerfConfig().eta_mem), **value}
        if isinstance(value, dict) and "eta_flops" in value and "gemm_n_half" not in value:
            # written before the GEMM width curve: its flat efficiencies were fitted without it
            value = {"gemm_n_half": 0.0, "gemm_n_half_fp8": 0.0, **value}
        return value

    @field_validator("engine")
    @classmethod
    def _cost_engine(cls, value: str) -> str:
        """``*`` or an engine the cost model knows, under its one name (``trtllm`` is ``tensorrt-llm-pytorch``):
        an entry for a name no prediction uses would never price anything."""
        if value == ANY:
            return value
        if value.strip().lower() not in ENGINE_ALIASES:
            raise ValueError(f"engine {value[:50]!r} is not one of *, {', '.join(sorted(ENGINE_ALIASES))}")
        return engine_of(value) or ANY

    @field_validator("engine_version")
    @classmethod
    def _version(cls, value: str) -> str:
        """``*`` or a version (``perf/engine_names.engine_version``)."""
        return value if value == ANY else (engine_version(value) or ANY)

    @model_validator(mode="after")
    def _versioned_engine(self) -> ProfileEntry:
        """A version belongs to one engine: versions of different engines are not comparable."""
        if self.engine_version != ANY and self.engine == ANY:
            raise ValueError(f"engine_version {self.engine_version!r} needs the engine it is a version of")
        return self

    loo_mean_abs_error: dict[str, float] = Field(
        default_factory=dict, description="leave-one-out mean |relative error| per kind (ttft, tpot, ...)"
    )


class Profile(BaseModel):
    """A calibration profile (versioned; JSON on disk)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    version: Literal[1] = 1
    name: str = Field(default="profile", min_length=1, max_length=200)
    source: str = Field(default="", max_length=2000, description="what it was fitted on")
    entries: tuple[ProfileEntry, ...] = ()

    def entry_for(
        self, gpu: str, weight_dtype: str, *, engine: str | None = None, family: str | None = None
    ) -> ProfileEntry | None:
        """The most specific entry whose scope holds the setup, or None. Each scope field is ``*`` or
        the setup's value (an unknown engine or family, None, is matched by ``*`` only; an entry's engine
        version holds the versions it leads, ``engine`` may carry one: ``vllm==0.11.0``); more named
        fields win, and among as many, the GPU counts most, then the weight dtype, the engine, its
        version (the longer the more specific), the family; the first entry in the file wins a tie."""
        name, version = engine_of(engine), version_of(engine)
        best: tuple[tuple[int, ...], ProfileEntry] | None = None
        for entry in self.entries:
            fields = ((entry.gpu, gpu), (entry.weight_dtype, weight_dtype), (entry.engine, name),
                      (entry.model_family, family))  # fmt: skip
            if any(have != ANY and have != want for have, want in fields):
                continue
            if entry.engine_version != ANY and not version_matches(entry.engine_version, version):
                continue
            gpu_, dtype_, engine_, family_ = (int(have != ANY) for have, _want in fields)
            versioned = int(entry.engine_version != ANY)
            # a longer version (0.11.2) is more specific than the one it extends (0.11)
            depth = len(entry.engine_version.split(".")) if versioned else 0
            rank = (gpu_ + dtype_ + engine_ + versioned + family_, gpu_, dtype_, engine_, depth, family_)
            if best is None or rank > best[0]:
                best = (rank, entry)
        return None if best is None else best[1]

    def find(
        self, gpu: str, weight_dtype: str, *, engine: str | None = None, family: str | None = None
    ) -> PerfConfig | None:
        """``entry_for``'s coefficients, or None."""
        entry = self.entry_for(gpu, weight_dtype, engine=engine, family=family)
        return None if entry is None else entry.config

    def config_for(
        self, gpu: str, weight_dtype: str, *, engine: str | None = None, family: str | None = None
    ) -> PerfConfig:
        """``find``, else the uncalibrated ``PerfConfig()``."""
        return self.find(gpu, weight_dtype, engine=engine, family=family) or PerfConfig()


MAX_PROFILE_BYTES = 1024 * 1024


def load_profile(path: str | Path) -> Profile:
    """A profile file; one error naming the file and the key when it is not one."""
    text = read_text(path, what="profile", max_bytes=MAX_PROFILE_BYTES)
    raw = load_json(text, source=str(path))
    try:
        return Profile.model_validate(raw)
    except ValidationError as exc:
        problem = first_problem(exc)
        raise InputError(
            f"profile {path}: {problem.path}: {problem.msg}", fix="write it with `toposched calibrate --profile FILE`"
        ) from None


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write ``profile`` as JSON; one error naming the file when it cannot be written."""
    try:
        Path(path).write_text(json.dumps(profile.model_dump(mode="json"), indent=1) + "\n")
    except OSError as exc:
        raise InputError(
            f"profile {str(path)[:80]!r} cannot be written: {exc.strerror}", fix="check the path"
        ) from None


@cache
def default_profile() -> Profile:
    """The shipped profile (fitted on the published anchors), or an empty one."""
    ref = resources.files("toposched") / "data" / "profiles" / "default.json"
    if not ref.is_file():
        return Profile(name="empty")
    return Profile.model_validate_json(ref.read_text())


_active: ContextVar[Profile | None] = ContextVar("toposched_profile", default=None)


@contextmanager
def use_profile(profile: Profile | None) -> Iterator[None]:
    """Use ``profile`` for predictions made inside the block (None: the default profile)."""
    token = _active.set(profile)
    try:
        yield
    finally:
        _active.reset(token)


def set_thread_profile(profile: Profile | None) -> None:
    """Use ``profile`` in the calling thread from now on: a thread pool's ``initializer``.

    A thread starts with an empty context, so a profile set with ``use_profile`` in the thread that
    created the pool is not seen by its workers; ``ThreadPoolExecutor(initializer=set_thread_profile,
    initargs=(profile,))`` makes every worker use it for its lifetime.
    """
    _active.set(profile)


def active_profile() -> Profile:
    return _active.get() or default_profile()


class Priced(BaseModel):
    """Which coefficients priced a prediction: the profile's name and the scope of its entry (None: no
    entry matched anywhere, the uncalibrated ``PerfConfig()``)."""

    model_config = ConfigDict(frozen=True)

    profile: str
    entry: dict[str, str] | None
    samples: int = 0
    shipped: bool
    """Whether it is the shipped default profile (not one set with ``use_profile``)."""

    def describe(self) -> str:
        """One line: ``profile 'mine', entry H100-SXM / * / vllm / llama (12 samples)``."""
        if self.entry is None:
            return "the uncalibrated defaults (no profile entry matches)"
        version = self.entry.get("engine_version", ANY)
        engine = self.entry["engine"] + ("" if version == ANY else f" {version}")
        scope = " / ".join((self.entry["gpu"], self.entry["weight_dtype"], engine, self.entry["model_family"]))
        which = "the shipped profile" if self.shipped else f"profile {self.profile!r}"
        return f"{which}, entry {scope} (gpu / weight dtype / engine / family; {self.samples} samples)"


def _priced(profile: Profile, entry: ProfileEntry | None, shipped: bool) -> Priced:
    scope = (
        None
        if entry is None
        else entry.model_dump(include={"gpu", "weight_dtype", "engine", "engine_version", "model_family"})
    )
    return Priced(profile=profile.name, entry=scope, samples=entry.samples if entry else 0, shipped=shipped)


def active_entry(
    gpu: str, weight_dtype: str, *, engine: str | None = None, family: str | None = None
) -> tuple[PerfConfig, Priced]:
    """The coefficients predictions use for this setup and where they come from: the active profile's
    most specific entry whose scope holds it, else the shipped default profile's (a user profile prices
    only the GPUs, engines and families it was fitted on), else the uncalibrated ``PerfConfig()``."""
    profile, shipped = active_profile(), default_profile()
    entry = profile.entry_for(gpu, weight_dtype, engine=engine, family=family)
    if entry is not None:
        return entry.config, _priced(profile, entry, profile is shipped)
    entry = shipped.entry_for(gpu, weight_dtype, engine=engine, family=family)
    return (entry.config if entry else PerfConfig()), _priced(shipped, entry, True)


def active_config(gpu: str, weight_dtype: str, *, engine: str | None = None, family: str | None = None) -> PerfConfig:
    """``active_entry``'s coefficients."""
    return active_entry(gpu, weight_dtype, engine=engine, family=family)[0]


__all__ = [
    "ANY",
    "Priced",
    "Profile",
    "ProfileEntry",
    "active_config",
    "active_entry",
    "active_profile",
    "default_profile",
    "load_profile",
    "save_profile",
    "set_thread_profile",
    "use_profile",
]
