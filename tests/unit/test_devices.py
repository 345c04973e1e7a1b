"""Devices and precision (docs/architecture.md §9): ``embedded`` and ``trainer`` sections of an agent's config.

On this machine (no GPU) the GPU paths are only the refusals; ``tests/bench/bench_gpu.py`` measured them on a GPU.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.common.devices import autocast, resolve, restore_rng, rng_states
from services.contracts.config import AgentConfig, ConfigError, parse_config
from services.inference.generator import Engine
from services.inference.request import GenRequest
from services.rollout.commands import engine_command
from services.training.backends import make_policy
from tests.helpers import completion_sample

BASE = {"run": {"name": "d"}, "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}}}


def test_auto_follows_torch_and_cuda_without_a_gpu_names_the_field() -> None:
    assert resolve("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"trainer\.device: 'cuda' was asked for, but torch sees no GPU"):
            resolve("cuda", "trainer.device")


def test_the_config_names_a_bad_device_or_dtype() -> None:
    with pytest.raises(ConfigError, match="agents.A.embedded.device"):
        parse_config({**BASE, "agents": {"A": {"model_path": "m", "embedded": {"device": "tpu"}}}})
    with pytest.raises(ConfigError, match="agents.A.trainer.dtype"):
        parse_config({**BASE, "agents": {"A": {"model_path": "m", "trainer": {"dtype": "float16"}}}})
    cfg = parse_config({**BASE, "agents": {"A": {"model_path": "m", "embedded": {"device": "auto",
                                                                                  "dtype": "bfloat16"}}}})
    assert cfg.agents["A"].embedded.dtype == "bfloat16" and cfg.agents["A"].trainer.device == "cpu"


def test_the_rollout_starts_its_engines_on_the_configured_device() -> None:
    acfg = AgentConfig(model_path="m", embedded={"device": "cuda", "dtype": "bfloat16"})
    cmd = engine_command(acfg, "A", 0, 9000)
    assert cmd[cmd.index("--device") + 1] == "cuda" and cmd[cmd.index("--dtype") + 1] == "bfloat16"


def test_a_bfloat16_engine_generates_with_float32_logprobs(tiny_model_dir: Path) -> None:
    engine = Engine(tiny_model_dir, dtype="bfloat16")
    try:
        assert engine.model.dtype == torch.bfloat16 and engine.device.type == "cpu"
        req = asyncio.run(engine.generate(GenRequest(rid="r", input_ids=[5, 6, 7], max_new_tokens=6, temperature=1.0,
                                                     seed=3, ignore_eos=True)))
        assert len(req.output_ids) == 6 and all(lp <= 0 and lp == lp for lp in req.logprobs)
    finally:
        engine.stop()


def test_bf16_autocast_trains_float32_weights(tiny_model_dir: Path) -> None:
    """trainer.dtype bfloat16: the passes autocast, the weights and AdamW stay float32, the step is finite."""
    acfg = AgentConfig(model_path=str(tiny_model_dir), trainer={"dtype": "bfloat16"},
                       algorithm={"name": "grpo", "lr": 1e-3})
    policy = make_policy(acfg, 1.0)
    samples = [completion_sample([5, 6, 7], [40 + i, 41], float(i % 2), f"g{i // 2}", 0, -5.0) for i in range(4)]
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    metrics = policy.train_step(samples)
    after = policy.model.state_dict()
    assert metrics["loss"] == metrics["loss"] and policy.weight_version == 1
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in after)
    with autocast(torch.device("cpu"), "bfloat16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "float32"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_a_resume_restores_the_generators_it_saved() -> None:
    """torch's CPU generator, and every GPU's where there are GPUs (a state from before GPUs were saved loads too)."""
    torch.manual_seed(7)
    state = rng_states()
    assert (state["cuda_rng"] is None) == (not torch.cuda.is_available())
    drawn = torch.rand(4)
    restore_rng(state)
    assert torch.equal(torch.rand(4), drawn)
    restore_rng({"torch_rng": state["torch_rng"]})  # written before the GPUs' states were kept
    assert torch.equal(torch.rand(4), drawn)
