"""The engine names the cost model and the calibration profiles use (``engine_of``), and engine versions.

The CLI, the service, scenarios and calibration samples name engines as users do (``vllm``, ``sglang``,
``trtllm``, ``nim``, any case); the cost model (``perf/latency.py``) and a profile entry's ``engine`` scope
(``perf/profile.py``) use one name per engine. A leaf module, so that both can import it.

An engine's version is its own input where users give it (``--engine-version``, a request's or tenant's
``engine_version``, a sample's); on its way to the cost model it travels with the name as one string,
``NAME==VERSION`` (``cost_engine``), so every layer that passes the engine on passes the version too;
``engine_of`` reads the name, ``version_of`` the version. A profile entry scoped to a version prices only
that version (``version_matches``: by leading components, ``0.11`` holds ``0.11.0`` and ``0.11.2``).
"""

from __future__ import annotations

import re
from typing import Annotated

from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator

from toposched.errors import InputError

ENGINE_ALIASES = {
    "vllm": "vllm",
    "sglang": "sglang",
    "trtllm": "tensorrt-llm-pytorch",  # toposched's `launch trtllm`: trtllm-serve --backend pytorch
    "trtllm-pytorch": "tensorrt-llm-pytorch",
    "tensorrt-llm-pytorch": "tensorrt-llm-pytorch",
    "tensorrt-llm": "tensorrt-llm",
    "trtllm-tensorrt": "tensorrt-llm",
    "nim": "nvidia-nim",
    "nvidia-nim": "nvidia-nim",
}
"""The engine names the CLI, the service, scenarios and samples take, to the name the cost model and the
profiles use (``engine_of``): ``trtllm`` is what ``launch trtllm`` starts, TensorRT-LLM's PyTorch backend."""


SEPARATOR = "=="
"""Between an engine's name and its version in the cost model's engine string (``vllm==0.11.0``)."""
_VERSION = re.compile(r"[0-9][0-9a-z]*(?:[.+-][0-9a-z]+){0,7}")


def engine_version(version: str | None) -> str | None:
    """A version as users write it (``0.11.0``, ``v0.5.3.post3``, ``1.3.0-rc20``, ``0.11.0+cu128``), normalised:
    lower case, no leading ``v``, and PEP 440's spelling where it is one (``1.3.0-rc20`` -> ``1.3.0rc20``,
    the way the engines' own packages report it); None for None or an empty one. ValueError for anything else
    (it reaches profiles, JSON and reports: digits first, then letters, digits and ``.+-``, at most 40
    characters)."""
    text = (version or "").strip().lower()
    if not text:
        return None
    text = text[1:] if text.startswith("v") else text
    if len(text) > 40 or not _VERSION.fullmatch(text):
        raise ValueError(f"engine version {text[:50]!r} is not a version such as 0.11.0 or 1.3.0rc20")
    try:
        return str(Version(text))
    except InvalidVersion:
        return text


def _given_version(version: str) -> str:
    normalised = engine_version(version)
    if normalised is None:
        raise ValueError("an empty engine version: leave the field out instead")
    return normalised


EngineVersion = Annotated[str, AfterValidator(_given_version)]
"""A model field's engine version (``engine_version``: normalised, or a ValueError naming it)."""


def _plain_name(engine: str) -> str:
    if SEPARATOR in engine:
        raise ValueError(f"engine {engine[:50]!r}: give its version as engine_version (--engine-version)")
    return engine


EngineName = Annotated[str, AfterValidator(_plain_name)]
"""A model field's engine name as users give it: no ``==version`` (that is ``engine_version``'s)."""


def checked_version(version: str | None, flag: str = "--engine-version") -> str | None:
    """``engine_version`` for a user's option: an ``InputError`` naming ``flag`` instead of a ValueError."""
    try:
        return engine_version(version)
    except ValueError as exc:
        raise InputError(f"{flag}: {exc}", fix="give the version the engine reports, e.g. 0.11.0") from None


def cost_engine(engine: str | None, version: str | None = None) -> str | None:
    """The engine string the cost model takes: ``engine``'s name, with ``==version`` when one is given."""
    name = engine_of(engine)
    if name is None:
        return None
    ver = engine_version(version)
    return name if ver is None else f"{name}{SEPARATOR}{ver}"


def engine_of(engine: str | None) -> str | None:
    """The cost model's name of ``engine`` (``ENGINE_ALIASES``; a ``==version`` suffix is dropped); None for
    None or an empty name; any other name lower-cased as it is (priced like vLLM and matched by a profile's
    ``*`` engine only)."""
    name = (engine or "").split(SEPARATOR, 1)[0].strip().lower()
    return ENGINE_ALIASES.get(name, name) or None


def version_of(engine: str | None) -> str | None:
    """The version in a cost-model engine string (``vllm==0.11.0`` -> ``0.11.0``), else None."""
    _, sep, version = (engine or "").partition(SEPARATOR)
    return engine_version(version) if sep else None


def version_matches(scope: str, version: str | None) -> bool:
    """Whether a profile entry's version ``scope`` holds ``version``: a release (``0.11``, ``0.11.0``) holds
    the versions whose release numbers it leads (``0.11`` holds ``0.11.0``, ``0.11.2``, ``0.11.0+cu128``, not
    ``0.1`` or ``0.12.0``); a scope with a pre-, post- or dev-release part (``1.3.0rc20``) holds that version
    only, whatever its local build label (``+cu128``); no version, no match. Versions PEP 440 cannot read are
    compared by their dotted components."""
    if version is None:
        return False
    try:
        want, have = Version(scope), Version(version)
    except InvalidVersion:
        parts, given = scope.split("."), version.split(".")
        return given[: len(parts)] == parts
    if want.pre is not None or want.post is not None or want.dev is not None:
        return want.public == have.public
    return have.release[: len(want.release)] == want.release


def known_engine(engine: str | None) -> bool:
    """Whether ``engine`` names an engine the cost model knows (``ENGINE_ALIASES``; a version may follow)."""
    return (engine or "").split(SEPARATOR, 1)[0].strip().lower() in ENGINE_ALIASES


__all__ = [
    "ENGINE_ALIASES",
    "SEPARATOR",
    "EngineName",
    "EngineVersion",
    "checked_version",
    "cost_engine",
    "engine_of",
    "engine_version",
    "known_engine",
    "version_matches",
    "version_of",
]
