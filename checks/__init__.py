"""Checks beyond the pytest suite that need tools the project venv does not hold."""
