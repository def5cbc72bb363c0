"""kvctl: admin and diagnostics for KV-cache-aware LLM routing."""

__version__ = "0.1.0"
