"""Optional parts of Tandem and the pip extra that installs each (pyproject.toml's optional dependencies).

``require(extra, what)`` raises ``MissingExtra`` naming the extra when its package is not installed;
``missing(extra, what)`` returns the same message (or None) for checks that collect problems.
"""

from __future__ import annotations

import importlib.util

# extra -> the module it provides
EXTRAS: dict[str, str] = {
    "megatron": "megatron.core",
    "tinker": "tinker",
    "lora": "peft",  # agents.X.lora
    "wandb": "wandb",
    "textarena": "textarena",
    "models": "gguf",
    "datasets": "pyarrow",  # Parquet dataset files
    "hf-datasets": "datasets",  # directories saved by Hugging Face datasets
}


class MissingExtra(ImportError):
    """An optional package is not installed; the message says which extra installs it."""


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def missing(extra: str, what: str) -> str | None:
    module = EXTRAS[extra]
    if installed(module):
        return None
    return (f"{what} needs the optional package {module.split('.')[0]!r}, which is not installed: "
            f"pip install 'tandem[{extra}]' (or `make install-dev`, which installs every extra)")


def require(extra: str, what: str) -> None:
    if (message := missing(extra, what)) is not None:
        raise MissingExtra(message)
