"""PyTorch + transformers training backend (CPU, or one GPU).

Holds the policy, its AdamW optimizer and the step counter; trains one batch
of samples with the configured algorithm and writes each new version as an
HF-format directory (config, safetensors, tokenizer) that the engines load.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.contracts.config import AlgorithmConfig
from services.contracts.messages import Sample
from services.trainer.grpo import clipped_policy_loss, group_advantages, token_logprobs


def file_checksum(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pad_batch(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors; targets are tokens shifted by one."""
    t = max(len(s.tokens) for s in samples)
    b = len(samples)
    tokens = torch.full((b, t), pad_id, dtype=torch.long)
    attn = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.float32)
    old = torch.zeros((b, t), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        tokens[i, :n] = torch.tensor(s.tokens)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old[i, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    return {"input_ids": tokens, "attention_mask": attn, "targets": tokens[:, 1:],
            "mask": mask[:, 1:], "old_logp": old[:, 1:]}


class TorchPolicy:
    def __init__(self, model_path: str, algo: AlgorithmConfig, temperature: float, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.algo = algo
        self.temperature = temperature
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.lr,
                                           weight_decay=algo.weight_decay)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return token_logprobs(out.logits[:, :-1], batch["targets"], self.temperature)

    def train_step(self, samples: list[Sample]) -> dict[str, Any]:
        start = time.perf_counter()
        advantages = group_advantages([s.reward for s in samples], [s.group_id for s in samples],
                                      self.algo.normalize_std)
        order = torch.arange(len(samples))
        chunks = torch.chunk(order, min(self.algo.minibatches, len(samples)))
        stats: dict[str, float] = {}
        grad_norms = []
        for epoch in range(self.algo.epochs):
            for idx in chunks:
                part = [samples[i] for i in idx.tolist()]
                batch = pad_batch(part, self.pad_id)
                new_logp = self.logprobs(batch)
                loss, s = clipped_policy_loss(new_logp, batch["old_logp"], advantages[idx], batch["mask"],
                                              self.algo.clip_eps_low, self.algo.clip_eps_high)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.algo.max_grad_norm)))
                self.optimizer.step()
                if epoch == 0 and not stats:
                    stats = {f"first_{k}": v for k, v in s.items()}
                stats.update(s)
        tokens = sum(len(s.tokens) for s in samples) * self.algo.epochs
        elapsed = time.perf_counter() - start
        rewards = torch.tensor([s.reward for s in samples])
        return {**stats, "grad_norm": max(grad_norms), "reward_mean": float(rewards.mean()),
                "samples": len(samples), "tokens": tokens, "train_seconds": elapsed,
                "tokens_per_s": tokens / max(elapsed, 1e-9)}

    def save_state(self, path: Path, version: int) -> Path:
        """Optimizer, RNG and version next to the weights (full resume is the trainer issue's)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"version": version, "optimizer": self.optimizer.state_dict(),
                    "rng": torch.get_rng_state()}, path)
        return path

    def save(self, out_dir: Path) -> tuple[Path, str]:
        """Write an HF directory atomically (tmp dir + rename); return (path, checksum)."""
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        self.model.save_pretrained(tmp, safe_serialization=True)
        self.tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        return out_dir, file_checksum(out_dir / "model.safetensors")
