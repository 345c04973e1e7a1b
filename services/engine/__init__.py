"""Tandem's embedded inference engine: a CPU stand-in for an SGLang server.

It serves the SGLang native HTTP API (DESIGN §5) with a transformers model and
batched decoding, so the SGLang router and the rollout service drive it
exactly as they drive SGLang on GPU. ``python -m services.engine --help``.
"""

from services.engine.generator import Engine, EngineError, GenRequest

__all__ = ["Engine", "EngineError", "GenRequest"]
