"""The built-in model catalog, made from the ``config.json`` files shipped in ``toposched/data/models``.

Each entry names the config file, the Hugging Face id, and the published parameter total that the
count derived from the architecture is checked against (tests require agreement within 1 %).
Names are case-insensitive; Hugging Face ids work as aliases. ``resolve_model`` accepts a catalog
name, a Hugging Face id, a local ``config.json`` or a local model directory (no downloads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from pathlib import Path

from toposched.errors import InputError
from toposched.inputs import load_json, read_text
from toposched.registry import Registry
from toposched.workload.dtypes import KvDtype, WeightDtype
from toposched.workload.hf_config import load_config, spec_from_config
from toposched.workload.spec import ModelSpec


@dataclass(frozen=True)
class CatalogEntry:
    """Where a catalog model's config lives and what its publisher says it has."""

    name: str
    config_file: str
    hf_id: str
    published_params: int
    published_source: str
    aliases: tuple[str, ...] = ()
    chat: bool = True
    """Whether ``hf_id`` is a chat (instruction-tuned) checkpoint; False: a base model, which a launch of
    the entry's name serves as it is (``base_checkpoint_note`` says so and names the chat sibling)."""


# Published totals. "safetensors" = the parameter total Hugging Face shows from the checkpoint's
# weight files; perf-anchors.md §5.2 quotes the exact sums for Llama-3.1-8B and Qwen2.5-72B.
ENTRIES: tuple[CatalogEntry, ...] = (
    CatalogEntry(
        "llama-3-8b",
        "Meta-Llama-3-8B-Instruct.json",
        "meta-llama/Meta-Llama-3-8B",
        8_030_261_248,  # HF safetensors total, same as Llama-3.1-8B (perf-anchors.md §5.2)
        "HF safetensors total 8.03B (perf-anchors.md §5.2)",
        aliases=("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b-instruct"),
        chat=False,
    ),
    CatalogEntry(
        "llama-3-70b",
        "Meta-Llama-3-70B.json",
        "meta-llama/Meta-Llama-3-70B",
        70_553_706_496,  # ollama PR #6279 log "70.55 B" (engines.md §1.4)
        "ollama PR #6279 log, 70.55B (engines.md §1.4)",
        aliases=("meta-llama/Meta-Llama-3-70B-Instruct", "llama-3-70b-instruct"),
        chat=False,
    ),
    CatalogEntry(
        "llama-3.1-8b",
        "Meta-Llama-3.1-8B.json",
        "meta-llama/Llama-3.1-8B",
        8_030_261_248,  # perf-anchors.md §5.2 "Llama-3.1-8B is 8,030,261,248"
        "perf-anchors.md §5.2, 8,030,261,248",
        aliases=("meta-llama/Meta-Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct"),
        chat=False,
    ),
    CatalogEntry(
        "llama-3.1-70b",
        "Meta-Llama-3.1-70B.json",
        "meta-llama/Llama-3.1-70B",
        70_553_706_496,  # same architecture as Llama-3-70B: 70.55B (engines.md §1.4)
        "70.55B, same architecture as Llama-3-70B (engines.md §1.4)",
        aliases=("meta-llama/Meta-Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct", "llama-3.1-70b-instruct"),
        chat=False,
    ),
    CatalogEntry(
        "llama-3.3-70b",
        "Meta-Llama-3.1-70B.json",  # Meta's model card: same architecture as Llama 3.1 70B
        "meta-llama/Llama-3.3-70B-Instruct",
        70_553_706_496,
        "70.55B, Llama-3.1-70B architecture (Meta Llama 3.3 model card)",
        aliases=("llama-3.3-70b-instruct",),
    ),
    CatalogEntry(
        "llama-3.1-405b",
        "Meta-Llama-3.1-405B.json",
        "meta-llama/Llama-3.1-405B",
        405_853_388_800,  # perf-anchors.md §5.2 table: 405.85B
        "perf-anchors.md §5.2, 405.85B",
        aliases=("meta-llama/Meta-Llama-3.1-405B", "meta-llama/Llama-3.1-405B-Instruct", "llama-3.1-405b-instruct"),
        chat=False,
    ),
    CatalogEntry(
        "mixtral-8x7b",
        "Mixtral-8x7B-v0.1.json",
        "mistralai/Mixtral-8x7B-v0.1",
        46_700_000_000,  # Mistral AI, "Mixtral of experts" (2023-12-11): "46.7B total parameters"
        "Mistral AI announcement: 46.7B total, 12.9B per token",
        aliases=("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b-instruct"),
        chat=False,
    ),
    CatalogEntry(
        "mixtral-8x22b",
        "Mixtral-8x22B-v0.1.json",
        "mistralai/Mixtral-8x22B-v0.1",
        141_000_000_000,  # Mistral AI, "Cheaper, Better, Faster, Stronger" (2024-04-17): 141B total
        "Mistral AI announcement: 141B total, 39B active",
        aliases=("mistralai/Mixtral-8x22B-Instruct-v0.1", "mixtral-8x22b-instruct"),
        chat=False,
    ),
    CatalogEntry(
        "qwen2.5-72b",
        "Qwen2.5-72B-Instruct.json",
        "Qwen/Qwen2.5-72B",
        72_706_203_648,  # perf-anchors.md §5.2: "exactly equals the weight-file sum"
        "perf-anchors.md §5.2, weight-file sum 72,706,203,648",
        aliases=("qwen2.5-72b-instruct", "Qwen/Qwen2.5-72B-Instruct"),
        chat=False,
    ),
    CatalogEntry(
        "qwen2.5-7b",
        "Qwen2.5-7B-Instruct.json",  # config keys written from the HF config.json (see its _source)
        "Qwen/Qwen2.5-7B-Instruct",
        7_610_000_000,  # Qwen2.5-7B-Instruct model card: "Number of Parameters: 7.61B"
        "Qwen2.5-7B-Instruct model card: 7.61B",
        aliases=("qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B"),
    ),
    CatalogEntry(
        "qwen3-8b",
        "Qwen3-8B.json",
        "Qwen/Qwen3-8B",
        8_200_000_000,  # Qwen3-8B model card: "Number of Parameters: 8.2B"
        "Qwen3-8B model card: 8.2B",
    ),
    CatalogEntry(
        "qwen3-32b",
        "Qwen3-32B.json",
        "Qwen/Qwen3-32B",
        32_800_000_000,  # Qwen3-32B model card: "Number of Parameters: 32.8B" (31.2B non-embedding)
        "Qwen3-32B model card: 32.8B",
    ),
    CatalogEntry(
        "qwen3-30b-a3b",
        "Qwen3-30B-A3B.json",
        "Qwen/Qwen3-30B-A3B",
        30_500_000_000,  # Qwen3-30B-A3B model card: "30.5B in total and 3.3B activated"
        "Qwen3-30B-A3B model card: 30.5B total, 3.3B activated",
    ),
    CatalogEntry(
        "phi-4",
        "phi-4.json",
        "microsoft/phi-4",
        14_700_000_000,  # Hugging Face model page: "14.7B params" (safetensors)
        "HF safetensors total 14.7B",
    ),
    CatalogEntry(
        "deepseek-v2-lite",
        "DeepSeek-V2-Lite-Chat.json",
        "deepseek-ai/DeepSeek-V2-Lite-Chat",
        15_700_000_000,  # DeepSeek-V2-Lite model card: "15.7B parameters ... 2.4B activated"
        "DeepSeek-V2-Lite model card: 15.7B total, 2.4B activated",
        aliases=("deepseek-ai/DeepSeek-V2-Lite", "deepseek-v2-lite-chat"),
    ),
    CatalogEntry(
        "deepseek-r1-distill-qwen-14b",
        "DeepSeek-R1-Distill-Qwen-14B.json",
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B",
        14_800_000_000,  # Hugging Face model page: "14.8B params" (Qwen2.5-14B architecture)
        "HF safetensors total 14.8B",
    ),
    CatalogEntry(
        "qwen3-235b-a22b",
        "Qwen3-235B-A22B.json",
        "Qwen/Qwen3-235B-A22B",
        235_000_000_000,  # Qwen3 model card: "235B in total and 22B activated"
        "Qwen3 model card: 235B total, 22B activated",
        aliases=("qwen3-235b",),
    ),
    CatalogEntry(
        "deepseek-v3",
        "DeepSeek-V3.json",
        "deepseek-ai/DeepSeek-V3",
        671_000_000_000,  # DeepSeek-V3 technical report (arXiv 2412.19437): 671B total, 37B active
        "DeepSeek-V3 report: 671B total (MTP module excluded), 37B activated",
        aliases=("deepseek-ai/DeepSeek-V3-0324",),
    ),
)


