"""Which model an engine loads for a request (``served_model``): the Hugging Face id or local folder it
named, or the Hugging Face id of a catalog name; and the checks on a model argument written into a launch."""

from __future__ import annotations

from pathlib import Path

from toposched.errors import InputError
from toposched.solver.request import PlacementRequest
from toposched.workload import ModelSpec, resolve_model
from toposched.workload.catalog import catalog_entry

MAX_MODEL_ARG = 4096
"""Longest model name or path written into a launch (PATH_MAX on Linux)."""


def check_model_arg(value: str, what: str = "model") -> str:
    """``value`` if it can be the engine's model argument: printable text (no newline, no NUL), not too long."""
    if len(value) > MAX_MODEL_ARG or not value.isprintable():
        shown = repr(value[:40]) + ("..." if len(value) > 40 else "")
        raise InputError(
            f"{what} {shown} is not a catalog name or a path: "
            + (
                f"longer than {MAX_MODEL_ARG} characters" if len(value) > MAX_MODEL_ARG else "it has control characters"
            ),
            fix="use a catalog model name or the path of a config.json",
        )
    return value


def _repo_key(name: str) -> str:
    """A catalog short name or a Hugging Face repo name, compared without case and Meta's ``Meta-`` prefix."""
    return name.rsplit("/", 1)[-1].casefold().removeprefix("meta-")


def _catalog_hf_id(ref: str) -> str:
    """The Hugging Face id a catalog name stands for.

    The entry's own name serves its ``hf_id``. A short alias (``llama-3.1-70b-instruct``) names a sibling
    checkpoint of the same architecture, which the catalog lists among the entry's Hugging Face ids
    (``meta-llama/Llama-3.1-70B-Instruct``): the id whose repo name is the alias, else the one id that
    starts with it (``mixtral-8x7b-instruct`` -> ``mistralai/Mixtral-8x7B-Instruct-v0.1``). An alias that
    matches none, or several, is refused rather than served as another checkpoint.
    """
    entry = catalog_entry(ref)
    if ref.casefold() == entry.name.casefold():
        return entry.hf_id
    ids = list(dict.fromkeys([entry.hf_id, *(a for a in entry.aliases if "/" in a)]))
    key = _repo_key(ref)
    exact = [i for i in ids if _repo_key(i) == key]
    found = exact or [i for i in ids if _repo_key(i).startswith(key)]
    if len(found) != 1:
        raise InputError(
            f"catalog name {ref!r} names no single Hugging Face id "
            + (f"(it could be {', '.join(found)})" if found else f"(the entry {entry.name} lists {', '.join(ids)})"),
            fix="plan with the Hugging Face id itself (--model ORG/NAME), or pass --model-path",
        )
    return found[0]


def served_model(ref: str) -> str:
    """What the engine loads for the model a request names: exactly that id or path.

    A local path serves that folder (a ``config.json``'s folder); a Hugging Face id (``ORG/NAME``) is
    served as given; a catalog name serves the Hugging Face id the catalog gives that name.
    """
    check_model_arg(ref)
    try:
        path = Path(ref).expanduser()
    except RuntimeError:  # "~user" of an unknown user: not a path here
        path = Path(ref)
    try:
        if path.exists():
            return str(path.parent if path.is_file() else path)
    except OSError as exc:
        raise InputError(f"model path {ref[:60]!r} cannot be read: {exc.strerror}") from None
    resolve_model(ref)  # an unknown name or a missing config.json fails here, with "did you mean"
    return ref if "/" in ref else _catalog_hf_id(ref)


def checkpoint_of(request: PlacementRequest, model_path: str | None) -> ModelSpec | None:
    """The model as its checkpoint is (dtypes, context), or None when only ``--model-path`` knows it."""
    try:
        return resolve_model(request.model)
    except InputError:
        if model_path is None:
            raise
        return None
