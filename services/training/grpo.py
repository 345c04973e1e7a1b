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


# Past this many logits a pass is cut into chunks of rows instead of keeping float32 copies of the whole: a
# 151,936-token vocabulary makes the full-batch float32 log-softmax and entropy tens of GB (docs/results/gpu.md, "On one
# GPU"). Token logprobs write their gradient chunk by chunk (``_ChunkedLogprobs``); an entropy with a gradient
# recomputes each chunk in the backward pass. Each row is computed exactly as without chunks.
CHUNK_LOGITS = 2**25


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits.float() / (temperature if temperature > 0 else 1.0)


def _logp_rows(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(_scaled(logits, temperature), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _entropy_rows(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _keys(shape: torch.Size, chunk_logits: int) -> list[tuple[int, slice]]:
    """Index keys of [B, T, V] logits, each at most ``chunk_logits`` logits of one batch row: views, no copies
    (a reshape of the trainers' shifted logits, ``logits[:, :-1]``, would copy them whole)."""
    step = max(1, chunk_logits // shape[-1])
    return [(b, slice(i, i + step)) for b in range(shape[0]) for i in range(0, shape[1], step)]


def _by_chunks(fn: Any, logits: torch.Tensor, *rest: Any, chunk_logits: int = CHUNK_LOGITS) -> torch.Tensor:
    """``fn`` over [B, T, V] logits, in chunks of at most ``chunk_logits`` logits when there are more. Without a
    gradient each chunk is a view; with one, the rows are split and each chunk recomputed in the backward pass."""
    vocab = logits.shape[-1]
    if logits.numel() <= chunk_logits:
        return fn(logits, *rest)
    if not (torch.is_grad_enabled() and logits.requires_grad) and logits.dim() == 3:
        out = torch.empty(logits.shape[:-1], device=logits.device)
        for key in _keys(logits.shape, chunk_logits):
            out[key] = fn(logits[key], *(r[key] if isinstance(r, torch.Tensor) else r for r in rest))
        return out
    step = max(1, chunk_logits // vocab)
    # split (not slicing): its backward writes every chunk's gradient into one tensor, not one zero-filled
    # full-size tensor per chunk
    chunks = logits.reshape(-1, vocab).split(step)
    extra = [r.reshape(-1).split(step) if isinstance(r, torch.Tensor) else [r] * len(chunks) for r in rest]
    parts = [checkpoint(fn, *args, use_reentrant=False) for args in zip(chunks, *extra, strict=True)]
    return torch.cat(parts).view(logits.shape[:-1])


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(target) chunk by chunk, and its gradient (one-hot minus softmax, over the temperature) written chunk
    by chunk into one tensor: nothing of the vocabulary's size is kept between the passes but the logits."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk_logits: int) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.chunk_logits = temperature, chunk_logits
        out = torch.empty(targets.shape, device=logits.device)
        for key in _keys(logits.shape, chunk_logits):
            out[key] = _logp_rows(logits[key], targets[key], temperature)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, targets = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        t = ctx.temperature if ctx.temperature > 0 else 1.0
        for key in _keys(logits.shape, ctx.chunk_logits):
            d = torch.softmax(_scaled(logits[key], ctx.temperature), dim=-1).neg_()
            tg = targets[key].unsqueeze(-1)
            d.scatter_add_(-1, tg, torch.ones_like(tg, dtype=d.dtype))
            grad[key] = d.mul_((grad_out[key] / t).unsqueeze(-1))
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                   chunk_logits: int = CHUNK_LOGITS) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature); logits [B, T, V], targets [B, T]."""
    if logits.numel() <= chunk_logits:
        return _logp_rows(logits, targets, temperature)
    if logits.dim() != 3:
        return token_logprobs(logits.reshape(-1, *logits.shape[-2:]), targets.reshape(-1, targets.shape[-1]),
                              temperature, chunk_logits).view(targets.shape)
    return _ChunkedLogprobs.apply(logits, targets, temperature, chunk_logits)


def token_entropy(logits: torch.Tensor, temperature: float, chunk_logits: int = CHUNK_LOGITS) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position; logits [B, T, V] -> [B, T]."""
    return _by_chunks(_entropy_rows, logits, temperature, chunk_logits=chunk_logits)
