"""Environment parameters as pydantic models: each environment declares ``Params`` (a subclass of
``EnvParams``); ``validate`` turns a validation error into an ``EnvParamError`` naming the parameter,
``describe`` lists the parameters for ``tandem envs``, and ``unshaped`` drops the reward-shaping ones
(``Field(json_schema_extra=SHAPING)``) for evaluations, which score the game itself. ``ChatParams`` is the base
of the environments played in words: its ``system`` replaces, per role, the environment's default system
message (the protocol told to a chat model)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticUndefined

SHAPING: dict[str, Any] = {"shaping": True}  # a parameter's json_schema_extra: reward shaping, training only


class EnvParamError(ValueError):
    """Bad environment parameters; ``field`` is the parameter at fault ("" when it is several)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class FieldError(ValueError):
    """Raised by a model validator for a fault of one parameter (``field``), which ``validate`` then names."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class EnvParams(BaseModel):
    """Base of every environment's ``Params``: unknown names and loose types (``"2"`` for 2,
    ``true`` for 1) are errors, and the values are read-only."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class NoParams(EnvParams):
    """An environment without parameters."""


class ChatParams(EnvParams):
    """Parameters of an environment played in words: ``system`` maps a role to the system message that replaces
    the environment's default one for that role (``Environment.default_system``); an empty string gives that
    role no system message (the tiny demo models, trained without one)."""

    system: dict[str, str] = Field(default_factory=dict, description="per role, a system message replacing the "
                                   "environment's default (which tells a chat model the protocol); '': none")


class HeldOutParams(EnvParams):
    """Parameters of an environment whose cases can be held out: ``held_out`` is the share of its cases (chosen
    by a hash of the case's name, the same for every seed) that training never draws and evaluations alone
    draw (``Environment.evaluation_params`` sets ``split`` to ``eval``)."""

    held_out: float = Field(0.0, ge=0.0, lt=1.0, description="the share of the cases kept out of training and "
                            "drawn only by evaluations (chosen by a hash of the case, the same for every seed)")
    split: Literal["train", "eval"] = Field("train", description="the cases drawn: 'train' (those not held out) "
                                            "or 'eval' (the held-out ones); evaluations set 'eval' themselves")

    def check_splits(self) -> None:
        """Build both splits' cases (a ValueError when one is empty); environments with cases override it."""

    @model_validator(mode="after")
    def _both_splits_hold_cases(self) -> HeldOutParams:
        if self.held_out:
            try:
                self.check_splits()
            except ValueError as exc:
                raise FieldError("held_out", f"{self.held_out} {exc}") from None
        return self


def is_held_out(case: str, share: float) -> bool:
    """Whether the case named ``case`` is among the held-out ``share`` of cases (a hash of the name)."""
    return int.from_bytes(hashlib.sha256(case.encode()).digest()[:4], "big") < share * 2**32


def split_cases(cases: list[Any], names: list[str], share: float, split: str) -> list[Any]:
    """The cases of ``split`` (``names[i]`` names ``cases[i]``); a split left empty is a ValueError."""
    chosen = [c for c, n in zip(cases, names, strict=True) if is_held_out(n, share) == (split == "eval")]
    if not chosen:
        raise ValueError(f"leaves no {split} case")
    return chosen


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
        error = err.get("ctx", {}).get("error")
        if isinstance(error, FieldError):  # a model validator's fault of one parameter
            field, err = error.field, {**err, "type": "missing"}
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
        lines.append(text + (f"  {info.description}" if info.description else "")
                     + ("  [shaping: evaluations play without it]" if is_shaping(model, name) else ""))
    return lines


def is_shaping(model: type[EnvParams], name: str) -> bool:
    """Whether parameter ``name`` of ``model`` shapes the training reward (marked ``SHAPING``)."""
    info = model.model_fields.get(name)
    extra = info.json_schema_extra if info is not None else None
    return isinstance(extra, dict) and bool(extra.get("shaping"))


def unshaped(model: type[EnvParams], params: Mapping[str, Any] | EnvParams) -> dict[str, Any]:
    """``params`` without its reward-shaping parameters (those left at their defaults): what an evaluation
    plays, so that its score and outcome are the game's, not the shaped reward's."""
    data = params.model_dump(exclude_unset=True) if isinstance(params, EnvParams) else dict(params)
    return {k: v for k, v in data.items() if not is_shaping(model, k)}
