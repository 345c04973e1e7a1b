"""A training step's memory, per step: activations kept for the backward pass and optimizer state.

``ActivationMeter.measure`` counts, while a forward runs, the distinct storages autograd saves for the
backward pass (parameters and their views excluded: those are weights, not activations). They all live
until the backward pass frees them, so their sum is the activation memory the step held at its peak.
Under activation checkpointing only the checkpointed layers' inputs are saved, and the count says so.
``optimizer_bytes`` sums the optimizer's state tensors (AdamW: two per trainable parameter);
``grad_bytes`` the trainable parameters' gradients.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

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
