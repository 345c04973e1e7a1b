"""Learning-rate schedule shared by the backends: a factor of ``algorithm.lr`` per optimizer step."""

from __future__ import annotations

import math

from services.contracts.config import AlgorithmConfig


def lr_factor(cfg: AlgorithmConfig, step: int) -> float:
    """Linear warm-up over ``warmup_steps``, then constant, or ``stable_steps`` at the full lr followed by a
    linear or cosine decay to ``min_lr_ratio`` over ``decay_steps`` (held there after)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler == "constant":
        return 1.0
    progress = min(1.0, max(0.0, step - cfg.warmup_steps - cfg.stable_steps) / cfg.decay_steps)
    if cfg.lr_scheduler == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape
