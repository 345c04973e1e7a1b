"""Environment registry: built-in names and ``package.module:Class`` plug-ins."""

from __future__ import annotations

import importlib

from services.envs.base import Environment

BUILTINS: dict[str, str] = {
    "tictactoe": "services.envs.tictactoe:TicTacToe",
}


def load_object(path: str) -> object:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not of the form package.module:Name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for {path!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no {attr!r}") from None


def load_environment(name: str) -> type[Environment]:
    path = BUILTINS.get(name, name)
    if ":" not in path:
        raise ValueError(f"unknown environment {name!r}; built-ins: {', '.join(sorted(BUILTINS))} "
                         "or a plug-in as package.module:Class")
    cls = load_object(path)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{path!r} is not an Environment subclass")
    return cls
