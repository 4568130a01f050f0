"""The ``fuzz`` marker: ``pytest -m "not fuzz"`` leaves the brief fuzz run out of a quick loop."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fuzz: brief fuzz run of a parser (TOPOSCHED_FUZZ_EXAMPLES sets the examples per target)"
    )
