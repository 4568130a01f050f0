"""toposched: topology-aware scheduler for LLM inference on GPU clusters."""

__version__ = "0.1.0"
