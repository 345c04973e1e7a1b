"""The CPU compatibility layer patches only what it lists, and only megatron's modules."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("megatron.core")

from services.training.megatron import cpu_compat  # noqa: E402
from services.training.megatron.model import init_parallel  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is for machines without a GPU")


def test_patches_only_the_listed_megatron_modules() -> None:
    init_parallel(1, 1, seed=0)
    for name in cpu_compat.PATCHED_MODULES:
        seen = importlib.import_module(name).torch
        assert seen is not torch and seen.cuda.current_device() == torch.device("cpu")
        assert seen.zeros([2], device="cuda").device.type == "cpu"
        assert seen.nn is torch.nn and seen.float32 is torch.float32  # everything else is the real torch
    with pytest.raises((AssertionError, RuntimeError)):  # global torch is untouched: still no CUDA
        torch.cuda.current_device()
    unpatched = importlib.import_module("megatron.core.transformer.attention")
    assert unpatched.torch is torch


def test_rng_tracker_forks_the_cpu_generator_by_name() -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    init_parallel(1, 1, seed=0)
    cpu_compat.seed_rng_tracker(7)
    tracker = get_cuda_rng_tracker()
    assert isinstance(tracker, cpu_compat.CpuRNGStatesTracker)
    outside = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # the default stream did not move
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the named stream advanced
    cpu_compat.seed_rng_tracker(7)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), first)  # same seed, same draws
