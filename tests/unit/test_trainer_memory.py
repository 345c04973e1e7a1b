"""Trainer efficiency: activation checkpointing trains the same step with fewer saved activations, and every
step reports its activation, gradient and optimizer-state memory; a finished step's freed heap goes back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.devices import cpu_has_bf16, training_precision
from services.contracts.agent_parts import TrainerConfig
from services.contracts.config import AgentConfig, AlgorithmConfig, LoraConfig
from services.contracts.messages import Sample
from services.training.backends import make_policy
from services.training.memory import malloc_trim, release_heap, rss_mb
from services.training.torch_backend import TorchPolicy
from tests.helpers import completion_sample


def batch() -> list[Sample]:
    return [completion_sample([5, 6, 7, 8, 9], out, r, "g", logp=-5.5)
            for out, r in (([40, 41, 42, 43], 1.0), ([50, 51, 52, 53], 0.0))]


def policy(model_dir: Path, checkpointing: bool, lora: bool = False) -> TorchPolicy:
    return make_policy(AgentConfig(model_path=str(model_dir), seed=0, algorithm=AlgorithmConfig(lr=0.05),
                                   lora=LoraConfig(r=4, alpha=8) if lora else None,
                                   trainer=TrainerConfig(gradient_checkpointing=checkpointing)), 1.0)


def test_checkpointing_trains_the_same_step_with_fewer_saved_activations(tiny_model_dir: Path) -> None:
    plain, ckpt = policy(tiny_model_dir, False), policy(tiny_model_dir, True)
    assert ckpt.model.is_activation_checkpointing and not plain.model.is_activation_checkpointing
    m_plain, m_ckpt = plain.train_step(batch()), ckpt.train_step(batch())
    assert abs(m_plain["loss"] - m_ckpt["loss"]) < 1e-6
    for (n, a), b in zip(plain.model.named_parameters(), ckpt.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=n)
    assert 0 < m_ckpt["activation_mb"] < m_plain["activation_mb"]


def test_memory_is_reported_per_step(tiny_model_dir: Path) -> None:
    for lora in (False, True):
        p = policy(tiny_model_dir, False, lora=lora)
        m = p.train_step(batch())
        trainable = sum(t.numel() * t.element_size() for t in p.trainable) / 2**20
        # AdamW keeps two moments per trainable weight (and a step counter per tensor)
        assert 2 * trainable <= m["optimizer_state_mb"] < 2 * trainable + 0.01
        assert abs(m["grad_mb"] - trainable) < 1e-3
        assert m["activation_mb"] > 0
        longer = [completion_sample([5, 6, 7, 8, 9] * 4, [40, 41, 42, 43] * 4, r, "g", logp=-5.5)
                  for r in (1.0, 0.0)]
        assert p.train_step(longer)["activation_mb"] > m["activation_mb"]  # activations grow with the sequence


def test_bf16_autocast_stays_off_a_cpu_without_native_bf16(tiny_model_dir: Path) -> None:
    cpu = torch.device("cpu")
    assert training_precision(cpu, "float32") == "float32"
    assert training_precision(cpu, "bfloat16") == ("bfloat16" if cpu_has_bf16() else "float32")
    p = make_policy(AgentConfig(model_path=str(tiny_model_dir), trainer=TrainerConfig(dtype="bfloat16")), 1.0)
    assert p.precision == training_precision(cpu, "bfloat16")


def test_release_heap_returns_freed_holes_in_the_heap() -> None:
    """Medium tensors (below glibc's mmap threshold) freed between live ones stay resident until trimmed."""
    if malloc_trim() is None or rss_mb() is None:
        pytest.skip("glibc on Linux only")  # the trim is a no-op elsewhere, and release_heap says nothing
    many = [torch.ones(25_000) for _ in range(6000)]  # 100 kB each, 600 MB
    kept = many[1::2]
    del many  # 300 MB freed in 100 kB holes between the kept half: free() alone cannot return them
    out = release_heap()
    assert out["rss_mb"] - out["rss_trimmed_mb"] > 200, out
    assert len(kept) == 3000
