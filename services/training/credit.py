"""Per-turn credit (``algorithm.credit: turn``; docs/architecture.md §3, "Per-turn credit").

One reward per episode gives every token of a multi-turn sample the same advantage: a good first guess and a
bad late one are pushed alike. With per-turn credit each generated turn k of a sample gets its own advantage
from its return-to-go G_k (``Sample.turn_rewards`` from turn k on, discounted by ``algorithm.gamma`` per turn;
with gamma 1, G_0 is the sample's reward), against the
samples of its group that also reached a turn k: (G_k - their mean) [/ their std]. A sample without
``turn_rewards`` counts as one turn (all its tokens get G_0's advantage, exactly the episode credit's). A
turn's tokens are ``Sample.spans`` (its ``turns``, or its mask's runs of 1s). The per-token tensor lines up
with ``services.training.step.pad_batch``'s shifted mask (token p at index p - 1).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from services.contracts.messages import Sample


def turn_returns(sample: Sample, gamma: float = 1.0) -> list[float]:
    """G_k for each generated turn k: what the sample earned from that turn on, each later turn's reward
    discounted by ``gamma`` per turn ([reward] without turn rewards)."""
    out, acc = [], 0.0
    for r in reversed(sample.turn_rewards or [sample.reward]):
        acc = r + gamma * acc
        out.append(acc)
    return out[::-1]


def turn_advantages(samples: list[Sample], normalize_std: bool = True, eps: float = 1e-6,
                    gamma: float = 1.0, baselines: list[list[float]] | None = None) -> list[list[float]]:
    """Per sample and turn: (G_k - mean) [/ std] over the group's samples that reached a turn k. With
    ``baselines`` (a learned value V_k of each turn's state, services/training/value.py) the residuals
    G_k - V_k take the returns' place: what is left after the state's value, against the group's."""
    returns = [turn_returns(s, gamma) for s in samples]
    if baselines is not None:
        returns = [[g - v for g, v in zip(gs, vs, strict=True)] for gs, vs in zip(returns, baselines, strict=True)]
    peers: dict[tuple[str, int], list[float]] = defaultdict(list)
    for s, gs in zip(samples, returns, strict=True):
        for k, g in enumerate(gs):
            peers[(s.group_id, k)].append(g)
    out = []
    for s, gs in zip(samples, returns, strict=True):
        row = []
        for k, g in enumerate(gs):
            vals = peers[(s.group_id, k)]
            mean = sum(vals) / len(vals)
            adv = g - mean
            if normalize_std:
                std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) if len(vals) > 1 else 0.0
                adv /= std + eps
            row.append(adv)
        out.append(row)
    return out


def token_advantages(samples: list[Sample], per_turn: list[list[float]]) -> torch.Tensor:
    """[N, longest - 1]: each turn's advantage on its tokens (shifted by one, as the loss mask), 0 elsewhere."""
    out = torch.zeros(len(samples), max(max(len(s.tokens) for s in samples) - 1, 0))
    for i, (s, advs) in enumerate(zip(samples, per_turn, strict=True)):
        spans = s.spans
        if len(advs) == 1:  # no turn rewards: the episode's one advantage on every turn
            advs = advs * len(spans)
        for (start, end), adv in zip(spans, advs, strict=True):
            out[i, max(start, 1) - 1:end - 1] = adv
    return out
