"""Checks that run the real tools on what toposched emits (``make check-engines``, docs/engine-checks.md)."""
