"""Inference library: the continuous-batching generator behind the embedded engine.

Any service may use it; it has no ``__main__``. The engine service serves it over SGLang's HTTP API.
"""

from services.inference.generator import Engine
from services.inference.request import EngineError, GenRequest

__all__ = ["Engine", "EngineError", "GenRequest"]
