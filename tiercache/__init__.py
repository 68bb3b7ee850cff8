"""tiercache: a tiered KV-cache for vLLM."""

__version__ = "0.1.0"
