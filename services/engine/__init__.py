"""Tandem's embedded inference engine: a CPU stand-in for an SGLang server.

It serves the SGLang native HTTP API (docs/architecture.md §5) over the inference library's
continuous-batching generator (``services.inference``), so the SGLang router and the
rollout service drive it exactly as they drive SGLang on GPU. ``python -m services.engine --help``.
"""
