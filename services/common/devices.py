"""Devices and precision of the embedded engine and the trainers (docs/architecture.md §9).

``resolve`` turns a config's ``auto``/``cpu``/``cuda`` into a ``torch.device`` at a process's start
and fails there, naming the config field, when ``cuda`` is asked for and torch sees no GPU.
``autocast`` is the trainer's mixed precision: float32 weights and optimizer, the passes in bfloat16.
``training_precision`` keeps bfloat16 off a CPU without native bf16 arithmetic, where autocast was
measured to slow a step several-fold (docs/results/data_plane_engine.md).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from services.contracts.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve(device: str, field: str = "device") -> torch.device:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` without one is a ``ConfigError``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{field}: {device!r} was asked for, but torch sees no GPU (torch {torch.__version__})")
    return torch.device(device)


def cpu_has_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic natively (AVX512-BF16 or AMX, as oneDNN sees it)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def training_precision(device: torch.device, dtype: str) -> str:
    """The passes' precision: ``dtype``, except float32 for bfloat16 on a CPU without native bf16."""
    if dtype == "bfloat16" and device.type == "cpu" and not cpu_has_bf16():
        return "float32"
    return dtype


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a config's ``dtype`` (the config and the engine's flags allow only ``DTYPES``' names)."""
    return DTYPES[name]


def autocast(device: torch.device, dtype: str) -> Any:
    """The passes' precision: ``bfloat16`` autocasts on ``device`` (weights stay float32); ``float32`` is a no-op."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype_of(dtype))


def rng_states() -> dict[str, Any]:
    """torch's CPU generator and, where torch sees GPUs, every GPU's: what a trainer's resume restores."""
    return {"torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng(state: dict[str, Any]) -> None:
    """Put back ``rng_states``; the GPUs' only where as many GPUs are seen as were saved (else they start fresh)."""
    torch.set_rng_state(state["torch_rng"])
    cuda = state.get("cuda_rng")  # (a state may hold none: then the GPUs start fresh)
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
