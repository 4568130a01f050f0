"""The names that reach scripts, file names, YAML and keys, and the one rule each must follow.

Every name that enters toposched from outside (a cluster spec, a probe, a plan JSON, the API)
is checked here before it can reach a launch script, a file name, a Kubernetes object or a
ledger key. The rules are deliberately strict so that a checked name is safe *unquoted* in a
shell word, a path component and a YAML scalar; writers still quote and serialise (defence in
depth), but never rely on it.

- **node names** follow RFC 1123 hostnames, the rule Kubernetes applies to node names
  (DNS-1123 subdomain): dot-separated labels of letters, digits and ``-``, each label 1-63
  characters starting and ending with a letter or digit, 253 characters in all. Upper case is
  accepted (hostnames are case-insensitive; ``launch k8s`` lower-cases nothing and Kubernetes
  would reject such a node name itself).
- **ids** (request, placement, clique ids) start with a letter or digit and go on with
  letters, digits, ``.``, ``_`` and ``-``; at most 120 characters (placement ids add a short
  replica suffix). No ``/``, so an id is always one path component.
- **labels** (rack, zone, label keys and values, NIC and interface names) use the same
  alphabet as ids, plus ``/`` only in Kubernetes label keys (``topology.kubernetes.io/zone``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated

from pydantic import AfterValidator, WithJsonSchema

from toposched.errors import InputError

MAX_NODE_NAME = 253
MAX_ID = 120
MAX_LABEL = 253

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
NODE_NAME_PATTERN = rf"^{_LABEL}(?:\.{_LABEL})*$"
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,119}$"
LABEL_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?$"
WORD_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$"

_NODE_RE = re.compile(NODE_NAME_PATTERN)
_ID_RE = re.compile(ID_PATTERN)
_LABEL_RE = re.compile(LABEL_PATTERN)
_WORD_RE = re.compile(WORD_PATTERN)


def _shown(value: object) -> str:
    """A name as it may appear in an error message: repr (so newlines show) and at most 60 chars."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _problem(value: object, what: str, limit: int, pattern: re.Pattern[str], rule: str) -> str | None:
    """The one shape of every name check: a string, at most ``limit`` characters, matching ``pattern``."""
    if not isinstance(value, str):
        return f"{what} must be a string, got {type(value).__name__}"
    if len(value) > limit:
        return f"{what} is {len(value)} characters long (at most {limit})"
    if not pattern.fullmatch(value):
        return f"{what} {_shown(value)} {rule}"
    return None


def node_name_problem(value: object) -> str | None:
    """Why ``value`` is not a valid node name, or None when it is."""
    rule = (
        "is not a hostname: use letters, digits, '-' and '.' "
        "(RFC 1123 / Kubernetes DNS-1123 subdomain, labels of 1-63 characters)"
    )
    return _problem(value, "node name", MAX_NODE_NAME, _NODE_RE, rule)


def id_problem(value: object, what: str = "id") -> str | None:
    """Why ``value`` is not a valid id, or None when it is."""
    rule = "is not valid: start with a letter or digit, then use letters, digits, '.', '_' and '-' only"
    return _problem(value, what, MAX_ID, _ID_RE, rule)


def placement_id_problem(value: object) -> str | None:
    """Why ``value`` is not a placement id (an id, or an id with a replica suffix ``-N``), or None."""
    if isinstance(value, str):
        base, dash, replica = value.rpartition("-")
        if dash and replica.isascii() and replica.isdigit() and len(replica) <= 5 and id_problem(base) is None:
            return None
    return id_problem(value, "placement id")


def label_problem(value: object, what: str = "label") -> str | None:
    """Why ``value`` is not a valid label (rack, zone, label key/value), or None when it is."""
    return _problem(value, what, MAX_LABEL, _LABEL_RE, "is not valid: use letters, digits, '.', '_', '-' and '/' only")


def label_value_problem(value: object, what: str = "label value") -> str | None:
    """Like :func:`label_problem`, but the empty string is allowed (Kubernetes label values may be empty)."""
    return None if value == "" else label_problem(value, what)


_GPU_MODEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]*", re.ASCII)


def gpu_model_problem(value: object) -> str | None:
    """Why ``value`` is not a GPU model name as NVML gives it (``NVIDIA H100 80GB HBM3``), or None. GPU
    feature discovery turns it into the ``nvidia.com/gpu.product`` label value (spaces as '-'), so it
    keeps to what a label value may hold."""
    rule = "is not a GPU model name: use letters, digits, spaces, '.', '_' and '-' only"
    return _problem(value, "GPU model", 63, _GPU_MODEL_RE, rule)


def word_problem(value: object, what: str = "name") -> str | None:
    """Why ``value`` is not one safe word (NIC, interface, device names: ``mlx5_0``, ``eth0``)."""
    if not isinstance(value, str):
        return f"{what} must be a string, got {type(value).__name__}"
    if not _WORD_RE.fullmatch(value):
        return f"{what} {_shown(value)} is not valid: use letters, digits, '.', '_', ':' and '-' only"
    return None


def check_node_name(value: object, *, source: str = "<input>") -> str:
    """``value`` if it is a valid node name, else InputError naming the source."""
    problem = node_name_problem(value)
    if problem:
        raise InputError(f"{source}: {problem}", fix="rename the node to a hostname such as 'gpu-node-01'")
    assert isinstance(value, str)
    return value


def check_id(value: object, *, what: str = "id", source: str = "<input>") -> str:
    """``value`` if it is a valid id, else InputError naming the source."""
    problem = id_problem(value, what)
    if problem:
        raise InputError(f"{source}: {problem}", fix=f"use a {what} such as 'llama-70b-prod'")
    assert isinstance(value, str)
    return value


def _pydantic(problem_of: Callable[[object], str | None]) -> Callable[[str], str]:
    def check(value: str) -> str:
        problem = problem_of(value)
        if problem:
            raise ValueError(problem)
        return value

    return check


NodeName = Annotated[str, AfterValidator(_pydantic(node_name_problem))]
"""A pydantic field type for node names (fails validation with the reason)."""

ObjectId = Annotated[str, AfterValidator(_pydantic(id_problem))]
"""A pydantic field type for request, placement and clique ids."""

PlacementId = Annotated[
    str,
    AfterValidator(_pydantic(placement_id_problem)),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,119}(-[0-9]{1,5})?$",
            "minLength": 1,
            "maxLength": MAX_ID + 6,
        }
    ),
]
"""A pydantic field type for placement ids: a request id, or a request id and ``-N``."""

LabelValue = Annotated[str, AfterValidator(_pydantic(label_value_problem))]
"""A pydantic field type for label values (may be empty)."""

Label = Annotated[str, AfterValidator(_pydantic(label_problem))]
"""A pydantic field type for racks, zones and label keys/values."""

GpuModel = Annotated[str, AfterValidator(_pydantic(gpu_model_problem))]
"""A pydantic field type for GPU model names (NVML's ``nvmlDeviceGetName``)."""

Word = Annotated[str, AfterValidator(_pydantic(word_problem))]
"""A pydantic field type for NIC and interface names."""
