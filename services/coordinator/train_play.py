"""How each agent plays in its training episodes, per weight version (docs/architecture.md §10).

Per agent and per weight version its replies were generated with (the oldest, when an episode
straddles two): training episodes, those in which the agent's reply was illegal or malformed
(episode.py flags them), replies, illegal replies and the reward summed. The illegal or
format-failure rate is a first-class metric: ``/v1/status``, ``/metrics``, the live view,
``summary.json`` and the plot all read it from here, against the training step. The counts are
kept in a Redis hash (``coord:train_play``) as they grow, so a restarted coordinator has them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from services.contracts.players import AgentPlayer
from services.play.episode import EpisodeResult

RECENT_EPISODES = 64  # the "recent" rate: the newest versions' episodes, at least this many


@dataclass
class PlayCounts:
    episodes: int = 0
    invalid_episodes: int = 0
    replies: int = 0
    invalid_replies: int = 0
    reward: float = 0.0

    def add(self, other: PlayCounts) -> None:
        self.episodes += other.episodes
        self.invalid_episodes += other.invalid_episodes
        self.replies += other.replies
        self.invalid_replies += other.invalid_replies
        self.reward += other.reward

    def report(self) -> dict[str, Any]:
        """The counts with the rates: ``illegal_rate`` per episode, ``illegal_reply_rate`` per reply."""
        return {**asdict(self),
                "illegal_rate": self.invalid_episodes / self.episodes if self.episodes else None,
                "illegal_reply_rate": self.invalid_replies / self.replies if self.replies else None,
                "mean_reward": self.reward / self.episodes if self.episodes else None}


def episode_counts(result: EpisodeResult, agents: set[str] | dict[str, Any]) -> dict[tuple[str, int], PlayCounts]:
    """(agent, weight version) -> the counts one training episode adds, for the trained agents in it."""
    out: dict[tuple[str, int], PlayCounts] = {}
    for role, view in result.views.items():
        if not isinstance(view.player, AgentPlayer) or view.player.agent not in agents or not view.weight_versions:
            continue
        replies, invalid = result.replies(role)
        key = (view.player.agent, min(view.weight_versions))
        c = out.setdefault(key, PlayCounts())
        c.add(PlayCounts(1, int(invalid > 0), replies, invalid, result.rewards.get(role, 0.0)))
    return out


def totals(by_version: dict[int, PlayCounts]) -> PlayCounts:
    out = PlayCounts()
    for c in by_version.values():
        out.add(c)
    return out


def recent(by_version: dict[int, PlayCounts], least: int = RECENT_EPISODES) -> PlayCounts:
    """The newest versions' counts, going back until at least ``least`` episodes (or all)."""
    out = PlayCounts()
    for v in sorted(by_version, reverse=True):
        out.add(by_version[v])
        if out.episodes >= least:
            break
    return out


def curve(by_version: dict[int, PlayCounts]) -> list[dict[str, Any]]:
    """One point per weight version: the version (= training step) and its counts and rates."""
    return [{"weight_version": v, **by_version[v].report()} for v in sorted(by_version)]


async def save(redis: Any, key: str, counts: dict[tuple[str, int], PlayCounts]) -> None:
    """Add one episode's counts to the run's hash (one field per agent and version, a JSON list of sums)."""
    if not counts:
        return
    pipe = redis.pipeline(transaction=False)
    for (agent, version), c in counts.items():
        base = f"{agent}|{version}|"
        pipe.hincrby(key, base + "episodes", c.episodes)
        pipe.hincrby(key, base + "invalid_episodes", c.invalid_episodes)
        pipe.hincrby(key, base + "replies", c.replies)
        pipe.hincrby(key, base + "invalid_replies", c.invalid_replies)
        pipe.hincrbyfloat(key, base + "reward", c.reward)
    await pipe.execute()


async def load(redis: Any, key: str) -> dict[str, dict[int, PlayCounts]]:
    """agent -> version -> counts, as ``save`` left them."""
    out: dict[str, dict[int, PlayCounts]] = {}
    for field, value in (await redis.hgetall(key)).items():
        name = field.decode() if isinstance(field, bytes) else field
        agent, version, what = name.rsplit("|", 2)
        c = out.setdefault(agent, {}).setdefault(int(version), PlayCounts())
        setattr(c, what, json.loads(value) if what != "reward" else float(value))
    return out


async def count(bus: Any, key: str, agents: dict[str, Any], result: EpisodeResult) -> None:
    """A training episode's counts per agent and version: into the agents' run state and into Redis, through
    the bus's reconnect backoff like the episode's own writes (archive.store_episode)."""
    counts = episode_counts(result, agents)
    for (agent, version), c in counts.items():
        agents[agent].train_play.setdefault(version, PlayCounts()).add(c)
    await bus.retrying("counting training play", lambda: save(bus.redis, key, counts))
