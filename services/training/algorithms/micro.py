"""Micro-batches of a minibatch (``trainer.micro_batch_size``): which rows go together, each one's share of the
minibatch, and the minibatch's stats from theirs.

A minibatch trained in micro-batches runs forward + loss + backward once per micro-batch and accumulates the
gradients into its one optimizer step. Each micro-batch's loss terms are scaled by its share of what the term is a
mean over (``Share``: of the minibatch's loss tokens for a token mean, of its rows for a mean over rows), so the
accumulated gradient is the whole minibatch's. Their stats combine the same way: a mean over tokens weighted by
the micro-batches' loss tokens, over rows by their rows, the TIS statistics (means over the stale rows' loss tokens)
by those; ``_max`` / ``_min`` stats take the largest / smallest, counts and ``loss`` (already a micro-batch's part
of the minibatch's) add up.
"""

from __future__ import annotations

import torch

from services.training.algorithms.base import Algorithm, Share, Stats


def micro_slices(algo: Algorithm, n: int, size: int | None) -> list[slice]:
    """Contiguous slices of a minibatch's ``n`` rows, ``size`` rows each (rounded up to whole groups of
    ``algo.row_group`` rows: DPO's pairs); one slice of every row when ``size`` is unset, 0 or at least ``n``."""
    if not size or size >= n:
        return [slice(0, n)]
    step = -(-size // algo.row_group) * algo.row_group
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def micro_counts(mask: torch.Tensor, stale: torch.Tensor, pieces: list[slice]) -> list[dict[str, float]]:
    """Per micro-batch: its loss tokens, rows and stale rows' loss tokens (``mask`` [B, T], ``stale`` [B])."""
    on = mask > 0
    return [{"tokens": float(on[s].sum()), "rows": float(on[s].shape[0]),
             "stale_tokens": float((on[s] & stale[s].bool().unsqueeze(1)).sum())} for s in pieces]


def shares(counts: list[dict[str, float]]) -> list[Share]:
    """Each micro-batch's share of the minibatch's loss tokens and rows (a minibatch without loss tokens: 0)."""
    tokens, rows = (sum(c[k] for c in counts) for k in ("tokens", "rows"))
    return [Share(tokens=c["tokens"] / max(tokens, 1.0), rows=c["rows"] / max(rows, 1.0)) for c in counts]


def weight_kind(algo: Algorithm, key: str) -> str:
    """Which count a stat is a mean over: tokens, rows or stale_tokens."""
    if key.startswith("tis_"):
        return "stale_tokens"
    if key == "stale_frac" or key in algo.row_stats or (key == "pg_loss" and algo.policy_mean == "rows"):
        return "rows"
    return "tokens"


def combine(algo: Algorithm, parts: list[Stats], counts: list[dict[str, float]]) -> Stats:
    """The minibatch's stats from its micro-batches' (module docstring)."""
    if len(parts) == 1:
        return parts[0]
    out: Stats = {}
    for key in sorted({k for p in parts for k in p}):
        kind = weight_kind(algo, key)
        have = [(p[key], c[kind]) for p, c in zip(parts, counts, strict=True) if key in p]
        if key == "loss" or key in algo.sum_stats:
            out[key] = sum(v for v, _ in have)
            continue
        have = [(v, w) for v, w in have if w > 0] or have  # a micro-batch with none of what it averages over
        vals = [v for v, _ in have]
        total = sum(w for _, w in have)
        if key.endswith("_max"):
            out[key] = max(vals)
        elif key.endswith("_min"):
            out[key] = min(vals)
        else:
            out[key] = sum(v * w for v, w in have) / total if total > 0 else sum(vals) / len(vals)
    return out
