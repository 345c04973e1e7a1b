"""Policy-gradient algorithms: GRPO, Dr.GRPO, PPO (dual clip), REINFORCE++ (±baseline), GSPO, CISPO.

Tandem has no value model, so every advantage here is one number per sample
(outcome reward) broadcast over that sample's generated tokens; they differ in how
that number is baselined/normalised and how the ratio is clipped and aggregated.
``ratio = exp(logp - old_logp)``; ``old_logp`` is the rollout logprob (or the TIS
proximal logprob for stale rows, see ``base.make_inputs``).
"""

from __future__ import annotations

import torch

from services.contracts.messages import Sample
from services.training.algorithms.base import Algorithm, LossInputs, Stats, masked_mean, seq_sum
from services.training.credit import token_advantages, turn_advantages
from services.training.grpo import group_advantages


def clip_stats(ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Stats:
    with torch.no_grad():
        out = ((ratio < 1 - low) | (ratio > 1 + high)).float()
        return {"clip_frac": float(masked_mean(out, mask)), "ratio_mean": float(masked_mean(ratio, mask)),
                "ratio_max": float((ratio * mask).max()) if mask.any() else 1.0}


def token_adv(x: LossInputs) -> torch.Tensor:
    """The advantage of each token: the row's [B] broadcast, or per token [B, T] (algorithm.credit: turn)."""
    return x.advantages if x.advantages.dim() == 2 else x.advantages.unsqueeze(1)


def ppo_token_losses(x: LossInputs, low: float, high: float, dual_c: float | None = None
                     ) -> tuple[torch.Tensor, Stats]:
    """Per-token PPO-clip loss max(-A r, -A clip(r)) [dual clip: min(., -c A) where A < 0], times the TIS weight."""
    ratio = torch.exp(x.logp - x.old_logp)
    adv = token_adv(x)
    per_tok = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
    stats = clip_stats(ratio, x.mask, low, high)
    if dual_c is not None:
        capped = torch.minimum(per_tok, -dual_c * adv)
        with torch.no_grad():
            hit = ((adv < 0) & (capped < per_tok)).float()
            stats["dual_clip_frac"] = float(masked_mean(hit, x.mask))
        per_tok = torch.where(adv < 0, capped, per_tok)
    return per_tok * x.tis_weight, stats


class GRPO(Algorithm):
    """Group mean/std advantages; token-mean PPO-clip loss over the batch's generated tokens."""

    name = "grpo"
    turn_credit = True

    def policy_loss(self, x: LossInputs) -> tuple[torch.Tensor, Stats]:
        per_tok, stats = ppo_token_losses(x, self.cfg.clip_eps_low, self.cfg.clip_eps_high)
        return masked_mean(per_tok, x.mask), stats


class DrGRPO(Algorithm):
    """Dr.GRPO: advantage r - group mean (no std); loss = token SUM / (rows x L), L constant (no length norm)."""

    name = "dr_grpo"
    turn_credit = True
    policy_mean = "rows"

    def advantages(self, samples: list[Sample]) -> torch.Tensor:
        return group_advantages([s.reward for s in samples], [s.group_id for s in samples], normalize_std=False)

    def per_token_advantages(self, samples: list[Sample], baselines: list[list[float]] | None = None) -> torch.Tensor:
        return token_advantages(samples, turn_advantages(samples, normalize_std=False, gamma=self.cfg.gamma,
                                                         baselines=baselines))

    def policy_loss(self, x: LossInputs) -> tuple[torch.Tensor, Stats]:
        per_tok, stats = ppo_token_losses(x, self.cfg.clip_eps_low, self.cfg.clip_eps_high)
        norm = self.cfg.norm_tokens or x.mask.shape[1]
        return (per_tok * x.mask).sum() / (x.mask.shape[0] * norm), stats


class PPO(Algorithm):
    """PPO-clip with dual clip (bound ``dual_clip_c`` on negative advantages); group-baselined advantages."""

    name = "ppo"
    turn_credit = True

    def policy_loss(self, x: LossInputs) -> tuple[torch.Tensor, Stats]:
        per_tok, stats = ppo_token_losses(x, self.cfg.clip_eps_low, self.cfg.clip_eps_high, self.cfg.dual_clip_c)
        return masked_mean(per_tok, x.mask), stats


def batch_normalize(adv: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    if adv.numel() < 2:
        return adv - adv.mean()
    return (adv - adv.mean()) / (adv.std(unbiased=False) + eps)


class ReinforcePP(Algorithm):
    """REINFORCE++ without baseline: reward z-scored over the whole batch (not per group); PPO-clip loss."""

    name = "reinforce_pp"

    def advantages(self, samples: list[Sample]) -> torch.Tensor:
        return batch_normalize(torch.tensor([s.reward for s in samples], dtype=torch.float32))

    def policy_loss(self, x: LossInputs) -> tuple[torch.Tensor, Stats]:
        per_tok, stats = ppo_token_losses(x, self.cfg.clip_eps_low, self.cfg.clip_eps_high)
        return masked_mean(per_tok, x.mask), stats


class ReinforcePPBaseline(ReinforcePP):
    """REINFORCE++-baseline: subtract the group mean, then normalise by the batch's std."""

    name = "reinforce_pp_baseline"

    def advantages(self, samples: list[Sample]) -> torch.Tensor:
        centred = group_advantages([s.reward for s in samples], [s.group_id for s in samples], normalize_std=False)
        return batch_normalize(centred)


class GSPO(Algorithm):
    """GSPO: sequence-level ratio s = exp(mean over the row's tokens of (logp - old)), clipped per sequence.

    Loss = mean over rows of max(-A s, -A clip(s)) x the row's mean TIS weight.
    (Use small clip_eps_low/high, e.g. 3e-4 / 4e-4, as the paper does.)
    """

    name = "gspo"
    policy_mean = "rows"
    row_stats = frozenset({"clip_frac", "ratio_mean"})

    def policy_loss(self, x: LossInputs) -> tuple[torch.Tensor, Stats]:
        lengths = x.mask.sum(-1).clamp(min=1.0)
        seq_ratio = torch.exp(seq_sum(x.logp - x.old_logp, x.mask) / lengths)
        low, high = self.cfg.clip_eps_low, self.cfg.clip_eps_high
        per_seq = torch.maximum(-x.advantages * seq_ratio, -x.advantages * torch.clamp(seq_ratio, 1 - low, 1 + high))
        weight = seq_sum(x.tis_weight, x.mask) / lengths
        with torch.no_grad():
            clipped = ((seq_ratio < 1 - low) | (seq_ratio > 1 + high)).float()
            stats = {"clip_frac": float(clipped.mean()), "ratio_mean": float(seq_ratio.mean()),
                     "ratio_max": float(seq_ratio.max())}
        return (per_seq * weight).mean(), stats


class CISPO(Algorithm):
    """CISPO: -sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp, token mean; every token keeps its gradient."""

    name = "cispo"
    turn_credit = True

    def policy_loss(self, x: LossInputs) -> tuple[torch.Tensor, Stats]:
        ratio = torch.exp(x.logp - x.old_logp)
        low, high = self.cfg.clip_eps_low, self.cfg.clip_eps_high
        weight = torch.clamp(ratio, 1 - low, 1 + high).detach()
        per_tok = -weight * token_adv(x) * x.logp * x.tis_weight
        return masked_mean(per_tok, x.mask), clip_stats(ratio, x.mask, low, high)