def _models_dir() -> Path:
    return Path(str(resources.files("toposched") / "data" / "models"))


@cache
def _load_entry(entry: CatalogEntry) -> ModelSpec:
    path = _models_dir() / entry.config_file
    source = f"catalog:{entry.config_file}"
    cfg = load_json(read_text(path, what="catalog model config"), source=source)
    spec = spec_from_config(cfg, name=entry.name, source=source)
    return replace(spec, hf_id=entry.hf_id, published_params=entry.published_params)


@cache
def _registry() -> Registry[CatalogEntry]:
    reg: Registry[CatalogEntry] = Registry("model")
    for entry in ENTRIES:
        aliases = (entry.hf_id, *entry.aliases)
        reg.register(entry.name, entry, [a for a in aliases if a.lower() != entry.name.lower()])
    return reg


def catalog() -> dict[str, ModelSpec]:
    """Every catalog model by canonical name (configs are read on first use, then cached)."""
    return {name: _load_entry(entry) for name, entry in _registry().items()}


def base_checkpoint_note(ref: str) -> str | None:
    """A note when the catalog name ``ref`` launches a base (not chat) checkpoint, naming the chat
    sibling to plan with instead; None for chat entries, aliases, Hugging Face ids and paths."""
    if "/" in ref or ref not in _registry():
        return None
    entry = _registry().get(ref)
    if entry.chat or ref.strip().casefold() != entry.name.casefold():
        return None
    chat = next((a for a in entry.aliases if "/" not in a and "instruct" in a.casefold()), None)
    also = f"; for the chat model plan with --model {chat}" if chat else ""
    return f"{entry.name} launches the base checkpoint {entry.hf_id}, not a chat (Instruct) model{also}"


