"""Held-out evaluation: one player against the environment's scripted opponent, seeded.

Used by the coordinator (at the start and end of a run) and by ``tandem eval``.
Episode i draws from seed ``7_000_000 + 1000 i``, so the same episodes,
opponent moves and sampling draws come back every time. The player takes, in
turn, each role it is evaluated in; roles the config gives a scripted player
keep it (a rule-based judge); the others are played by the opponent.
An episode is a win when the player's reward beats the best other role's
(or is positive in a one-role environment), a draw when equal (zero), else a loss.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

from services.contracts.config import EnvironmentConfig
from services.contracts.messages import SamplingParams
from services.envs.base import Environment, score_for

SCRIPTED = "scripted:"
Play = Callable[[Environment, str, dict[str, str], dict[str, SamplingParams], random.Random], Awaitable[Any]]


def eval_roles(env_cfg: EnvironmentConfig, env_cls: type[Environment], agent: str) -> list[str]:
    """The roles ``agent`` is evaluated in: those it plays in the config (all when roles alternate)."""
    mine = [r for r in env_cls.roles if env_cfg.roles.get(r) == agent]
    free = [r for r in env_cls.roles if not env_cfg.roles.get(r, "").startswith(SCRIPTED)]
    return free if env_cfg.alternate_roles or not mine else mine


def outcome(rewards: dict[str, float], role: str) -> str:
    mine = rewards.get(role, 0.0)
    others = [v for r, v in rewards.items() if r != role]
    ref = max(others) if others else 0.0
    return "win" if mine > ref else "draw" if mine == ref else "loss"


async def evaluate_player(env_cls: type[Environment], env_cfg: EnvironmentConfig, player: str,
                          roles: list[str], opponent: str | dict[str, str], episodes: int, base: SamplingParams,
                          temperature: float, play: Play) -> dict[str, Any]:
    """Play ``episodes`` seeded episodes; return score (0-1), wins/draws/losses and per-role scores."""
    fixed = {r: p for r, p in env_cfg.roles.items() if p.startswith(SCRIPTED)}  # e.g. a rule-based judge
    jobs = []
    for i in range(episodes):
        seed = 7_000_000 + 1000 * i
        sampling = {player: base.model_copy(update={"temperature": temperature, "seed": seed})}
        mine = roles[i % len(roles)]
        mapping = {r: (player if r == mine else fixed.get(r, SCRIPTED + (
            opponent.get(r, "") if isinstance(opponent, dict) else opponent))) for r in env_cls.roles}
        env = env_cls(env_cfg.params, seed)
        jobs.append((mine, play(env, f"eval-{i}", mapping, sampling, random.Random(seed))))
    results = await asyncio.gather(*(j for _, j in jobs))
    counts = {"win": 0, "draw": 0, "loss": 0}
    per_role: dict[str, list[float]] = {r: [] for r in roles}
    rewards: list[float] = []
    for (mine, _), r in zip(jobs, results, strict=True):
        if r is None:
            continue
        counts[outcome(r.rewards, mine)] += 1
        per_role[mine].append(score_for(r.rewards, mine))
        rewards.append(r.rewards.get(mine, 0.0))
    scores = [x for xs in per_role.values() for x in xs]
    return {"score": sum(scores) / max(len(scores), 1), "episodes": len(scores), "opponent": opponent,
            "wins": counts["win"], "draws": counts["draw"], "losses": counts["loss"],
            "mean_reward": sum(rewards) / max(len(rewards), 1),
            "per_role": {r: (sum(xs) / len(xs) if xs else None) for r, xs in per_role.items()}}
