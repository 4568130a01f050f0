"""Fuzz harness: every parser of user input, fed mutated real inputs (see docs/fuzz.md)."""
