"""The learning-rate schedule shared by the torch and Megatron backends (docs/architecture.md §8)."""

from __future__ import annotations

import pytest

from services.contracts.config import AlgorithmConfig
from services.training.schedule import lr_factor


def test_warmup_stable_decay_holds_the_full_lr_then_decays_to_the_floor() -> None:
    cfg = AlgorithmConfig(lr_scheduler="cosine", warmup_steps=2, stable_steps=3, decay_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(cfg, s) for s in range(12)]
    assert factors[:2] == [0.5, 1.0]                      # warm-up
    assert factors[2:6] == [1.0, 1.0, 1.0, 1.0]           # stable: 3 steps, then the decay's first step is still 1
    assert factors[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + 0.7071067811865476))  # cos(pi/4)
    assert factors[7] == pytest.approx(0.55) and factors[8] > 0.1
    assert factors[9:] == [pytest.approx(0.1)] * 3        # held at the floor


def test_without_stable_steps_the_decay_starts_after_warm_up() -> None:
    cfg = AlgorithmConfig(lr_scheduler="linear", warmup_steps=1, decay_steps=4)
    assert [lr_factor(cfg, s) for s in range(6)] == [1.0, 1.0, 0.75, 0.5, 0.25, 0.0]


def test_constant_ignores_the_decay_settings() -> None:
    cfg = AlgorithmConfig(lr_scheduler="constant", stable_steps=5, decay_steps=1, min_lr_ratio=0.5)
    assert {lr_factor(cfg, s) for s in range(10)} == {1.0}
