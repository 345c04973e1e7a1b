"""LoRA adapter directories (PEFT format) as the trainer publishes them, read without torch.

An adapter directory holds ``adapter_config.json`` (PEFT's ``LoraConfig``: rank, alpha, target modules and
``base_model_name_or_path``, the base model's directory) and ``adapter_model.safetensors``. It has no
``config.json`` of its own: whatever needs the model's tokenizer, context window or architecture reads
them from the base (``base_of``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_dir(path: str | Path) -> bool:
    """A PEFT adapter directory (an adapter config and no model config of its own)."""
    root = Path(path)
    return (root / ADAPTER_CONFIG).is_file() and not (root / "config.json").is_file()


def adapter_config(path: str | Path) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``; ValueError naming the file when it is unreadable."""
    file = Path(path) / ADAPTER_CONFIG
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"{file} is not a JSON object")
    return cfg


def base_of(path: str | Path) -> str:
    """The model directory behind ``path``: the base an adapter directory names, else ``path`` itself."""
    if not is_adapter_dir(path):
        return str(path)
    base = adapter_config(path).get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise ValueError(f"{Path(path) / ADAPTER_CONFIG} names no base_model_name_or_path")
    return base
