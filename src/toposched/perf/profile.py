"""Calibration profiles: the cost model's coefficients per GPU and weight dtype.

A ``Profile`` maps (GPU, weight dtype) to a ``PerfConfig``. ``toposched calibrate`` writes one
from the user's own benchmarks; the shipped default (``data/profiles/default.json``) is fitted on
the published anchors. ``active_config`` is what ``predict_latency`` and ``StepCost`` use when no
``PerfConfig`` is passed: the profile set with ``use_profile`` (a context variable, so nothing
leaks between runs or threads), else the default profile, else ``PerfConfig()``.
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

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toposched.errors import InputError, first_problem
from toposched.inputs import load_json, read_text
from toposched.perf.coefficients import PerfConfig

ANY = "*"


class ProfileEntry(BaseModel):
    """Coefficients for one GPU type and weight dtype (``*`` matches any)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    gpu: str = Field(default=ANY, min_length=1, max_length=100)
    weight_dtype: str = Field(default=ANY, min_length=1, max_length=40)
    config: PerfConfig
    samples: int = Field(default=0, ge=0, description="samples the entry was fitted on")
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

    def find(self, gpu: str, weight_dtype: str) -> PerfConfig | None:
        """The most specific entry: exact GPU and dtype, then GPU, then dtype, then ``*``/``*``; or None."""
        for want_gpu, want_dtype in ((gpu, weight_dtype), (gpu, ANY), (ANY, weight_dtype), (ANY, ANY)):
            for entry in self.entries:
                if entry.gpu == want_gpu and entry.weight_dtype == want_dtype:
                    return entry.config
        return None

    def config_for(self, gpu: str, weight_dtype: str) -> PerfConfig:
        """``find``, else the uncalibrated ``PerfConfig()``."""
        return self.find(gpu, weight_dtype) or PerfConfig()


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


def active_config(gpu: str, weight_dtype: str) -> PerfConfig:
    """The coefficients predictions use for this GPU type and weight dtype: the active profile's entry,
    else the shipped default profile's (a user profile fitted on one GPU type still predicts the
    others as calibrated), else the uncalibrated ``PerfConfig()``."""
    profile = active_profile()
    found = profile.find(gpu, weight_dtype)
    if found is None and profile is not default_profile():
        found = default_profile().find(gpu, weight_dtype)
    return found or PerfConfig()


__all__ = [
    "ANY",
    "Profile",
    "ProfileEntry",
    "active_config",
    "active_profile",
    "default_profile",
    "load_profile",
    "save_profile",
    "set_thread_profile",
    "use_profile",
]
