"""Per-turn credit (``algorithm.credit: turn``; services/training/credit.py, docs/architecture.md §7): what each
generated turn earned, its return-to-go against the group's samples at the same turn, the per-token tensor
lined up with the loss mask, and a real torch step on the tiny model."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from services.contracts.config import AgentConfig, AlgorithmConfig
from services.contracts.messages import GenerateReply, Sample, SamplingParams, turn_spans
from services.contracts.players import AgentPlayer
from services.envs.guess_number import GuessNumber
from services.inference.generator import Engine
from services.play.episode import View, turn_credit
from services.play.local import EnginePlayers
from services.training.algorithms import make_algorithm
from services.training.backends import make_policy
from services.training.credit import token_advantages, turn_advantages, turn_returns
from services.training.step import pad_batch

# a view of three generated turns: context 0s, replies 1s
MASK = [0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]


def sample(group: str, turn_rewards: list[float], mask: list[int] = MASK, sid: str = "e") -> Sample:
    return Sample(agent="A", role="guesser", episode_id=sid, group_id=group, group_samples=3,
                  tokens=[5 + i for i in range(len(mask))], loss_mask=mask, rollout_logprobs=[0.0] * len(mask),
                  reward=sum(turn_rewards), weight_versions=[0] * len(turn_spans(mask)), turn_rewards=turn_rewards)


def reply(tokens: int, version: int = 0) -> GenerateReply:
    return GenerateReply(request_id="r", agent="A", episode_id="e", turn=0, output_ids=[7] * tokens,
                         output_logprobs=[-0.5] * tokens, finish_reason="stop", weight_version=version, engine="A-0")


def test_each_turn_earns_its_rewards_until_the_next_and_the_last_the_final() -> None:
    view = View(player=AgentPlayer(agent="A"), role="guesser")
    view.earn(0.5)                                     # before the first turn
    view.add_context([1, 2])
    view.add_reply(reply(2), 1)
    view.earn(-0.1)
    view.earn(-0.2)                                    # the opponent's turn
    view.add_context([3])
    view.add_reply(reply(0), 3)                        # no token: no turn of its own
    view.earn(-0.1)
    view.add_context([4])
    view.add_reply(reply(3), 4)
    view.earn(-0.1)
    total = 0.5 - 0.1 - 0.2 - 0.1 - 0.1 + 1.0  # the per-turn rewards plus a final +1
    credit = turn_credit(view, total)
    assert credit == pytest.approx([0.5 - 0.1 - 0.2 - 0.1, -0.1 + 1.0])
    assert math.isclose(sum(credit), total)
    assert turn_credit(View(player=AgentPlayer(agent="A"), role="nobody"), 0.0) == []


def test_the_contract_holds_turn_rewards_to_the_turns_and_the_reward() -> None:
    assert turn_spans(MASK) == [(2, 4), (5, 6), (8, 11)]
    sample("g", [0.1, 0.2, 0.7])
    with pytest.raises(ValidationError, match="3 generated turns"):
        sample("g", [0.1, 0.9])
    with pytest.raises(ValidationError, match="sum to"):
        Sample(**{**sample("g", [0.1, 0.2, 0.7]).model_dump(), "reward": 2.0})


def test_returns_and_advantages_against_the_group_at_the_same_turn() -> None:
    a = sample("g", [-0.1, -0.1, 1.0], sid="a")            # three turns, found
    b = sample("g", [-0.1, 0.9], mask=[0, 1, 0, 1], sid="b")  # two turns, found sooner
    c = sample("h", [0.4, 0.4, 0.4], sid="c")              # another group, alone
    assert turn_returns(a) == pytest.approx([0.8, 0.9, 1.0]) and turn_returns(b) == pytest.approx([0.8, 0.9])
    adv = turn_advantages([a, b, c], normalize_std=False)
    assert adv[0] == pytest.approx([0.0, 0.0, 0.0]) and adv[1] == pytest.approx([0.0, 0.0])  # equal returns
    a2 = sample("g", [-0.1, -0.1, -0.1], sid="a2")         # three turns, not found
    adv = turn_advantages([a, a2], normalize_std=False)
    assert adv[0] == pytest.approx([0.55, 0.55, 0.55]) and adv[1] == pytest.approx([-0.55, -0.55, -0.55])
    adv = turn_advantages([a, b, a2], normalize_std=True)
    # turn 0: returns 0.8, 0.8, -0.3 (mean 0.433, std 0.519); turn 2: only a and a2 (1.0, -0.1: +-1)
    assert adv[0][0] == pytest.approx((0.8 - 0.4333333) / 0.5185450, rel=1e-4)
    assert adv[0][2] == pytest.approx(1.0, rel=1e-4) and adv[2][2] == pytest.approx(-1.0, rel=1e-4)
    no_turns = Sample(**{**a.model_dump(), "turn_rewards": [], "reward": 0.3})
    assert turn_returns(no_turns) == [0.3]  # the episode's reward is one turn


def test_a_discount_makes_a_sooner_win_worth_more() -> None:
    """gamma < 1: G_k = r_k + gamma * G_(k+1); a final-only reward reached in fewer turns is worth more at
    each turn, so the same win two turns sooner gets the higher advantage."""
    slow = sample("g", [0.0, 0.0, 1.0], sid="slow")
    fast = sample("g", [0.0, 1.0], mask=[0, 1, 0, 1], sid="fast")
    assert turn_returns(slow, 0.9) == pytest.approx([0.81, 0.9, 1.0])
    assert turn_returns(fast, 0.9) == pytest.approx([0.9, 1.0])
    assert turn_returns(sample("g", [0.5, -0.1, 1.0]), 0.5) == pytest.approx([0.5 - 0.05 + 0.25, 0.4, 1.0])
    adv = turn_advantages([slow, fast], normalize_std=False, gamma=0.9)
    assert adv[1][0] > adv[0][0] and adv[1][0] == pytest.approx(0.045)
    assert turn_advantages([slow, fast], normalize_std=False) == [[0.0, 0.0, 0.0], [0.0, 0.0]]  # gamma 1: equal
    with pytest.raises(ValidationError, match="gamma"):
        AlgorithmConfig(credit="turn", gamma=0.0)
    with pytest.raises(ValidationError, match="needs credit: turn"):  # it would change nothing: refused
        AlgorithmConfig(gamma=0.9)


def test_token_advantages_line_up_with_the_shifted_loss_mask() -> None:
    a, b = sample("g", [0.1, 0.2, 0.7], sid="a"), sample("g", [0.5, 0.5], mask=[0, 1, 0, 1], sid="b")
    tok = token_advantages([a, b], [[1.0, 2.0, 3.0], [4.0, 5.0]])
    mask = pad_batch([a, b], pad_id=0)["mask"]
    assert tok.shape == mask.shape
    assert torch.equal(tok != 0, mask != 0)
    assert tok[0].tolist() == [0, 1, 1, 0, 2, 0, 0, 3, 3, 3] and tok[1, :3].tolist() == [4, 0, 5]
    one = token_advantages([Sample(**{**a.model_dump(), "turn_rewards": [], "reward": 1.0})], [[7.0]])
    assert one[0].tolist() == [0, 7, 7, 0, 7, 0, 0, 7, 7, 7]  # no turn rewards: one advantage on every turn


def test_turn_credit_needs_a_per_token_loss() -> None:
    with pytest.raises(ValueError, match="algorithm.credit"):
        make_algorithm(AlgorithmConfig(name="gspo", credit="turn"))
    plan = make_algorithm(AlgorithmConfig(credit="turn")).prepare([sample("g", [0.1, 0.2, 0.7], sid="a"),
                                                                   sample("g", [0.0, 0.0, 0.0], sid="b")], 0)
    assert plan.token_advantages is not None and plan.advantages_for([1], 4).shape == (1, 4)


def test_a_torch_step_under_turn_credit(tiny_model_dir: Path) -> None:
    """One-turn samples: turn credit is episode credit, to the last bit of the weights; several turns: not."""
    one = [sample("g", [r], mask=[0, 0, 1, 1], sid=f"s{i}") for i, r in enumerate((1.0, 0.0, 0.5))]
    after = {}
    for credit in ("episode", "turn"):
        torch.manual_seed(0)
        policy = make_policy(AgentConfig(model_path=str(tiny_model_dir),
                                         algorithm=AlgorithmConfig(lr=1e-2, credit=credit)), 1.0)
        policy.train_step(one)
        after[credit] = [p.detach().clone() for p in policy.trainable]
    assert all(torch.equal(x, y) for x, y in zip(after["episode"], after["turn"], strict=True))
    many = [sample("g", [1.0, -0.5, 0.0], sid="m0"), sample("g", [-0.5, 1.0, 0.0], sid="m1")]  # same totals
    for credit, moved in (("episode", False), ("turn", True)):
        policy = make_policy(AgentConfig(model_path=str(tiny_model_dir),
                                         algorithm=AlgorithmConfig(lr=1e-2, credit=credit)), 1.0)
        before = [p.detach().clone() for p in policy.trainable]
        metrics = policy.train_step(many)
        changed = any(not torch.equal(x, p) for x, p in zip(before, policy.trainable, strict=True))
        assert changed is moved, (credit, metrics)  # equal rewards: episode credit has nothing to learn


def test_a_played_guess_number_episode_carries_each_turns_rewards(tiny_model_dir: Path) -> None:
    """The real episode path: an agent guesses on an in-process engine; its sample's turn rewards are the
    environment's per-turn costs, one per generated turn, summing to its reward."""
    async def go():  # type: ignore[no-untyped-def]
        players = EnginePlayers({"A": Engine(tiny_model_dir)})
        a = AgentPlayer(agent="A")
        try:
            return await players.play(GuessNumber({"high": 8, "max_turns": 4, "turn_cost": 0.1}, 3), "e", "g",
                                      {"guesser": a}, {a: SamplingParams(temperature=1.0, max_new_tokens=3, seed=5)},
                                      "train", random.Random(0))
        finally:
            players.stop()

    result = asyncio.run(go())
    (s,) = result.samples({"A": 1})
    assert len(s.turn_rewards) == len(turn_spans(s.loss_mask)) == len(s.weight_versions) >= 1
    assert math.isclose(sum(s.turn_rewards), s.reward, abs_tol=1e-9)
    played = [t for t in result.transcript if t.get("tokens")]
    assert [t["turn_rewards"].get("guesser", 0.0) for t in played][:-1] == pytest.approx(s.turn_rewards[:-1])
