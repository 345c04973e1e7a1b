"""Trainer figures on a real chat model: Tandem's torch backend against a plain transformers + peft loop.

    python tests/bench/bench_trainer_llm.py [--model smollm2|tiny|DIR] [--rounds 2] [--samples 8] [--seq 128]

Both arms train LoRA adapters (r 8, alpha 16, on q/k/v/o: the real-model configs' setting) on the same base,
the same batch (``--samples`` sequences of ``--seq`` tokens, half of each masked as the prompt, rewards in
two groups) and the same torch threads, one optimizer step per batch, their steps alternating:

* ``tandem``: ``TorchPolicy.train_step`` (GRPO, one minibatch, float32; what the trainer service runs);
* ``plain``: a loop written against transformers and peft alone: forward, log_softmax and gather, the clipped
  ratio loss on the masked tokens with the group-normalised rewards, backward, clip, AdamW step;
* ``bf16``: the backend under bf16 autocast (forced: on a CPU without native bf16 the trainer itself keeps
  float32, ``devices.training_precision``); ``checkpointing``: with ``trainer.gradient_checkpointing``.

Figures (medians over rounds): ``llm_tokens_per_s_ratio`` (tandem ÷ plain, tokens of every sample per
second), ``llm_bf16_autocast_speedup`` (bf16 ÷ float32 tokens/s), ``llm_checkpointing_speed_ratio`` and the
step's ``activation_mb`` with and without checkpointing, ``optimizer_state_mb`` (from the step's metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.contracts.agent_parts import TrainerConfig  # noqa: E402
from services.contracts.config import AgentConfig, AlgorithmConfig, LoraConfig  # noqa: E402
from services.contracts.messages import Sample  # noqa: E402
from services.training.backends import make_policy  # noqa: E402
from services.training.step import pad_batch  # noqa: E402

SMOLLM2 = Path(os.environ.get("BENCH_LLM_DIR", "/work/models/smollm2-135m-instruct"))
LORA = LoraConfig(r=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def samples(n: int, seq: int, vocab: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = [rng.randrange(3, vocab) for _ in range(seq)]
        mask = [0] * (seq // 2) + [1] * (seq - seq // 2)
        out.append(Sample(agent="A", role="X", episode_id=f"e{i}", group_id=f"g{i % 2}", group_samples=n // 2,
                          tokens=tokens, loss_mask=mask, rollout_logprobs=[-2.0 * m for m in mask],
                          reward=float(rng.random() < 0.5), weight_versions=[0]))
    return out


class PlainLoop:
    """transformers + peft and nothing else: the baseline."""

    def __init__(self, model_dir: Path) -> None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = get_peft_model(base, PeftLoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=0.0,
                                                         target_modules=LORA.target_modules, bias="none",
                                                         task_type="CAUSAL_LM")).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-5)

    def step(self, batch: list[Sample]) -> None:
        b = pad_batch(batch, 0)
        rewards = torch.tensor([s.reward for s in batch])
        groups = torch.tensor([int(s.group_id[1:]) for s in batch])
        adv = torch.zeros_like(rewards)
        for g in groups.unique():
            r = rewards[groups == g]
            adv[groups == g] = (r - r.mean()) / (r.std() + 1e-6)
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(2, b["targets"][..., None])[..., 0]
        ratio = torch.exp(logp - b["old_logp"])
        a = adv[:, None]
        loss = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
        loss = (loss * b["mask"]).sum() / b["mask"].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()


def tandem(model_dir: Path, dtype: str = "float32", checkpointing: bool = False) -> Any:
    torch.manual_seed(0)
    policy = make_policy(AgentConfig(model_path=str(model_dir), lora=LORA, algorithm=AlgorithmConfig(lr=1e-5),
                                     trainer=TrainerConfig(gradient_checkpointing=checkpointing)), 1.0)
    policy.precision = dtype  # measured even where the trainer would not autocast (a CPU without native bf16)
    return policy


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny" or (args.model == "smollm2" and not (SMOLLM2 / "config.json").is_file()):
            from services.demo.tiny_model import create_tiny_model

            path, name = create_tiny_model(Path(tmp) / "tiny", seed=0), "tiny"
        else:
            path = SMOLLM2 if args.model == "smollm2" else Path(args.model)
            name = path.name
        make = {"plain": lambda: PlainLoop(path), "tandem": lambda: tandem(path),
                "bf16": lambda: tandem(path, "bfloat16"), "checkpointing": lambda: tandem(path, checkpointing=True)}
        arms = {a: make[a]() for a in dict.fromkeys(["tandem", *args.arms])}
    vocab = int(AutoConfig.from_pretrained(path).vocab_size)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    per: dict[str, list[float]] = {a: [] for a in arms}
    metrics: dict[str, dict[str, Any]] = {}
    for i in range(args.rounds + 1):  # round 0: untimed warm-up
        batch = samples(args.samples, args.seq, vocab, seed=i)
        order = list(arms) if i % 2 == 0 else list(reversed(arms))
        for a in order:
            t0 = time.perf_counter()
            if a == "plain":
                arms[a].step(batch)
            else:
                arms[a].weight_version = 0  # the batch stays on-policy: no extra no-grad pass
                metrics[a] = arms[a].train_step(batch)
            if i:
                per[a].append(args.samples * args.seq / (time.perf_counter() - t0))
    med = {a: statistics.median(v) for a, v in per.items()}
    out: dict[str, Any] = {"model": name, **{f"{a}_tokens_per_s": round(v, 1) for a, v in med.items()}}
    if "plain" in med:
        out["llm_tokens_per_s_ratio"] = round(med["tandem"] / med["plain"], 3)
    if "bf16" in med:
        out["llm_bf16_autocast_speedup"] = round(med["bf16"] / med["tandem"], 3)
    if "checkpointing" in med:
        out["llm_checkpointing_speed_ratio"] = round(med["checkpointing"] / med["tandem"], 3)
        out["activation_mb_checkpointing"] = metrics["checkpointing"]["activation_mb"]
    return {**out, "activation_mb": metrics["tandem"]["activation_mb"],
            "optimizer_state_mb": metrics["tandem"]["optimizer_state_mb"],
            "batch": f"{args.samples} x {args.seq} tokens", "threads": args.threads,
            "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
            "seconds": round(time.perf_counter() - started, 1)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 (the tiny model if absent), tiny, or a directory")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arms", type=lambda s: s.split(","), default=["plain", "tandem", "bf16", "checkpointing"],
                   help="which arms run (tandem always: the others are measured against it)")
    return p


def run() -> dict[str, Any]:
    """``make bench``'s entry (a section): ``trainer.llm_*`` on SmolLM2 when present, ``trainer.tiny.*``."""
    out: dict[str, Any] = {"tiny": measure(parser().parse_args(["--model", "tiny"]))}
    if (SMOLLM2 / "config.json").is_file():
        out |= measure(parser().parse_args(["--model", "smollm2"]))
    return {"trainer": out}


if __name__ == "__main__":
    print(json.dumps(measure(parser().parse_args()), indent=2))
