"""The bar for the real-model demo: a plain GRPO loop in one process (transformers + peft), the shape of
``configs/llm_answer.yaml``'s first agent: LoRA r 8 on q/k/v/o, lr 2e-4, 8 questions x 4 samples a step,
12 new tokens at temperature 1, reward +1 right / 0 wrong / -0.5 with no integer (the last integer counts),
the environment's own system message and question text. Greedy accuracy on held-out questions is taken
at the start and the end. Prints one JSON line: per-step seconds, start and end accuracy.

    PYTHONPATH=. python tests/bench/llm_grpo_inprocess.py models/smollm2-135m-instruct --steps 6
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.envs.answer_then_answer import AnswerThenAnswer

SYSTEM = AnswerThenAnswer.default_system["first"]
INTEGER = re.compile(r"-?\d+")


def reward(reply: str, truth: int) -> float:
    found = INTEGER.findall(reply)
    return -0.5 if not found else float(int(found[-1]) == truth)


def prompt_ids(tok, a: int, b: int) -> list[int]:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{a}+{b}="}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def generate(model, tok, prompts: list[list[int]], n: int, greedy: bool, max_new: int) -> list[list[int]]:
    rows = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=not greedy,
                             temperature=None if greedy else 1.0, top_k=None, top_p=None,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    gen = []
    for row in out[:, width:].tolist():
        cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        gen.append(row[:cut])
    return gen


def accuracy(model, tok, questions: list[tuple[int, int]]) -> float:
    model.eval()
    gen = generate(model, tok, [prompt_ids(tok, a, b) for a, b in questions], 1, True, 12)
    return sum(reward(tok.decode(g, skip_special_tokens=True), a + b) == 1.0
               for g, (a, b) in zip(gen, questions, strict=True)) / len(questions)


def grpo_update(model, tok, opt, prompts: list[list[int]], score, n: int, max_new: int = 12) -> float:
    """One GRPO step: ``n`` samples of each prompt at temperature 1, each scored by ``score(i, reply)`` (``i``:
    the prompt's index), advantages normalised within each prompt's group; returns the mean reward."""
    model.eval()
    gen = generate(model, tok, prompts, n, False, max_new)
    rewards = torch.tensor([score(i // n, tok.decode(g, skip_special_tokens=True)) for i, g in enumerate(gen)])
    grouped = rewards.view(len(prompts), n)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)
    model.train()
    rows = [prompts[i // n] + g for i, g in enumerate(gen)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    lmask = torch.zeros_like(ids, dtype=torch.float32)
    for i in range(len(rows)):
        lmask[i, len(prompts[i // n]):len(rows[i])] = 1.0
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = lmask[:, 1:]
    loss = -((logp * m).sum(1) / m.sum(1).clamp(min=1) * adv).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(rewards.mean())


def grpo_step(model, tok, opt, questions: list[tuple[int, int]], n: int) -> float:
    prompts = [prompt_ids(tok, a, b) for a, b in questions]
    return grpo_update(model, tok, opt, prompts, lambda i, reply: reward(reply, sum(questions[i])), n)


def lora_model(path: str, lr: float = 2e-4):
    """The model at ``path`` with LoRA r 8 on q/k/v/o, and its AdamW optimiser."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj"], lora_dropout=0.0))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    every = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(every)
    held_out, train = every[:48], every[48:]
    tok = AutoTokenizer.from_pretrained(args.model)
    model, opt = lora_model(args.model)
    start = accuracy(model, tok, held_out)
    times, mean_rewards = [], []
    for _ in range(args.steps):
        t = time.monotonic()
        mean_rewards.append(grpo_step(model, tok, opt, rng.sample(train, 8), 4))
        times.append(time.monotonic() - t)
    end = accuracy(model, tok, held_out)
    print(json.dumps({"steps": args.steps, "step_s": [round(x, 2) for x in times],
                      "mean_step_s": round(sum(times) / len(times), 2), "start_acc": start, "end_acc": end,
                      "mean_reward": [round(r, 3) for r in mean_rewards], "held_out": len(held_out)}))


if __name__ == "__main__":
    main()
