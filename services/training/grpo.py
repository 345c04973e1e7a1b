"""Logits-level helpers shared by the torch code paths: token logprobs, token entropy (chunked over rows for
large vocabularies), group advantages.

(The GRPO loss itself lives in ``services.training.algorithms``; this module keeps its
name because other code imports ``token_logprobs`` and ``group_advantages`` from here.)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


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


# Past this many logits a pass is cut into row chunks, each recomputed in the backward pass (activation
# checkpointing) instead of keeping its float32 copies: a 151,936-token vocabulary makes the full-batch float32
# log-softmax and entropy tens of GB (README, "On one GPU"). Each row is computed exactly as without chunks.
CHUNK_LOGITS = 2**25


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits.float() / (temperature if temperature > 0 else 1.0)


def _logp_rows(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(_scaled(logits, temperature), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _entropy_rows(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _by_chunks(fn: Any, logits: torch.Tensor, *rest: Any, chunk_logits: int = CHUNK_LOGITS) -> torch.Tensor:
    """``fn`` over [B, T, V] logits, in row chunks of at most ``chunk_logits`` logits when there are more."""
    vocab = logits.shape[-1]
    if logits.numel() <= chunk_logits:
        return fn(logits, *rest)
    step = max(1, chunk_logits // vocab)
    # split (not slicing): its backward writes every chunk's gradient into one tensor, not one zero-filled
    # full-size tensor per chunk
    chunks = logits.reshape(-1, vocab).split(step)
    extra = [r.reshape(-1).split(step) if isinstance(r, torch.Tensor) else [r] * len(chunks) for r in rest]
    grad = torch.is_grad_enabled() and logits.requires_grad
    parts = [checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)
             for args in zip(chunks, *extra, strict=True)]
    return torch.cat(parts).view(logits.shape[:-1])


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(target) chunk by chunk, and its gradient (one-hot minus softmax, over the temperature) written chunk
    by chunk into one tensor: nothing of the vocabulary's size is kept between the passes but the logits."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, targets: torch.Tensor, temperature: float, step: int) -> torch.Tensor:
        ctx.save_for_backward(flat, targets)
        ctx.temperature, ctx.step = temperature, step
        return torch.cat([_logp_rows(x, t, temperature) for x, t in zip(flat.split(step), targets.split(step),
                                                                          strict=True)])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        flat, targets = ctx.saved_tensors
        grad = torch.empty_like(flat)
        t = ctx.temperature if ctx.temperature > 0 else 1.0
        for x, tg, g, out in zip(flat.split(ctx.step), targets.split(ctx.step), grad_out.split(ctx.step),
                                 grad.split(ctx.step), strict=True):
            d = torch.softmax(_scaled(x, ctx.temperature), dim=-1).neg_()
            d.scatter_add_(-1, tg.unsqueeze(-1), torch.ones_like(tg, dtype=d.dtype).unsqueeze(-1))
            out.copy_(d.mul_((g / t).unsqueeze(-1)))
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                   chunk_logits: int = CHUNK_LOGITS) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature); logits [B, T, V], targets [B, T]."""
    vocab = logits.shape[-1]
    if logits.numel() <= chunk_logits:
        return _logp_rows(logits, targets, temperature)
    step = max(1, chunk_logits // vocab)
    flat = _ChunkedLogprobs.apply(logits.reshape(-1, vocab), targets.reshape(-1), temperature, step)
    return flat.view(targets.shape)


def token_entropy(logits: torch.Tensor, temperature: float, chunk_logits: int = CHUNK_LOGITS) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position; logits [B, T, V] -> [B, T]."""
    return _by_chunks(_entropy_rows, logits, temperature, chunk_logits=chunk_logits)
