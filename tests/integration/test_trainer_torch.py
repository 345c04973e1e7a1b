"""The torch backend with each algorithm on the tiny demo model: one step moves the policy the intended way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.contracts.config import AgentConfig, AlgorithmConfig
from services.contracts.messages import Sample
from services.training.backends import make_policy
from services.training.torch_backend import TorchPolicy, pad_batch
from tests.helpers import completion_sample

PROMPT = [5, 6, 7, 8]
GOOD, BAD = [40, 41, 42], [50, 51, 52]


def sample(tokens_out: list[int], reward: float, group: str, version: int = 0, logp: float = -5.0) -> Sample:
    return completion_sample(PROMPT, tokens_out, reward, group, version, logp)


def with_rollout_logprobs(policy: TorchPolicy, samples: list[Sample]) -> list[Sample]:
    """Give each sample the policy's own current logprobs (an on-policy rollout)."""
    out = []
    for s in samples:
        b = pad_batch([s], policy.pad_id)
        with torch.no_grad():
            lp = policy.logprobs(b)[0]
        rl = [0.0] + [float(v) * m for v, m in zip(lp.tolist(), s.loss_mask[1:], strict=True)]
        out.append(s.model_copy(update={"rollout_logprobs": rl}))
    return out


def seq_logp(policy: TorchPolicy, s: Sample) -> float:
    b = pad_batch([s], policy.pad_id)
    with torch.no_grad():
        return float((policy.logprobs(b) * b["mask"]).sum())


def make(tiny_model_dir: Path, **algo) -> TorchPolicy:
    acfg = AgentConfig(model_path=str(tiny_model_dir), algorithm=AlgorithmConfig(lr=1e-2, **algo))
    return make_policy(acfg, 1.0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "ppo", "gspo", "cispo", "reinforce_pp",
                                  "reinforce_pp_baseline", "dpo"])
def test_one_step_raises_the_better_answer(tiny_model_dir: Path, name: str) -> None:
    extra = {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4} if name == "gspo" else {}
    policy = make(tiny_model_dir, name=name, **extra)
    good, bad = with_rollout_logprobs(policy, [sample(GOOD, 1.0, "g"), sample(BAD, 0.0, "g")])
    before = seq_logp(policy, good) - seq_logp(policy, bad)
    metrics = policy.train_step([good, bad])
    after = seq_logp(policy, good) - seq_logp(policy, bad)
    assert after > before + 1e-3, (name, before, after, metrics)
    assert metrics["algorithm"] == name and metrics["grad_norm"] > 0 and metrics["tokens_per_s"] > 0
    assert "entropy" in metrics and "loss" in metrics and policy.weight_version == 1


def test_sft_raises_the_logprob_of_rewarded_samples_only(tiny_model_dir: Path) -> None:
    policy = make(tiny_model_dir, name="sft", sft_min_reward=0.5)
    good, bad = sample(GOOD, 1.0, "g"), sample(BAD, 0.0, "g")
    g0, b0 = seq_logp(policy, good), seq_logp(policy, bad)
    metrics = policy.train_step([good, bad])
    assert metrics["samples_trained"] == 1
    assert seq_logp(policy, good) > g0 + 1e-3
    assert abs(seq_logp(policy, bad) - b0) < abs(seq_logp(policy, good) - g0)


def test_kl_and_entropy_terms_are_reported_and_pull_the_intended_way(tiny_model_dir: Path) -> None:
    policy = make(tiny_model_dir, name="grpo", kl_coef=0.5, kl_estimator="k3", entropy_coef=0.01)
    good, bad = with_rollout_logprobs(policy, [sample(GOOD, 1.0, "g"), sample(BAD, 0.0, "g")])
    first = policy.train_step([good, bad])
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy still equals its reference
    second = policy.train_step([good, bad])
    assert second["kl"] > 0 and second["kl_loss"] == pytest.approx(0.5 * second["kl"], rel=1e-5)
    assert second["entropy_loss"] == pytest.approx(-0.01 * second["entropy"], rel=1e-5)


def test_stale_samples_get_tis_statistics(tiny_model_dir: Path) -> None:
    policy = make(tiny_model_dir, name="grpo", tis_cap=2.0)
    policy.weight_version = 3
    good, bad = sample(GOOD, 1.0, "g", version=2, logp=-9.0), sample(BAD, 0.0, "g", version=3, logp=-9.0)
    metrics = policy.train_step([good, bad])
    assert metrics["stale_frac"] == 0.5
    assert metrics["tis_ratio_min"] > 1.0  # rollout logprob -9 is far below the policy's own, so weights are large
    assert metrics["tis_clip_frac"] > 0
    assert policy.weight_version == 4


def test_state_round_trip_restores_weights_optimizer_and_scheduler(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = make(tiny_model_dir, name="grpo", lr_scheduler="linear", warmup_steps=1, decay_steps=4)
    batch = with_rollout_logprobs(policy, [sample(GOOD, 1.0, "g"), sample(BAD, 0.0, "g")])
    policy.train_step(batch)
    policy.save_state(tmp_path / "v00001", policy.weight_version)
    expected = policy.train_step(batch)
    weights = {k: v.clone() for k, v in policy.model.state_dict().items()}
    other = make(tiny_model_dir, name="grpo", lr_scheduler="linear", warmup_steps=1, decay_steps=4)
    assert other.load_state(tmp_path / "v00001") == 1
    again = other.train_step(batch)
    assert again["lr"] == expected["lr"] and again["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    for k, v in other.model.state_dict().items():
        torch.testing.assert_close(v, weights[k])


def test_trainer_service_refuses_a_bad_plugin_at_start(tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> None:
    import subprocess
    import sys

    import yaml

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": {"name": "badalgo", "checkpoint_root": str(tmp_path / "ckpt")}, "redis_url": redis_url,
        "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "A"}},
        "agents": {"A": {"model_path": str(tiny_model_dir),
                         "algorithm": {"name": "services.training.grpo:token_logprobs"}}}}))
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "--config", str(cfg), "--agent", "A"],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "agents.A.algorithm.name" in proc.stderr and "not a subclass" in proc.stderr
