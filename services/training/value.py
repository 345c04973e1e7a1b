"""A learned value baseline for per-turn credit (``algorithm.baseline: value``; docs/architecture.md §7,
"Per-turn credit").

Under ``credit: turn`` a turn's return-to-go G_k is measured against the group's samples at the same turn. In
a game against a random player those samples are in different positions by then, so the group's mean says
little about the position this turn faced. ``ValueBaseline`` learns V(s), what a turn's state is worth against
its group: the centred return G_k - mean_k (the group's mean at turn k; the group fixes the opponent, which a
value learnt over a mix of opponents could not know) to expect from the state. It is a small MLP on the
policy's last hidden state at the token before the turn's first generated token (the state the turn was
sampled from), **detached**, so the value's loss never moves the policy. Each step:

1. the states' values under the head as it is (before it sees this batch's returns) give the residuals
   G_k - V(s_k), which go through the group-at-the-same-turn centring (and std) in place of the returns
   (``credit.turn_advantages(baselines=...)``): the advantage is (G_k - mean_k) - (V(s_k) - the group's mean
   value at turn k), what the turn earned beyond what its position promised;
2. the head fits this batch's (state, centred return) pairs: ``epochs x minibatches`` AdamW steps on the mean
   squared error, its own optimizer and clipping, apart from the policy's.

Reported per step: ``value_loss`` (the head's squared error on the batch before fitting it: on returns it has
not seen), ``value_explained_var`` (1 - Var(target - V) / Var(target): the share of the centred returns' spread
the states explain) and ``value_fit_loss``. Its weights and optimizer go into the trainer state (resume) and not
into the weights the engines load.
"""

from __future__ import annotations

from typing import Any

import torch

from services.contracts.config import AlgorithmConfig
from services.contracts.messages import Sample, turn_spans
from services.training.algorithms import Algorithm, Stats, StepPlan
from services.training.credit import turn_advantages


def state_positions(sample: Sample) -> list[int]:
    """Per credited turn, the position whose hidden state is the turn's state: the token before its first
    generated token (one turn, the first, for a sample without turn rewards)."""
    spans = turn_spans(sample.loss_mask)
    return [max(start, 1) - 1 for start, _ in spans[:max(len(sample.turn_rewards), 1)]]


class ValueBaseline:
    """The value head, its optimizer, and the step's re-baselining (module docstring)."""

    def __init__(self, hidden_size: int, cfg: AlgorithmConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.head = torch.nn.Sequential(torch.nn.Linear(hidden_size, cfg.value_hidden), torch.nn.Tanh(),
                                        torch.nn.Linear(cfg.value_hidden, 1)).to(device)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=cfg.value_lr)

    def gather(self, plan: StepPlan, rows: list[list[int]], features: list[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, dict[int, tuple[int, int]]]:
        """The turn states' features [M, H] and centred returns [M] (G_k less the group's mean at turn k) of every
        planned row, and where each row's turns are in them (row -> [first, end))."""
        centred = turn_advantages(plan.samples, normalize_std=False, gamma=self.cfg.gamma)
        feats, targets, where = [], [], {}
        for batch_rows, batch_features in zip(rows, features, strict=True):
            for j, i in enumerate(batch_rows):
                sample = plan.samples[i]
                pos = state_positions(sample)
                start = sum(len(t) for t in targets)
                feats.append(batch_features[j, pos].float())
                targets.append(torch.tensor(centred[i][:len(pos)]))
                where[i] = (start, start + len(pos))
        return torch.cat(feats).detach(), torch.cat(targets).float().to(feats[0].device), where

    def rebaseline(self, algo: Algorithm, plan: StepPlan, rows: list[list[int]],
                   features: list[torch.Tensor]) -> Stats:
        """Set ``plan.token_advantages`` from the residuals against the head's values, then fit the head to the
        batch's returns; ``features[k]`` is minibatch ``rows[k]``'s last hidden state [B, T, H]."""
        if not plan.samples:
            return {}
        x, g, where = self.gather(plan, rows, features)
        with torch.no_grad():
            v = self.head(x).squeeze(-1)
        baselines = [v[where[i][0]:where[i][1]].tolist() for i in range(len(plan.samples))]
        plan.token_advantages = algo.per_token_advantages(plan.samples, baselines)
        var = float(g.var(unbiased=False)) if g.numel() > 1 else 0.0
        stats = {"value_loss": float(((v - g) ** 2).mean()), "value_mean": float(v.mean()),
                 "value_explained_var": 1.0 - float((g - v).var(unbiased=False)) / var if var > 0 else 0.0}
        stats["value_fit_loss"] = self.fit(x, g)
        return stats

    def fit(self, x: torch.Tensor, g: torch.Tensor) -> float:
        """``epochs x minibatches`` AdamW steps of the head on the squared error; the last step's loss."""
        loss = torch.zeros(())
        for _ in range(self.cfg.epochs * self.cfg.minibatches):
            self.optimizer.zero_grad(set_to_none=True)
            loss = ((self.head(x).squeeze(-1) - g) ** 2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.max_grad_norm)
            self.optimizer.step()
        return float(loss.detach())

    def state_dict(self) -> dict[str, Any]:
        return {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
