"""MinT's two-agent recipe on the official Tinker SDK, served by Tandem (``tandem serve``).

Two LoRA training clients on one base model are two agents with their own weights. Each
step, Agent A answers an arithmetic question; Agent B answers the same question after
seeing A's answer. Both are scored, and both are trained by RL through their own client:
``importance_sampling`` (REINFORCE with the sampler's logprobs) on group-baselined rewards.

    tandem init-demo models/demo-ttt              # or any local HF model directory
    tandem serve &                                # http://127.0.0.1:8910
    TINKER_API_KEY=tml-local python examples/mint_two_agents.py --base-model models/demo-ttt

Nothing here is Tandem-specific: pointed at another Tinker server, the script runs the same.
"""

from __future__ import annotations

import argparse
import os
import random
import re

import tinker
from tinker import types


def reward(text: str, answer: int) -> float:
    """1 for the right number first, 0.2 for some other number, 0 for no number."""
    found = re.search(r"-?\d+", text)
    if found is None:
        return 0.0
    return 1.0 if int(found.group()) == answer else 0.2


def rollout(sampler: tinker.SamplingClient, tokenizer, prompt: str, group: int, max_tokens: int, seed: int
            ) -> tuple[list[int], list[types.SampledSequence]]:
    prompt_tokens = tokenizer.encode(prompt)
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=["\n"])
    result = sampler.sample(types.ModelInput.from_ints(prompt_tokens), group, params).result()
    return prompt_tokens, list(result.sequences)


def rl_data(prompt_tokens: list[int], sequences: list[types.SampledSequence], rewards: list[float]
            ) -> list[types.Datum]:
    """One datum per sample: the sampled tokens carry the group-baselined reward; the prompt carries 0."""
    mean = sum(rewards) / len(rewards)
    data = []
    for seq, r in zip(sequences, rewards, strict=True):
        tokens = prompt_tokens + list(seq.tokens)
        n_prompt = len(prompt_tokens) - 1  # targets are the tokens shifted by one
        logprobs = [0.0] * n_prompt + list(seq.logprobs or [0.0] * len(seq.tokens))
        advantages = [0.0] * n_prompt + [r - mean] * len(seq.tokens)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": logprobs,
                                                "advantages": advantages}))
    return data


def train(agent: tinker.TrainingClient, data: list[types.Datum], lr: float) -> float:
    fb = agent.forward_backward(data, "importance_sampling")
    opt = agent.optim_step(types.AdamParams(learning_rate=lr, grad_clip_norm=1.0))
    loss = fb.result().metrics["loss:sum"]
    opt.result()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8910"))
    parser.add_argument("--base-model", required=True, help="a local model directory the server can read")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="samples per agent per step")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    service = tinker.ServiceClient(base_url=args.base_url)
    agent_a = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=args.seed)
    agent_b = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=args.seed + 1)
    agent_a, agent_b = agent_a.result(), agent_b.result()
    tokenizer = agent_a.get_tokenizer()
    print(f"two agents on {args.base_model}: {agent_a.model_id}, {agent_b.model_id}")

    for step in range(args.steps):
        x, y = rng.randint(1, 9), rng.randint(1, 9)
        question, answer = f"What is {x} + {y}?", x + y
        sampler_a = agent_a.save_weights_and_get_sampling_client().result()
        sampler_b = agent_b.save_weights_and_get_sampling_client().result()

        prompt_a = f"Agent A: answer the math question with only the number. {question}\nAnswer:"
        tokens_a, seqs_a = rollout(sampler_a, tokenizer, prompt_a, args.group, args.max_tokens, args.seed + step)
        texts_a = [tokenizer.decode(s.tokens) for s in seqs_a]
        rewards_a = [reward(t, answer) for t in texts_a]

        prompt_b = (f"Agent B: Agent A answered '{texts_a[0].strip()}'. Now answer the same question with "
                    f"only the number. {question}\nAnswer:")
        tokens_b, seqs_b = rollout(sampler_b, tokenizer, prompt_b, args.group, args.max_tokens, args.seed + step)
        rewards_b = [reward(tokenizer.decode(s.tokens), answer) for s in seqs_b]

        loss_a = train(agent_a, rl_data(tokens_a, seqs_a, rewards_a), args.lr)
        loss_b = train(agent_b, rl_data(tokens_b, seqs_b, rewards_b), args.lr)
        print(f"step {step}: {question} A={texts_a[0].strip()!r} reward_a={sum(rewards_a) / len(rewards_a):.2f} "
              f"reward_b={sum(rewards_b) / len(rewards_b):.2f} loss_a={loss_a:.4f} loss_b={loss_b:.4f}", flush=True)

    final = agent_a.save_state("agent-a-final").result().path, agent_b.save_state("agent-b-final").result().path
    print(f"saved {final[0]} and {final[1]}")
    service.close("success").result()


if __name__ == "__main__":
    main()
