"""Trainer throughput: training tokens per second of one ``train_step`` on the demo model, per backend.

The batch is shaped like the demo's (``configs/demo.yaml``: 16 groups of 8 tic-tac-toe
games, GRPO, 2 minibatches): each sample is agent X's real view of a game between two
scripted random players, rendered with the demo tokenizer's chat template. Tokens per
second counts every token of every sample (prompt and generated) per pass, as the
trainer's ``tokens_per_s`` metric does. The backends run in one process on the same batch,
their steps alternating; ``megatron`` is measured when its package is present.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
from pathlib import Path

from services.contracts.config import AgentConfig, AlgorithmConfig
from services.contracts.messages import Sample
from services.demo.tiny_model import create_tiny_model
from services.envs.render import close_assistant_turn, render_user_turn
from services.envs.tictactoe import TicTacToe

GROUPS, GROUP_SIZE = 16, 8


def game_view(tokenizer, seed: int, group: int) -> Sample:  # type: ignore[no-untyped-def]
    env, rng = TicTacToe({}, seed), random.Random(seed)
    tokens: list[int] = []
    mask: list[int] = []
    done, rewards = False, {}
    while not done:
        role = env.current_role()
        reply = env.scripted_reply(role, "random", rng)
        if role == "X":
            prompt = render_user_turn(tokenizer, env.observation(role))
            out = tokenizer.encode(reply, add_special_tokens=False)
            closing = close_assistant_turn(tokenizer, out)
            tokens += prompt + out + closing
            mask += [0] * len(prompt) + [1] * len(out) + [0] * len(closing)
        result = asyncio.run(env.step(role, reply))
        done, rewards = result.done, result.rewards
    return Sample(agent="A", role="X", episode_id=f"e{seed}", group_id=f"g{group}", group_samples=GROUP_SIZE,
                  tokens=tokens, loss_mask=mask, rollout_logprobs=[-1.0 * m for m in mask],
                  reward=rewards.get("X", 0.0), weight_versions=[0])


def measure(backends: list[str], model_dir: Path, samples: list[Sample], steps: int) -> dict[str, float]:
    """Median tokens/s per backend; the backends' steps alternate, so a busy machine slows them alike."""
    from services.training.backends import make_policy

    policies = {}
    for backend in backends:
        acfg = AgentConfig(model_path=str(model_dir), backend=backend,
                           algorithm=AlgorithmConfig(name="grpo", lr=1e-3, minibatches=2))
        policies[backend] = make_policy(acfg, 1.0)
        policies[backend].train_step(samples)  # warm-up
    rates: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(steps):
        for backend, policy in policies.items():
            policy.weight_version = 0  # keep every sample on-policy, as in the demo's agent A
            rates[backend].append(policy.train_step(samples)["tokens_per_s"])
    return {f"{b}_tokens_per_s": statistics.median(r) for b, r in rates.items()}


def run(steps: int = 5) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny_model(Path(tmp) / "model", seed=0)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        samples = [game_view(tokenizer, seed=g * 1000 + k, group=g) for g in range(GROUPS) for k in range(GROUP_SIZE)]
        out: dict[str, float] = {"batch_samples": float(len(samples)),
                                 "batch_tokens": float(sum(len(s.tokens) for s in samples))}
        backends = ["torch"]
        try:
            import services.training.megatron  # noqa: F401
            backends.append("megatron")
        except ImportError:
            pass
        out.update(measure(backends, model_dir, samples, steps))
        if "megatron_tokens_per_s" in out:
            out["megatron_over_torch"] = out["megatron_tokens_per_s"] / out["torch_tokens_per_s"]
        return out


if __name__ == "__main__":
    print(run())
