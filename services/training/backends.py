"""The trainer backend contract (``Policy``) and the pick of the agent's backend from its config.

Both backends (``TorchPolicy``, ``MegatronPolicy``) run the one training step of
``services.training.step`` and implement this protocol; the trainer service uses nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from services.common.extras import require
from services.contracts.config import AgentConfig
from services.contracts.messages import Sample


@runtime_checkable
class Policy(Protocol):
    """What the trainer service needs of a backend."""

    weight_version: int
    """The weight version its weights are: 0 at start, set by ``load_state``, +1 per ``train_step``
    (TIS compares samples against it)."""
    follower: bool
    """True on a rank that does not run the service (megatron under torchrun, rank > 0): it calls ``follow``."""

    def train_step(self, samples: list[Sample]) -> dict[str, Any]:
        """One step with the agent's algorithm; returns the step's metrics (flat, JSON-able: loss terms, kl,
        entropy, clip_frac, grad_norm, TIS statistics, tokens_per_s ...), published as the ``train_step`` event."""
        ...

    def save(self, out_dir: Path) -> tuple[Path, str]:
        """Write an HF directory the engines load, atomically; return (path, checksum)."""
        ...

    def save_state(self, path: Path, version: int) -> Path:
        """Everything resume needs (weights, optimizer, scheduler, RNG, version) in ``path``, atomically."""
        ...

    def load_state(self, path: Path) -> int:
        """Restore what ``save_state`` wrote; return the version."""
        ...

    def follow(self) -> None:
        """A follower rank: run what the leading rank runs, until it calls ``close``."""
        ...

    def close(self) -> None:
        """Release what the backend holds (the megatron follower ranks)."""
        ...


def make_policy(acfg: AgentConfig, temperature: float) -> Policy:
    if acfg.backend == "megatron":
        require("megatron", "backend: megatron")
        from services.training.megatron import MegatronPolicy  # heavy; only when asked for

        return MegatronPolicy(acfg, temperature)
    from services.training.torch_backend import TorchPolicy

    return TorchPolicy(acfg, temperature)
