"""A learned value baseline for per-turn credit (``algorithm.baseline: value``; docs/architecture.md §3,
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

The backend hands the head a ``features(batch, positions)`` function that returns only those positions'
hidden states (the torch backend's one extra no-grad forward per minibatch); a backend without one has no
value baseline (the config refuses it). A non-finite value, fit or head fails the step like a non-finite loss
(``NonFiniteStep``: the trainer restores its last committed state, the head's included).

Reported per step: ``value_loss`` (the head's squared error on the batch before fitting it: on returns it has
not seen), ``value_explained_var`` (1 - Var(target - V) / Var(target): the share of the centred returns' spread
the states explain) and ``value_fit_loss``. Its weights and optimizer go into the trainer state (resume) and not
into the weights the engines load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from services.contracts.config import AlgorithmConfig
from services.contracts.messages import Sample
from services.training.algorithms import Algorithm, Stats, StepPlan
from services.training.credit import turn_advantages


def state_positions(sample: Sample) -> list[int]:
    """Per credited turn, the position whose hidden state is the turn's state: the token before its first
    generated token (one turn, the first, for a sample without turn rewards)."""
    spans = sample.spans
    return [max(start, 1) - 1 for start, _ in spans[:max(len(sample.turn_rewards), 1)]]


# the backend's no-grad last hidden states [M, H] of a padded batch at each row's positions, rows in order
Features = Callable[[dict[str, torch.Tensor], list[list[int]]], torch.Tensor]


class ValueBaseline:
    """The value head, its optimizer, and the step's re-baselining (module docstring)."""

    def __init__(self, hidden_size: int, cfg: AlgorithmConfig, device: torch.device, features: Features) -> None:
        self.cfg, self.hidden_size, self.device, self.features = cfg, hidden_size, device, features
        self.reset()

    def reset(self) -> None:
        """A fresh head and optimizer, initialised on a forked RNG: the policy's random stream is not touched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.head = torch.nn.Sequential(torch.nn.Linear(self.hidden_size, self.cfg.value_hidden), torch.nn.Tanh(),
                                            torch.nn.Linear(self.cfg.value_hidden, 1)).to(self.device)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=self.cfg.value_lr)

    def targets(self, plan: StepPlan, rows: list[list[int]], positions: list[list[list[int]]]
                ) -> tuple[torch.Tensor, dict[int, tuple[int, int]]]:
        """The centred returns [M] (G_k less the group's mean at turn k) of the rows' turn states, in the order
        the features come, and where each row's turns are in them (row -> [first, end))."""
        centred = turn_advantages(plan.samples, normalize_std=False, gamma=self.cfg.gamma)
        targets: list[float] = []
        where: dict[int, tuple[int, int]] = {}
        for batch_rows, batch_positions in zip(rows, positions, strict=True):
            for i, pos in zip(batch_rows, batch_positions, strict=True):
                where[i] = (len(targets), len(targets) + len(pos))
                targets += centred[i][:len(pos)]
        if len(where) != len(plan.samples):  # a data-parallel rank sees part of the rows: not supported
            raise ValueError("the value baseline needs every row of the step on this process")
        return torch.tensor(targets, dtype=torch.float32, device=self.device), where

    def rebaseline(self, algo: Algorithm, plan: StepPlan, rows: list[list[int]],
                   batches: list[dict[str, torch.Tensor]]) -> Stats:
        """Set ``plan.token_advantages`` from the residuals against the head's values, then fit the head to the
        batch's centred returns; ``batches[k]`` is minibatch ``rows[k]`` padded. A non-finite value shows as a
        non-finite ``value_loss``, a diverged fit as ``value_fit_loss``: the caller fails the step on either."""
        if not plan.samples:
            return {}
        positions = [[state_positions(plan.samples[i]) for i in batch_rows] for batch_rows in rows]
        g, where = self.targets(plan, rows, positions)
        x = torch.cat([self.features(b, p) for b, p in zip(batches, positions, strict=True)]).detach().float()
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

    def finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.head.parameters())

    def state_dict(self) -> dict[str, Any]:
        return {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore the head (None: the trainer state holds no head, so a fresh one)."""
        if state is None:
            self.reset()
            return
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
