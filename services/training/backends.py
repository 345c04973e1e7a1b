"""Pick the agent's training backend from its config.

Every backend is a class ``Policy(acfg: AgentConfig, temperature: float)`` with:

* ``version: int`` — the weight version its weights are (0 at start, set by
  ``load_state``, +1 per ``train_step``; TIS compares samples against it);
* ``train_step(samples: list[Sample]) -> dict`` — one step with the algorithm from
  ``services.training.algorithms`` (see the contract there); returns the step's
  metrics (flat, JSON-able: loss terms, kl, entropy, clip_frac, grad_norm, TIS
  statistics, tokens_per_s ...), published as the ``train_step`` event;
* ``save(out_dir: Path) -> (Path, checksum)`` — an HF directory the engines load,
  written atomically;
* ``save_state(path: Path, version: int) -> Path`` — everything resume needs
  (weights, optimizer, scheduler, RNG, version) in the directory ``path``, atomically;
* ``load_state(path: Path) -> int`` — restore it; returns the version.
"""

from __future__ import annotations

from typing import Any

from services.contracts.config import AgentConfig


def make_policy(acfg: AgentConfig, temperature: float) -> Any:
    if acfg.backend == "megatron":
        from services.training.megatron import MegatronPolicy  # heavy; only when asked for

        return MegatronPolicy(acfg, temperature)
    from services.training.torch_backend import TorchPolicy

    return TorchPolicy(acfg, temperature)
