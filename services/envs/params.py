"""Environment parameters as pydantic models: each environment declares ``Params`` (a subclass of
``EnvParams``); ``validate`` turns a validation error into an ``EnvParamError`` naming the parameter,
and ``describe`` lists the parameters for ``tandem envs``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticUndefined


class EnvParamError(ValueError):
    """Bad environment parameters; ``field`` is the parameter at fault ("" when it is several)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class EnvParams(BaseModel):
    """Base of every environment's ``Params``: unknown names and loose types (``"2"`` for 2,
    ``true`` for 1) are errors, and the values are read-only."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class NoParams(EnvParams):
    """An environment without parameters."""


def validate(env: str, model: type[EnvParams], params: Mapping[str, Any] | EnvParams) -> EnvParams:
    """``params`` as ``model``, defaults filled in; raises EnvParamError naming the first bad parameter."""
    if isinstance(params, model):
        return params
    if not isinstance(params, Mapping):
        raise EnvParamError(f"{env}: parameters must be a mapping of name to value, got {params!r}")
    try:
        return model.model_validate(dict(params))
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            known = ", ".join(model.model_fields) or "none"
            raise EnvParamError(f"{env}: {field}: unknown parameter (known: {known})", field) from None
        message = err["msg"].removeprefix("Value error, ")
        got = "" if err["type"] == "missing" or not field else f", got {err['input']!r}"
        raise EnvParamError(f"{env}: {field + ': ' if field else ''}{message}{got}", field) from None


def describe(model: type[EnvParams]) -> list[str]:
    """One line per parameter: name, type, default, bounds and description."""
    lines = []
    for name, info in model.model_fields.items():
        kind = getattr(info.annotation, "__name__", str(info.annotation))
        default = "required" if info.default is PydanticUndefined and info.default_factory is None else (
            f"= {info.get_default(call_default_factory=True)!r}")
        bounds = [f"{op} {getattr(m, attr)}" for m in info.metadata for op, attr in
                  ((">=", "ge"), (">", "gt"), ("<=", "le"), ("<", "lt")) if getattr(m, attr, None) is not None]
        text = f"{name}: {kind} {default}" + (f" ({', '.join(bounds)})" if bounds else "")
        lines.append(text + (f"  {info.description}" if info.description else ""))
    return lines
