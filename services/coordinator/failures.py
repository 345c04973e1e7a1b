"""Episodes that failed inside the coordinator (an environment bug, a lost or failed turn), counted.

An episode that raises is dropped, not retried (its state lived in the coroutine that failed): its
group goes on with the rest, by design. The ledger and the buffer take a group's membership and size
from the samples actually emitted (ledger.py), so a group short of an episode is a smaller GRPO group,
consistent end to end; a group whose every episode failed is abandoned with that reason. What this
module adds is the count, per purpose (``train`` / ``eval``) and per agent that played the episode,
kept in a Redis hash (``coord:episodes_failed``) as it grows so a restarted coordinator has it, and
shown as ``episodes_failed`` in ``/v1/status`` and ``summary.json`` (docs/architecture.md §4).
"""

from __future__ import annotations

from typing import Any

from services.common.bus import Bus
from services.contracts.players import Player, agent_of

TOTAL = "total"


def episode_keys(purpose: str, roles: dict[str, Player]) -> list[tuple[str, str]]:
    """(purpose, who) pairs one failed episode counts under: the total and each agent that played in it."""
    agents = sorted({a for p in roles.values() if (a := agent_of(p)) is not None})
    return [(purpose, TOTAL), *((purpose, a) for a in agents)]


def add(counts: dict[str, dict[str, int]], keys: list[tuple[str, str]]) -> None:
    for purpose, who in keys:
        per = counts.setdefault(purpose, {})
        per[who] = per.get(who, 0) + 1


async def record(bus: Bus, key: str, counts: dict[str, dict[str, int]], purpose: str,
                 roles: dict[str, Player]) -> None:
    """Count one failed episode in ``counts`` (the run state's) and in Redis, through a Redis restart."""
    keys = episode_keys(purpose, roles)
    add(counts, keys)
    await bus.retrying("counting a failed episode", lambda: save(bus.redis, key, keys))


async def save(redis: Any, key: str, keys: list[tuple[str, str]]) -> None:
    pipe = redis.pipeline(transaction=True)
    for purpose, who in keys:
        pipe.hincrby(key, f"{purpose}|{who}", 1)
    await pipe.execute()


async def load(redis: Any, key: str) -> dict[str, dict[str, int]]:
    """purpose -> {"total" | agent -> episodes}, as ``save`` left them."""
    out: dict[str, dict[str, int]] = {}
    for field, value in (await redis.hgetall(key)).items():
        name = field.decode() if isinstance(field, bytes) else field
        purpose, who = name.split("|", 1)
        out.setdefault(purpose, {})[who] = int(value)
    return out
