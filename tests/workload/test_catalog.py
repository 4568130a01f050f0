"""The built-in catalog: names, aliases, published totals."""

from __future__ import annotations

import pytest

from tests.conftest import FIXTURES
from toposched.errors import InputError, UnknownNameError
from toposched.registry import Registry
from toposched.workload.catalog import ENTRIES, catalog, resolve_model

REQUIRED = [
    "llama-3-8b", "llama-3-70b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b",
    "mixtral-8x7b", "mixtral-8x22b", "qwen2.5-72b", "qwen3-235b-a22b", "deepseek-v3",
]  # fmt: skip


def test_required_names_present() -> None:
    assert set(REQUIRED) <= set(catalog())


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_derived_params_within_one_percent_of_published(entry: object) -> None:
    spec = catalog()[entry.name]  # type: ignore[attr-defined]
    assert spec.published_params is not None
    assert abs(spec.params_total - spec.published_params) / spec.published_params < 0.01


def test_names_are_case_insensitive_and_hf_ids_resolve() -> None:
    assert resolve_model("LLaMA-3.1-70B").name == "llama-3.1-70b"
    assert resolve_model("meta-llama/Meta-Llama-3.1-70B").name == "llama-3.1-70b"
    assert resolve_model("deepseek-ai/deepseek-v3").name == "deepseek-v3"


def test_unknown_name_suggests_close_ones() -> None:
    with pytest.raises(UnknownNameError, match=r"did you mean 'llama-3.1-70b'") as info:
        resolve_model("llama-3.1-70")
    assert info.value.kind == "model"


def test_dtype_overrides_and_local_paths() -> None:
    spec = resolve_model("llama-3-70b", weight_dtype="fp8", kv_dtype="fp8")
    assert (spec.weight_dtype, spec.kv_dtype) == ("fp8", "fp8")
    local = resolve_model(str(FIXTURES / "model_configs" / "Mixtral-8x22B-v0.1.json"))
    assert local.params_total == 140_620_634_112
    with pytest.raises(InputError, match="no such file"):
        resolve_model("./missing/config.json")


def test_registry_rejects_duplicates_and_alias_clashes() -> None:
    reg: Registry[int] = Registry("thing")
    reg.register("Alpha", 1, aliases=["a"])
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("alpha", 2)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("beta", 3, aliases=["A"])
    assert reg.get("ALPHA") == 1 and reg.get("a") == 1 and reg.canonical("A") == "Alpha"