def catalog_entry(name: str) -> CatalogEntry:
    """The catalog entry for a name or alias (``UnknownNameError`` with suggestions otherwise)."""
    return _registry().get(name)


MAX_REF = 4096
"""Longest model reference accepted (a catalog name, a Hugging Face id or a path)."""


def _exists(ref: str) -> bool:
    """Whether ``ref`` names an existing file or directory; False for names the OS cannot hold."""
    try:
        return Path(ref).exists()
    except (OSError, ValueError):
        return False


def _expand(ref: str) -> Path:
    """``~`` and ``~user`` expanded; an unknown user leaves the path as given."""
    try:
        return Path(ref).expanduser()
    except RuntimeError:
        return Path(ref)


def _looks_like_path(ref: str) -> bool:
    return ref.endswith(".json") or ref.startswith((".", "/", "~")) or _exists(ref)


def resolve_model(ref: str, *, weight_dtype: WeightDtype | None = None, kv_dtype: KvDtype | None = None) -> ModelSpec:
    """A catalog name, a Hugging Face id in the catalog, or a local config.json / model dir."""
    if not isinstance(ref, str) or not ref.strip() or len(ref) > MAX_REF or "\x00" in ref:
        shown = repr(ref) if len(repr(ref)) <= 60 else repr(ref)[:57] + "..."
        raise InputError(
            f"model {shown} is not a catalog name, Hugging Face id or path",
            fix=f"give a catalog name such as 'llama-3.1-70b' or a config.json path (at most {MAX_REF} characters)",
        )
    reg = _registry()
    if ref in reg and not _exists(ref):
        spec = _load_entry(reg.get(ref))
    elif _looks_like_path(ref):
        spec = load_config(_expand(ref))
    else:
        spec = _load_entry(reg.get(ref))  # raises UnknownNameError with "did you mean"
    return spec.with_dtypes(weight_dtype, kv_dtype)
