"""A training step's memory, per step: activations kept for the backward pass and optimizer state.

``ActivationMeter.measure`` counts, while a forward runs, the distinct storages autograd saves for the
backward pass (parameters and their views excluded: those are weights, not activations). They all live
until the backward pass frees them, so their sum is the activation memory the step held at its peak.
Under activation checkpointing only the checkpointed layers' inputs are saved, and the count says so.
``optimizer_bytes`` sums the optimizer's state tensors (AdamW: two per trainable parameter);
``grad_bytes`` the trainable parameters' gradients.

``release_heap`` hands the pages a finished step freed back to the system (glibc's ``malloc_trim``): glibc keeps
the freed heap of a step's many medium-sized tensors mapped, so without it a trainer's resident memory stays at
its step's peak until the run ends, and two trainers on one machine hold both peaks at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import cache

import torch

MB = 2**20


class ActivationMeter:
    """Saved-for-backward bytes of the forwards run under ``measure``; ``peak`` is the largest since ``reset``."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._weights = {p.untyped_storage().data_ptr() for p in params}
        self.peak = 0

    def reset(self) -> None:
        self.peak = 0

    @contextmanager
    def measure(self) -> Iterator[None]:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self._weights:
                seen[key] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak = max(self.peak, sum(seen.values()))


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def grad_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def memory_metrics(meter: ActivationMeter, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                   device: torch.device) -> dict[str, float]:
    """The step's ``activation_mb``, ``optimizer_state_mb``, ``grad_mb`` (and ``cuda_peak_mb`` on a GPU)."""
    out = {"activation_mb": round(meter.peak / MB, 3), "optimizer_state_mb": round(optimizer_bytes(optimizer) / MB, 3),
           "grad_mb": round(grad_bytes(params) / MB, 3)}
    if device.type == "cuda":
        out["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(device) / MB, 1)
        torch.cuda.reset_peak_memory_stats(device)
    return out


def rss_mb() -> float | None:
    """This process's resident memory in MB (Linux ``/proc``); None where there is no ``/proc/self/statm``."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / MB


@cache
def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None under another C library (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_heap() -> dict[str, float]:
    """Collect garbage and trim the C heap; ``rss_mb`` before and ``rss_trimmed_mb`` after (empty off Linux)."""
    gc.collect()
    before = rss_mb()
    trim = malloc_trim()
    if trim is not None:
        trim(0)
    after = rss_mb()
    if before is None or after is None:
        return {}
    return {"rss_mb": round(before, 1), "rss_trimmed_mb": round(after, 1)}
