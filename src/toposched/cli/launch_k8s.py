"""``toposched launch k8s|k8s-lint|ray`` (Kubernetes objects and Ray placement groups)."""

from __future__ import annotations

import typer


def register_launch(launch_app: typer.Typer) -> None:
    """Add the Kubernetes and Ray commands to the ``launch`` group."""
