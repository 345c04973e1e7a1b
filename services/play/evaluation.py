"""Held-out evaluation: one player against the environment's scripted opponent, seeded.

Used by the coordinator (at the start and end of a run), by ``tandem eval`` and by the demo's
warm-start and RL sweep. Episode i draws from seed ``7_000_000 + 1000 i``, so the same episodes,
opponent moves and sampling draws come back every time. The player takes, in turn, each role it
is evaluated in; roles the config gives a scripted player keep it (a rule-based judge); the
others are played by the opponent. An episode is a win when the player's reward beats the best
other role's (or is positive in a one-role environment), a draw when equal (zero), else a loss.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

from services.contracts.config import EnvironmentConfig
from services.contracts.messages import SamplingParams
from services.contracts.players import AgentPlayer, Player, Scripted
from services.envs.base import Environment, score_for
from services.play.episode import EpisodeResult

EVAL_SEED = 7_000_000
Play = Callable[[Environment, str, dict[str, Player], dict[Player, SamplingParams], random.Random],
                Awaitable[EpisodeResult | None]]


def eval_roles(env_cfg: EnvironmentConfig, env_cls: type[Environment], agent: str) -> list[str]:
    """The roles ``agent`` is evaluated in: those it plays in the config (all when roles alternate)."""
    mine = [r for r in env_cls.roles if env_cfg.roles.get(r) == AgentPlayer(agent=agent)]
    free = [r for r in env_cls.roles if not isinstance(env_cfg.roles.get(r), Scripted)]
    return free if env_cfg.alternate_roles or not mine else mine


def outcome(rewards: dict[str, float], role: str) -> str:
    mine = rewards.get(role, 0.0)
    others = [v for r, v in rewards.items() if r != role]
    ref = max(others) if others else 0.0
    return "win" if mine > ref else "draw" if mine == ref else "loss"


def opponents_for(env_cls: type[Environment], env_cfg: EnvironmentConfig, opponent: str | dict[str, str],
                  ) -> dict[str, Scripted]:
    """Role -> the scripted player that plays it when it is not the evaluated player's."""
    fixed = env_cfg.scripted()  # e.g. a rule-based judge keeps its player
    return {r: fixed.get(r) or Scripted(name=opponent.get(r, "") if isinstance(opponent, dict) else opponent)
            for r in env_cls.roles if r in fixed or (opponent.get(r) if isinstance(opponent, dict) else opponent)}


async def play_eval(env_cls: type[Environment], env_cfg: EnvironmentConfig, player: Player, roles: list[str],
                    opponent: str | dict[str, str], episodes: int, base: SamplingParams, temperature: float,
                    play: Play) -> list[tuple[str, EpisodeResult]]:
    """Play ``episodes`` seeded episodes at once; return (the player's role, result) of those that finished."""
    others = opponents_for(env_cls, env_cfg, opponent)
    jobs = []
    for i in range(episodes):
        seed = EVAL_SEED + 1000 * i
        sampling = {player: base.model_copy(update={"temperature": temperature, "seed": seed})}
        mine = roles[i % len(roles)]
        mapping: dict[str, Player] = {r: (player if r == mine else others[r]) for r in env_cls.roles}
        jobs.append((mine, play(env_cls(env_cfg.params, seed), f"eval-{i}", mapping, sampling, random.Random(seed))))
    results = await asyncio.gather(*(j for _, j in jobs))
    return [(mine, r) for (mine, _), r in zip(jobs, results, strict=True) if r is not None]


def score(results: list[tuple[str, EpisodeResult]], roles: list[str], opponent: str | dict[str, str],
          ) -> dict[str, Any]:
    """Score (0-1), wins/draws/losses, mean reward and per-role scores of ``play_eval``'s results."""
    counts = {"win": 0, "draw": 0, "loss": 0}
    per_role: dict[str, list[float]] = {r: [] for r in roles}
    rewards: list[float] = []
    for mine, r in results:
        counts[outcome(r.rewards, mine)] += 1
        per_role[mine].append(score_for(r.rewards, mine))
        rewards.append(r.rewards.get(mine, 0.0))
    scores = [x for xs in per_role.values() for x in xs]
    return {"score": sum(scores) / len(scores) if scores else None, "episodes": len(scores), "opponent": opponent,
            "wins": counts["win"], "draws": counts["draw"], "losses": counts["loss"],
            "mean_reward": sum(rewards) / max(len(rewards), 1),
            "per_role": {r: (sum(xs) / len(xs) if xs else None) for r, xs in per_role.items()}}


async def evaluate_player(env_cls: type[Environment], env_cfg: EnvironmentConfig, player: Player,
                          roles: list[str], opponent: str | dict[str, str], episodes: int, base: SamplingParams,
                          temperature: float, play: Play) -> dict[str, Any]:
    """Play ``episodes`` seeded episodes; return score (0-1), wins/draws/losses and per-role scores."""
    results = await play_eval(env_cls, env_cfg, player, roles, opponent, episodes, base, temperature, play)
    return score(results, roles, opponent)
