"""The learning signal in a training batch: the share of its groups whose rewards are all equal (zero variance:
every advantage is 0 under a group baseline, so they teach nothing) and the share of its samples in which the
agent's reply was illegal or malformed. The trainer adds both to each step's metrics; the coordinator warns on,
and stops after, steps with no signal (services/coordinator/learning_signal.py)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from services.contracts.messages import Sample


def learning_signal(samples: Sequence[Sample]) -> dict[str, float]:
    """``zero_variance_groups`` (share of the batch's groups, by ``group_id``, whose samples' rewards are all
    equal) and ``malformed_rate`` (share of samples with an illegal or malformed reply); empty for no samples."""
    if not samples:
        return {}
    rewards: dict[str, set[float]] = defaultdict(set)
    for s in samples:
        rewards[s.group_id].add(s.reward)
    flat = sum(1 for r in rewards.values() if len(r) == 1)
    return {"zero_variance_groups": flat / len(rewards),
            "malformed_rate": sum(1 for s in samples if s.malformed_turns) / len(samples)}
