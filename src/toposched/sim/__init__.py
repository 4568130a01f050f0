"""Discrete-event cluster simulator: compare placement policies on the real scheduler (docs/simulator.md)."""
