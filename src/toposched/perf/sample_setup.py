"""What ran, given as options (``Setup``), and the ``Sample`` a reader makes from the fields a file or a
scrape gave and those options (``make_sample``), for every format ``perf/readers.py`` reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toposched.errors import InputError, UnknownNameError, first_problem
from toposched.perf.engine_names import EngineName, EngineVersion, engine_of
from toposched.perf.hardware import gpu_registry
from toposched.perf.links import link_registry
from toposched.perf.samples import Sample
from toposched.workload.dtypes import parse_kv_dtype, parse_weight_dtype


class Setup(BaseModel):
    """What ran, given as options: fills in what a file does not record and wins over what it does."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = Field(default=None, min_length=1, max_length=500)
    gpu: str | None = Field(default=None, min_length=1, max_length=100)
    engine: EngineName | None = Field(default=None, min_length=1, max_length=50)
    engine_version: EngineVersion | None = Field(default=None, min_length=1, max_length=41)
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
    given = setup.given()
    if (
        "engine" in given
        and "engine_version" not in given
        and engine_of(given["engine"]) != engine_of(data.get("engine"))
    ):
        data.pop("engine_version", None)  # the file's version is its own engine's, not the one --engine names
    data.update(given)
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


__all__ = ["Setup", "make_sample"]
