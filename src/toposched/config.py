"""Validated configuration of the parts that need it; every field has a default and a bound.

Values come from flags first, then environment variables, then these defaults.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toposched.errors import SpecError, first_problem


def default_state_path() -> Path:
    """``$TOPOSCHED_STATE``, else ``$XDG_STATE_HOME/toposched/state.sqlite3`` (``~/.local/state``)."""
    if env := os.environ.get("TOPOSCHED_STATE"):
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "toposched" / "state.sqlite3"


class TopologyConfig(BaseModel):
    """How topology snapshots are stored and when they count as stale."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_path: Path = Field(default_factory=default_state_path, description="SQLite state file")
    max_age_s: float = Field(
        default=300.0, gt=0, le=30 * 24 * 3600, description="a stored DomainMap older than this is stale"
    )

    @classmethod
    def load(cls, *, state_path: Path | None = None, max_age_s: float | None = None) -> TopologyConfig:
        """Flags, then ``TOPOSCHED_STATE`` / ``TOPOSCHED_TOPO_MAX_AGE``, then defaults."""
        values: dict[str, object] = {}
        if state_path is not None:
            values["state_path"] = state_path
        env_age = os.environ.get("TOPOSCHED_TOPO_MAX_AGE")
        if max_age_s is not None:
            values["max_age_s"] = max_age_s
        elif env_age:
            values["max_age_s"] = env_age
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problem = first_problem(exc)
            source = "TOPOSCHED_TOPO_MAX_AGE" if problem.path == "max_age_s" and max_age_s is None else "flags"
            raise SpecError(source, problem.path, f"{problem.msg} (got {problem.input!r})") from exc
