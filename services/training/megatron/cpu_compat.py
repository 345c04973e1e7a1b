"""The smallest set of patches that lets megatron-core 0.16 train on a CPU (gloo).

megatron-core assumes CUDA in a few places on the path Tandem uses (GPTModel with the
local layer spec, the no-pipelining schedule, the RNG tracker). On a machine without a
GPU, ``enable()`` patches exactly those places and nothing else:

1. ``megatron.core.models.common.embeddings.rotary_pos_embedding`` moves the RoPE
   frequencies to ``torch.cuda.current_device()`` on first use;
2. ``megatron.core.pipeline_parallel.schedules`` counts tokens in
   ``torch.zeros([], device="cuda")``;
3. ``megatron.core.utils``' ``GlobalMemoryBuffer`` (the scratch buffer for attention
   scores) allocates on ``torch.cuda.current_device()``.
   For these three modules only, the name ``torch`` is rebound to ``_CpuTorch``: the real
   torch module, except that ``torch.cuda.current_device()`` answers the CPU device and
   tensor factories asked for ``device="cuda"`` build on the CPU. Global torch is untouched.
4. ``megatron.core.tensor_parallel.random``'s RNG tracker keeps CUDA generator states and
   forks them around attention dropout; it is replaced by ``CpuRNGStatesTracker``, which
   keeps CPU generator states under the same names and forks them the same way.

Nothing else is patched: callers pass an explicit attention mask (so the CUDA default
causal mask is never built), build weights with ``use_cpu_initialization=True`` and do
gradient reduction and the optimizer step themselves. ``enable()`` refuses to run when
a GPU is present, so the GPU path is plain megatron-core.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import random as mcore_random

# Modules whose module-level ``torch`` name is rebound to ``_CpuTorch`` (items 1 to 3 above).
PATCHED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # 1: RoPE frequencies
    "megatron.core.pipeline_parallel.schedules",  # 2: the token counter
    "megatron.core.utils",  # 3: GlobalMemoryBuffer
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")
_enabled = False


def _cpu_device(device: Any) -> Any:
    """'cuda', 'cuda:N' or a CUDA torch.device -> the CPU device; anything else unchanged."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` as the patched modules see it: the current device is the CPU."""

    def __getattr__(self, name: str) -> Any:  # everything not overridden is the real torch.cuda
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")


class _CpuTorch(types.ModuleType):
    """The real ``torch`` module, seen through: ``cuda`` is ``_CpuCuda`` and the tensor
    factories in ``_FACTORIES`` map a CUDA ``device=`` to the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, self._on_cpu(getattr(torch, name)))

    @staticmethod
    def _on_cpu(fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)
        return wrapped

    def __getattr__(self, name: str) -> Any:  # everything else is the real torch
        return getattr(torch, name)


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """megatron's named RNG-state tracker over the CPU generator instead of the CUDA one."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} or seed {seed} already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} is not tracked")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def seed_rng_tracker(seed: int, tp_rank: int = 0) -> None:
    """Install the CPU tracker with megatron's three named states (data, model, expert parallel)."""
    tracker = CpuRNGStatesTracker()
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def enable() -> None:
    """Apply patches 1 to 3 (idempotent). Only on a machine without a GPU."""
    global _enabled
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat is for machines without a GPU; megatron-core runs unpatched on CUDA")
    if _enabled:
        return
    cpu_torch = _CpuTorch()
    for name in PATCHED_MODULES:
        importlib.import_module(name).torch = cpu_torch
    _enabled = True
