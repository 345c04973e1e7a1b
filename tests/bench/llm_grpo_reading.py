"""Can RL teach the real model to read? A plain GRPO loop in one process (``llm_grpo_inprocess``'s: LoRA r 8 on
q/k/v/o, 16 questions x 4 samples a step at temperature 1) on the patient's task of ``doctor_patient`` cut to
its core: the model is a patient whose notes list ``--facts`` yes/no symptoms ("fever: yes, rash: no, ..."),
the asked one among them, and it must answer the doctor's question ("Do you have a rash?") as its notes say.
Reward +1 for the notes' answer, -1 for the other, -0.5 for a reply with neither yes nor no (the first of the
two words counts, as the environments read it). The symptom profiles (2^6) are split: evaluations ask about
16 profiles never trained on, greedy, 3 symptoms each. Prints one JSON line: the held-out accuracy, malformed
and yes rates at the start and every ``--every`` steps (answering at random, or always yes or no, gives
about 0.5).

    PYTHONPATH=. python tests/bench/llm_grpo_reading.py models/smollm2-135m-instruct --facts 6 --steps 20
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time

import torch
from transformers import AutoTokenizer

from services.envs.twenty_questions import yes_no
from tests.bench.llm_grpo_inprocess import generate, grpo_update, lora_model

SYMPTOMS = ("fever", "cough", "rash", "headache", "vomiting", "travel")
QUESTIONS = {"fever": "Do you have a fever?", "cough": "Do you have a cough?", "rash": "Do you have a rash?",
             "headache": "Do you have a headache?", "vomiting": "Have you been vomiting?",
             "travel": "Have you travelled abroad?"}
SYSTEM = "You are a patient at the doctor. Answer the doctor's question truthfully from your notes: yes or no."
Case = tuple[tuple[int, ...], str]  # (a yes/no profile over SYMPTOMS, the symptom asked about)


def prompt_ids(tok, case: Case, facts: int) -> list[int]:
    """The patient's chat: its notes (``facts`` symptoms of the profile, the asked one among them, in the
    table's order; the others chosen by the case) and the doctor's question."""
    profile, asked = case
    others = [s for s in SYMPTOMS if s != asked]
    kept = set(random.Random(f"{profile}{asked}").sample(others, facts - 1)) | {asked}
    notes = ", ".join(f"{s}: {'yes' if v else 'no'}" for s, v in zip(SYMPTOMS, profile, strict=True) if s in kept)
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Your notes: {notes}\nDoctor: {QUESTIONS[asked]}"}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def reward(reply: str, case: Case) -> float:
    profile, asked = case
    said = yes_no(reply)
    if said is None:
        return -0.5
    return 1.0 if said == bool(profile[SYMPTOMS.index(asked)]) else -1.0


def evaluate(model, tok, cases: list[Case], facts: int) -> dict[str, float]:
    model.eval()
    replies = [tok.decode(g, skip_special_tokens=True)
               for g in generate(model, tok, [prompt_ids(tok, c, facts) for c in cases], 1, True, 6)]
    n = len(cases)
    return {"right": round(sum(reward(r, c) == 1.0 for r, c in zip(replies, cases, strict=True)) / n, 3),
            "malformed": round(sum(yes_no(r) is None for r in replies) / n, 3),
            "yes": round(sum(yes_no(r) is True for r in replies) / n, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--facts", type=int, default=6, choices=range(1, len(SYMPTOMS) + 1))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    profiles = list(itertools.product((0, 1), repeat=len(SYMPTOMS)))
    random.Random(0).shuffle(profiles)
    held_out, train = profiles[:16], profiles[16:]
    cases = [(p, s) for p in held_out for s in random.Random(str(p)).sample(SYMPTOMS, 3)]
    tok = AutoTokenizer.from_pretrained(args.model)
    model, opt = lora_model(args.model, args.lr)
    curve = [{"step": 0, **evaluate(model, tok, cases, args.facts)}]
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        batch = [(rng.choice(train), rng.choice(SYMPTOMS)) for _ in range(16)]
        prompts = [prompt_ids(tok, c, args.facts) for c in batch]
        mean = grpo_update(model, tok, opt, prompts, lambda i, reply, b=batch: reward(reply, b[i]), 4, 6)
        if step % args.every == 0 or step == args.steps:
            curve.append({"step": step, "train_reward": round(mean, 3), **evaluate(model, tok, cases, args.facts)})
    print(json.dumps({"facts": args.facts, "steps": args.steps, "lr": args.lr, "seed": args.seed,
                      "held_out_questions": len(cases), "train_s": round(time.monotonic() - started, 1),
                      "curve": curve}))


if __name__ == "__main__":
    main()
