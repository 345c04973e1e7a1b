"""SFT (cross-entropy on generated tokens) and DPO (chosen/rejected pairs from one group).

DPO pairing lives here, in the shared algorithm, not in the buffer: the buffer only
ever releases complete groups (all ``Sample.group_samples`` samples of a group in one batch),
which is all pairing needs, and doing it here gives both backends the same pairs.
Per group: chosen = the highest reward, rejected = the lowest (first by sample id on
ties); a group whose rewards are all equal gives no pair. Rows are ordered chosen,
rejected, chosen, rejected, ...; minibatches never split a pair.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from services.contracts.messages import Sample
from services.training.algorithms.base import Algorithm, LossInputs, Stats, chunks, masked_mean, seq_sum


class SFT(Algorithm):
    """Mean negative log-likelihood of the generated tokens (optionally only of samples with reward >= a floor)."""

    name = "sft"
    uses_tis = False

    def select(self, samples: list[Sample]) -> list[Sample]:
        floor = self.cfg.sft_min_reward
        return [s for s in samples if floor is None or s.reward >= floor]

    def advantages(self, samples: list[Sample]) -> torch.Tensor:
        return torch.zeros(len(samples))

    def policy_loss(self, x: LossInputs) -> tuple[torch.Tensor, Stats]:
        nll = masked_mean(-x.logp, x.mask)
        return nll, {"nll": float(nll.detach())}


def best_worst_pairs(samples: list[Sample]) -> list[tuple[Sample, Sample]]:
    groups: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.group_id].append(s)
    pairs = []
    for gid in sorted(groups):
        members = sorted(groups[gid], key=lambda s: s.id)
        best = max(members, key=lambda s: s.reward)
        worst = min(members, key=lambda s: s.reward)
        if best.reward > worst.reward:
            pairs.append((best, worst))
    return pairs


class DPO(Algorithm):
    """-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), sequence logprobs summed over generated tokens."""

    name = "dpo"
    uses_tis = False
    uses_reference = True
    policy_mean = "rows"  # a mean over pairs, and a micro-batch holds whole pairs
    row_stats = frozenset({"dpo_margin", "dpo_accuracy"})
    sum_stats = frozenset({"dpo_pairs"})
    row_group = 2

    def select(self, samples: list[Sample]) -> list[Sample]:
        return [s for pair in best_worst_pairs(samples) for s in pair]

    def advantages(self, samples: list[Sample]) -> torch.Tensor:
        return torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(samples))])

    def split(self, n: int) -> list[list[int]]:
        return [[2 * p + k for p in part for k in (0, 1)] for part in chunks(n // 2, self.cfg.minibatches)]

    def policy_loss(self, x: LossInputs) -> tuple[torch.Tensor, Stats]:
        if x.ref_logp is None:
            raise ValueError("dpo needs the reference model's logprobs (ref_logp)")
        if x.logp.shape[0] % 2:
            raise ValueError("dpo rows must come in chosen/rejected pairs")
        pi = seq_sum(x.logp, x.mask)
        ref = seq_sum(x.ref_logp.detach(), x.mask)
        margin = self.cfg.dpo_beta * ((pi[0::2] - ref[0::2]) - (pi[1::2] - ref[1::2]))
        loss = -F.logsigmoid(margin).mean()
        with torch.no_grad():
            stats = {"dpo_margin": float(margin.mean()), "dpo_accuracy": float((margin > 0).float().mean()),
                     "dpo_pairs": float(margin.numel())}
        return loss, stats
