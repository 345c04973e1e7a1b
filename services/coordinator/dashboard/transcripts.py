"""Transcripts for the dashboard: episode filters, the board drawing, and each reply's tokens and logprobs.

The episode record (``/v1/episodes/{id}``) keeps each turn's text, reward and weight version, not the
tokens. ``save_tokens`` (called by the coordinator when it records an episode) keeps each model
reply's token ids and rollout logprobs under ``tandem:{run}:dashboard:tokens:{episode}`` for
``TOKENS_TTL_S``, so the dashboard can show them on demand without growing the episode records.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from services.contracts.players import PLAYER, Player
from services.envs.base import Environment

TOKENS_TTL_S = 24 * 3600


def tokens_key(run_key: Any, episode_id: str) -> str:
    """``run_key`` is the run's ``Streams.key``."""
    return str(run_key(f"dashboard:tokens:{episode_id}"))


def reply_tokens(views: dict[str, Any]) -> dict[str, Any]:
    """Per role, each model reply's ids, logprobs and weight version, in turn order: the view's ``Turn`` records
    of that turn laid end to end (a turn with tool calls has several; the version is the last one's)."""
    out: dict[str, Any] = {}
    for role, view in views.items():
        turns: list[dict[str, Any]] = []
        for t in view.turns:
            if not turns or turns[-1]["turn"] != t.turn:
                turns.append({"turn": t.turn, "weight_version": t.weight_version, "ids": [], "logprobs": []})
            turns[-1]["weight_version"] = t.weight_version
            turns[-1]["ids"] += view.tokens[t.start:t.end]
            turns[-1]["logprobs"] += [round(float(x), 5) for x in view.rollout_logprobs[t.start:t.end]]
        out[role] = {"agent": str(view.player), "player": dict(view.player), "turns": turns}
    return out


async def save_tokens(bus: Any, result: Any, ttl_s: int = TOKENS_TTL_S) -> None:
    """Keep an episode's reply tokens for the dashboard (``result`` is the coordinator's EpisodeResult)."""
    data = reply_tokens(result.views)
    if data:
        await bus.redis.set(tokens_key(bus.streams.key, result.episode_id), json.dumps(data, separators=(",", ":")),
                            ex=ttl_s)


async def load_tokens(bus: Any, episode_id: str) -> dict[str, Any] | None:
    raw = await bus.redis.get(tokens_key(bus.streams.key, episode_id))
    return None if raw is None else json.loads(raw)


def decode_tokens(data: dict[str, Any], tokenizer_for: Callable[[Player], Any]) -> dict[str, Any]:
    """Add each token's text (decoded alone) with the tokenizer of the player that generated it."""
    for entry in data.values():
        tok = tokenizer_for(PLAYER.validate_python(entry["player"])) if "player" in entry else None
        for turn in entry["turns"]:
            turn["texts"] = [tok.decode([i]) for i in turn["ids"]] if tok is not None else None
    return data


def reward_of(rec: dict[str, Any], agent: str | None, role: str | None) -> list[float]:
    """The rewards a reward filter looks at: the role's, else the agent's roles', else every role's."""
    rewards: dict[str, float] = rec.get("rewards", {})
    if role:
        return [rewards[role]] if role in rewards else []
    if agent:
        return [v for r, v in rewards.items() if rec.get("roles", {}).get(r) == agent]
    return list(rewards.values())


def matches(rec: dict[str, Any], agent: str | None = None, role: str | None = None, purpose: str | None = None,
            min_reward: float | None = None, max_reward: float | None = None) -> bool:
    """Whether an episode passes the transcript browser's filters (all optional, all must hold)."""
    roles: dict[str, str] = rec.get("roles", {})
    if purpose and rec.get("purpose") != purpose:
        return False
    if agent and agent not in roles.values():
        return False
    if role and (role not in roles or (agent and roles[role] != agent)):
        return False
    if min_reward is not None or max_reward is not None:
        values = reward_of(rec, agent, role)
        lo = float("-inf") if min_reward is None else min_reward
        hi = float("inf") if max_reward is None else max_reward
        if not any(lo <= v <= hi for v in values):
            return False
    return True


def brief(rec: dict[str, Any]) -> dict[str, Any]:
    """A row of the episode list."""
    return {k: rec.get(k) for k in ("id", "group_id", "purpose", "roles", "rewards", "summary")} | {
        "turns": len(rec.get("turns", []))}


def board(env_cls: type[Environment], rec: dict[str, Any]) -> dict[str, Any] | None:
    """The environment's drawing of the episode's final state, if it offers one."""
    try:
        drawn = env_cls.render(rec.get("summary") or {})
    except Exception as exc:  # a plug-in's drawing bug must not break the transcript
        return {"format": "text", "content": f"(the environment's render failed: {exc!r})"}
    if drawn is None:
        return None
    return {"format": getattr(env_cls, "render_format", "text"), "content": drawn}
