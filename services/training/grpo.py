"""Logits-level helpers shared by the torch code paths: token logprobs, token entropy, group advantages.

(The GRPO loss itself lives in ``services.training.algorithms``; this module keeps its
name because other code imports ``token_logprobs`` and ``group_advantages`` from here.)
"""

from __future__ import annotations

from collections import defaultdict

import torch


def group_advantages(rewards: list[float], group_ids: list[str], normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of its group) [/ std of its group]."""
    by_group: dict[str, list[float]] = defaultdict(list)
    for r, g in zip(rewards, group_ids, strict=True):
        by_group[g].append(r)
    out = []
    for r, g in zip(rewards, group_ids, strict=True):
        vals = torch.tensor(by_group[g], dtype=torch.float64)
        adv = r - vals.mean().item()
        if normalize_std:
            std = vals.std(unbiased=False).item() if len(vals) > 1 else 0.0
            adv = adv / (std + eps)
        out.append(adv)
    return torch.tensor(out, dtype=torch.float32)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature); logits [B, T, V], targets [B, T]."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position; logits [B, T, V] -> [B, T]."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    return -(logp.exp() * logp).sum(-1)
