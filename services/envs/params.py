"""Parameter checking shared by the built-in environments: each error names the parameter."""

from __future__ import annotations

from typing import Any

from services.envs.base import EnvParamError


def check(env: str, params: dict[str, Any], spec: dict[str, tuple[type, Any, Any, Any]]) -> dict[str, Any]:
    """``spec`` maps name -> (type, default, low, high); returns params with defaults filled in.

    Unknown names, wrong types and values out of [low, high] raise EnvParamError naming the parameter."""
    unknown = sorted(set(params) - set(spec))
    if unknown:
        raise EnvParamError(f"{env}: unknown parameter(s) {unknown}; known: {sorted(spec)}")
    out: dict[str, Any] = {}
    for name, (typ, default, low, high) in spec.items():
        value = params.get(name, default)
        ok = isinstance(value, typ) and not (typ is not bool and isinstance(value, bool))
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise EnvParamError(f"{env}: {name} must be {typ.__name__}, got {value!r}")
        if low is not None and value < low or high is not None and value > high:
            raise EnvParamError(f"{env}: {name} must be between {low} and {high}, got {value!r}")
        out[name] = value
    return out
