"""The learned value baseline (``algorithm.baseline: value``; services/training/value.py, docs/architecture.md
§7): each turn's return measured against its state's value, then against the group's residuals; the head
learns the returns without moving the policy, and it is part of the trainer state a resume restores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from services.contracts.config import AgentConfig, AlgorithmConfig
from services.contracts.messages import Sample, turn_spans
from services.training.credit import turn_advantages
from services.training.step import NonFiniteStep
from services.training.torch_backend import TorchPolicy
from services.training.value import state_positions

MASK = [0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]  # context 0s, three generated turns 1s


def sample(group: str, turn_rewards: list[float], sid: str, mask: list[int] = MASK) -> Sample:
    return Sample(agent="A", role="O", episode_id=sid, group_id=group, group_samples=4,
                  tokens=[5 + (i * 7 + len(sid)) % 40 for i in range(len(mask))], loss_mask=mask,
                  rollout_logprobs=[-1.0] * len(mask), reward=sum(turn_rewards),
                  weight_versions=[0] * len(turn_spans(mask)), turn_rewards=turn_rewards)


BATCH = [sample("g", [0.0, 0.0, 1.0], "a"), sample("g", [0.0, -1.0, 0.0], "bb"),
         sample("g", [0.0, 0.0, 0.0], "ccc"), sample("h", [1.0, 0.0, 0.0], "dddd")]


def test_each_turns_state_is_the_token_before_its_reply() -> None:
    assert state_positions(BATCH[0]) == [1, 4, 7]
    one = Sample(**{**BATCH[0].model_dump(), "turn_rewards": [], "reward": 1.0})
    assert state_positions(one) == [1]  # no turn rewards: one credited turn, the first


def flat(rows: list[list[float]]) -> list[float]:
    return [a for row in rows for a in row]


def test_residuals_against_the_states_values_then_the_group() -> None:
    plain = turn_advantages(BATCH, gamma=0.9)
    assert turn_advantages(BATCH, gamma=0.9, baselines=[[0.0] * 3] * 4) == plain
    # a value the same for the whole group at a turn is taken out by the group's centring
    assert flat(turn_advantages(BATCH, gamma=0.9, baselines=[[0.3, -0.2, 0.5]] * 4)) == pytest.approx(flat(plain))
    # values that foresee each return exactly leave nothing to credit
    exact = [[0.81, 0.9, 1.0], [-0.9, -1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert flat(turn_advantages(BATCH, gamma=0.9, baselines=exact)) == pytest.approx([0.0] * 12, abs=1e-6)
    # b's loss at its second turn, foreseen by its state's value, is blamed no more than c's, which lost nothing
    foresaw = [[0.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    adv = turn_advantages(BATCH, gamma=0.9, baselines=foresaw)
    assert plain[1][1] < plain[2][1] and adv[1][1] == pytest.approx(adv[2][1])


def test_the_setting_needs_turn_credit_and_the_torch_backend() -> None:
    with pytest.raises(ValidationError, match="needs credit: turn"):
        AlgorithmConfig(baseline="value")
    algo = AlgorithmConfig(baseline="value", credit="turn")
    with pytest.raises(ValidationError, match="algorithm.baseline: 'value' needs backend 'torch'"):
        AgentConfig(model_path="m", backend="megatron", algorithm=algo)


def policy(model_dir: Path, baseline: str, lr: float = 1e-2) -> TorchPolicy:
    return TorchPolicy(AgentConfig(model_path=str(model_dir), seed=3, algorithm=AlgorithmConfig(
        lr=lr, credit="turn", gamma=0.9, baseline=baseline, epochs=2, minibatches=2)), 1.0)


def test_a_zero_value_is_the_group_baseline_and_fitting_it_leaves_the_policy_alone(tiny_model_dir: Path) -> None:
    group = policy(tiny_model_dir, "group")
    valued = policy(tiny_model_dir, "value")
    assert valued.critic is not None and group.critic is None
    last = valued.critic.head[-1]
    torch.nn.init.zeros_(last.weight)
    torch.nn.init.zeros_(last.bias)
    group.train_step(BATCH)
    metrics = valued.train_step(BATCH)  # the head's values are 0 for this step; then it fits the returns
    assert all(torch.equal(a, b) for a, b in zip(group.trainable, valued.trainable, strict=True))
    assert metrics["value_mean"] == 0.0 and metrics["value_loss"] > metrics["value_fit_loss"]
    assert any(bool(p.any()) for p in last.parameters())  # the head learnt; the policy did not see it


def test_the_head_learns_the_returns_and_resumes_with_the_trainer(tiny_model_dir: Path, tmp_path: Path) -> None:
    valued = policy(tiny_model_dir, "value", lr=1e-5)  # the features barely move: the head's fit shows
    losses = [valued.train_step(BATCH)["value_loss"] for _ in range(40)]
    assert losses[-1] < 0.5 * losses[0], losses
    valued.save_state(tmp_path / "state", valued.weight_version)
    hf_dir, _ = valued.save(tmp_path / "weights")
    resumed = policy(tiny_model_dir, "value")
    assert resumed.load_state(tmp_path / "state") == 40
    assert valued.critic is not None and resumed.critic is not None
    head = dict(valued.critic.head.state_dict())
    assert all(torch.equal(v, resumed.critic.head.state_dict()[k]) for k, v in head.items())
    assert resumed.critic.optimizer.state_dict()["state"]  # Adam's moments too
    from safetensors.torch import load_file  # the engines' weights are the policy's, with no value head
    assert set(load_file(next(hf_dir.glob("*.safetensors")))) <= set(valued.model.state_dict())


def test_a_non_finite_head_fails_its_step_and_leaves_the_policy(tiny_model_dir: Path) -> None:
    valued = policy(tiny_model_dir, "value")
    assert valued.critic is not None
    before = [p.detach().clone() for p in valued.trainable]
    with torch.no_grad():
        valued.critic.head[-1].bias.fill_(float("nan"))
    with pytest.raises(NonFiniteStep, match="non-finite value"):
        valued.train_step(BATCH)
    assert valued.weight_version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, valued.trainable, strict=True))
