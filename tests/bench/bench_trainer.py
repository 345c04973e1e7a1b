"""Trainer throughput: training tokens per second of one ``train_step`` on the demo model, per backend.

The batch is shaped like the demo's (``configs/demo.yaml``: 16 groups of 8 tic-tac-toe
games, GRPO, 2 minibatches): each sample is agent X's real view of a game between two
scripted random players, rendered with the demo tokenizer's chat template. Tokens per
second counts every token of every sample (prompt and generated) per pass, as the
trainer's ``tokens_per_s`` metric does. The backends run in one process on the same batch,
their steps alternating; ``megatron`` is measured when its package is present.

On a GPU (``BENCH_TRAINER_DEVICE=cuda``, ``BENCH_TRAINER_ARMS=torch:float32,torch:bfloat16,...``,
``BENCH_TRAINER_MODEL_DIR`` a bigger model) each arm also gets its MFU: 6 x matmul parameters x
tokens/s over ``BENCH_PEAK_TFLOPS`` (attention's score FLOPs left out: these sequences are short).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
from pathlib import Path

from services.contracts.config import AgentConfig, AlgorithmConfig
from services.contracts.messages import Sample
from services.demo.tiny_model import create_tiny_model
from services.envs.render import render_user_turn
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
            closing = [] if out and out[-1] == tokenizer.eos_token_id else [tokenizer.eos_token_id]  # end of turn
            tokens += prompt + out + closing
            mask += [0] * len(prompt) + [1] * len(out) + [0] * len(closing)
        result = asyncio.run(env.step(role, reply))
        done, rewards = result.done, result.rewards
    return Sample(agent="A", role="X", episode_id=f"e{seed}", group_id=f"g{group}", group_samples=GROUP_SIZE,
                  tokens=tokens, loss_mask=mask, rollout_logprobs=[-1.0 * m for m in mask],
                  reward=rewards.get("X", 0.0), weight_versions=[0])


ARMS = os.environ.get("BENCH_TRAINER_ARMS", "")  # e.g. "torch:float32,torch:bfloat16,megatron:bfloat16"
MODEL_DIR = os.environ.get("BENCH_TRAINER_MODEL_DIR", "")  # default: the demo's tiny model
DEVICE = os.environ.get("BENCH_TRAINER_DEVICE", "cpu")
MINIBATCHES = int(os.environ.get("BENCH_TRAINER_MINIBATCHES", "2"))
# MFU's denominator: dense bf16 peak of the GPU (H100 SXM: 989 TFLOP/s); a float32 arm is held to it too.
PEAK_TFLOPS = float(os.environ.get("BENCH_PEAK_TFLOPS", "989"))


def matmul_params(model_dir: Path) -> int:
    """Parameters a token multiplies through (every weight matrix, the LM head once even when tied; no norms)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn = c.hidden_size * head * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * (attn + mlp) + c.vocab_size * c.hidden_size


def measure(arms: list[str], model_dir: Path, samples: list[Sample], steps: int) -> dict[str, float]:
    """Median tokens/s per arm (``backend:dtype``); the arms' steps alternate, so a busy machine slows them alike."""
    from services.training.backends import make_policy

    policies = {}
    for arm in arms:
        backend, dtype = arm.split(":")
        acfg = AgentConfig(model_path=str(model_dir), backend=backend,
                           algorithm=AlgorithmConfig(name="grpo", lr=1e-3, minibatches=MINIBATCHES),
                           trainer={"device": DEVICE, "dtype": dtype})
        policies[arm] = make_policy(acfg, 1.0)
        policies[arm].train_step(samples)  # warm-up
    rates: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(steps):
        for arm, policy in policies.items():
            policy.weight_version = 0  # keep every sample on-policy, as in the demo's agent A
            rates[arm].append(policy.train_step(samples)["tokens_per_s"])
    return {f"{a.replace(':float32', '').replace(':', '_')}_tokens_per_s": statistics.median(r)
            for a, r in rates.items()}


def default_arms() -> list[str]:
    arms = ["torch:float32"]
    try:
        import services.training.megatron  # noqa: F401
        arms.append("megatron:float32")
    except ImportError:
        pass
    return arms


def run(steps: int = 5) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(MODEL_DIR) if MODEL_DIR else create_tiny_model(Path(tmp) / "model", seed=0)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        samples = [game_view(tokenizer, seed=g * 1000 + k, group=g) for g in range(GROUPS) for k in range(GROUP_SIZE)]
        out: dict[str, float] = {"batch_samples": float(len(samples)),
                                 "batch_tokens": float(sum(len(s.tokens) for s in samples))}
        arms = ARMS.split(",") if ARMS else default_arms()
        out.update(measure(arms, model_dir, samples, steps))
        if "megatron_tokens_per_s" in out:
            out["megatron_over_torch"] = out["megatron_tokens_per_s"] / out["torch_tokens_per_s"]
        if DEVICE != "cpu":  # 6 FLOPs per matmul parameter per token: a forward and a backward pass
            flops = 6 * matmul_params(model_dir)
            out.update({f"{k.removesuffix('_tokens_per_s')}_mfu": v * flops / (PEAK_TFLOPS * 1e12)
                        for k, v in list(out.items()) if k.endswith("_tokens_per_s")})
        return out


if __name__ == "__main__":
    print(run(int(os.environ.get("BENCH_TRAINER_STEPS", "5"))))
