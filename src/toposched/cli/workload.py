"""CLI for the workload model and cost model: ``toposched fit`` and ``toposched estimate``.

(Being built under issue 3.)
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this group's commands to ``app``."""
