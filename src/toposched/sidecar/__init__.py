"""Live verification of placements: NVML checks, NCCL log analysis, drift alerts (seed 000 layer 5)."""
