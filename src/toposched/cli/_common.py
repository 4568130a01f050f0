"""Shared pieces of the CLI: consoles, JSON output, option types."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def print_json(obj: Any) -> None:
    """Write one JSON document to stdout (plain text: no colour, no wrapping)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()
