"""Placement: degrees and exact GPUs for model instances under the four constraints of DESIGN.md."""
