"""Who plays with which weights: the agents' tokenizers and context windows, and each agent's versions.

An agent's pool of past versions grows as its engines load them (version 0 is the start model); a
``Pool`` player becomes one of its agent's last ``pool_size`` versions, drawn per group with the
run's seed; ``version_paths`` maps each version to its weights directory (the checkpoint an
every-n-steps evaluation plays). A ``Local`` player (a pool version, fixed weights) is run
in-process (services/play/local.py), its tokenizer read the first time it plays.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from services.common.tokens import context_length, load_tokenizer
from services.contracts.config import TandemConfig
from services.contracts.messages import SamplingParams
from services.contracts.players import AgentPlayer, Local, Player, Pool, Scripted
from services.play.local import LocalPlayers  # torch is imported when a Local player first plays


class Players:
    def __init__(self, cfg: TandemConfig) -> None:
        self.cfg = cfg
        self.tokenizers: dict[str, Any] = {a: load_tokenizer(c.model_path) for a, c in cfg.agents.items()}
        self.context: dict[str, int] = {a: context_length(c.model_path) for a, c in cfg.agents.items()}
        self.local = LocalPlayers()
        # opponent pool: each agent's weight versions as they load (version 0 is the start model)
        self.pool_paths: dict[str, list[str]] = {a: [c.model_path] for a, c in cfg.agents.items()}
        self.version_paths: dict[str, dict[int, str]] = {a: {0: c.model_path} for a, c in cfg.agents.items()}
        self.pool_rng = random.Random(cfg.run.seed)

    def add_version(self, agent: str, version: int, path: str) -> None:
        """A version the agent's engines loaded (read from its owner's record): into its pool."""
        if agent in self.pool_paths:
            self.version_paths[agent][version] = path
            self.pool_paths[agent] += [] if path in self.pool_paths[agent] else [path]

    def restore(self, agent: str, pool: list[str], versions: dict[int, str]) -> None:
        """The agent's pool and version paths as the run record holds them (a restart)."""
        self.pool_paths[agent] += [p for p in pool if p not in self.pool_paths[agent]]
        self.version_paths[agent].update(versions)

    def resolve_pool(self, roles: dict[str, Player]) -> dict[str, Player]:
        """A ``Pool`` player becomes one of its agent's last ``pool_size`` versions, drawn per group."""
        out: dict[str, Player] = {}
        for role, player in roles.items():
            if isinstance(player, Pool):
                recent = self.pool_paths[player.agent][-self.cfg.environment.pool_size:]
                player = Local(path=self.pool_rng.choice(recent), agent=player.agent)
            out[role] = player
        return out

    def sampling_for(self, roles: dict[str, Player]) -> dict[Player, SamplingParams]:
        """Sampling per model player; an in-process past version samples like the agent it came from."""
        return {p: self.cfg.agents[p.agent].sampling for p in roles.values() if not isinstance(p, Scripted | Pool)}

    async def tokenizers_for(self, roles: dict[str, Player]) -> tuple[dict[Player, Any], dict[Player, int]]:
        """Each model player's tokenizer and context window (a pool version seen first: read off the loop)."""
        tokenizers: dict[Player, Any] = {}
        context: dict[Player, int] = {}
        for p in set(roles.values()):
            if isinstance(p, AgentPlayer):
                tokenizers[p], context[p] = self.tokenizers[p.agent], self.context[p.agent]
            elif isinstance(p, Local):
                tokenizers[p] = await asyncio.to_thread(self.local.tokenizer, p.path)
                context[p] = await asyncio.to_thread(self.local.context_length, p.path)
        return tokenizers, context

    def tokenizer_for(self, player: Player) -> Any:
        """The tokenizer a player's tokens are in (blocking: call it off the loop), or None (scripted)."""
        if isinstance(player, Local):
            return self.local.tokenizer(player.path)
        return None if isinstance(player, Scripted) else self.tokenizers.get(player.agent)
