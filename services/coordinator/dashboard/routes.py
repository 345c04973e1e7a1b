"""The dashboard's read-only data routes (``/v1/dashboard/*``) and its page at ``/``.

Bad query values get a 422 naming the field (the API's handler), an unknown episode a 404; with
``api.token`` configured, every data route but ``/v1/dashboard/info`` needs the token (401).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse

from services.common.bus import Bus
from services.contracts.config import TandemConfig
from services.contracts.players import Player
from services.coordinator.dashboard.pipeline import gate, services
from services.coordinator.dashboard.transcripts import board, brief, decode_tokens, matches
from services.coordinator.errors import responses
from services.coordinator.state import RunState
from services.envs.base import Environment

NO_CACHE = {"Cache-Control": "no-store"}


def _finite(name: str, v: float | None) -> float | None:
    if v is not None and not math.isfinite(v):
        raise HTTPException(422, f"{name} must be a finite number")
    return v


class EpisodeSource(Protocol):
    """Where episodes are read (the coordinator's episode log, episodes.py)."""

    recent: dict[str, dict[str, Any]]

    async def find(self, episode_id: str) -> dict[str, Any] | None: ...

    async def tokens(self, episode_id: str) -> dict[str, Any] | None: ...

    async def archived(self, keep: Callable[[dict[str, Any]], bool], offset: int, limit: int
                       ) -> tuple[int, list[dict[str, Any]]]: ...


@dataclass(frozen=True)
class DashboardSource:
    """What the dashboard reads: the run's config and environment, its state, its episodes, the players'
    tokenizers (``tokenizer_for``, blocking), the bus and the coordinator's reply stream (for the pipeline)."""

    cfg: TandemConfig
    env_cls: type[Environment]
    state: RunState
    episodes: EpisodeSource
    tokenizer_for: Callable[[Player], Any]
    bus: Bus
    reply_stream: str


async def episode_record(episodes: EpisodeSource, episode_id: str) -> dict[str, Any]:
    """The episode's record: from the recent ones, else from the run's episode hash, else from the
    transcript archive (services/coordinator/archive.py); else a 404."""
    rec = await episodes.find(episode_id)
    if rec is None:
        raise HTTPException(404, f"no episode {episode_id!r}")
    return rec


def create_routes(router: FastAPI, source: DashboardSource, index: Path, guard: list[Any]) -> None:
    """The page and ``/v1/dashboard/info`` (open), the data routes (behind ``guard``)."""
    state = source.state

    @router.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(index, headers=NO_CACHE)

    @router.get("/v1/dashboard/info")
    async def info() -> dict[str, Any]:
        return run_info(source.cfg, source.env_cls) | {"started_at": state.started_at, "read_only": False}

    @router.get("/v1/dashboard/pipeline", dependencies=guard, responses=responses(401))
    async def pipeline() -> dict[str, Any]:
        return {"gates": {a: gate(s) for a, s in state.agents.items()},
                "services": await services(source.bus, source.reply_stream, source.cfg.agents, state.agents)}

    episode_routes(router, source.cfg, source.env_cls, source.episodes, source.tokenizer_for, guard)


def run_info(cfg: TandemConfig, env_cls: type[Environment]) -> dict[str, Any]:
    """What ``/v1/dashboard/info`` says of the run's config."""
    return {"run": cfg.run.name, "environment": cfg.environment.name, "roles": cfg.environment.roles,
            "env_roles": list(env_cls.roles), "agents": {a: {"train": c.train} for a, c in cfg.agents.items()},
            "total_steps": cfg.run.total_steps, "token_required": bool(cfg.api.token)}


def episode_routes(router: FastAPI, cfg: TandemConfig, env_cls: type[Environment], kept: EpisodeSource,
                   tokenizer_for: Callable[[Player], Any], guard: list[Any]) -> None:
    """The transcript browser's routes: the episode list (recent or archived), one episode, its tokens."""

    @router.get("/v1/dashboard/episodes", dependencies=guard, responses=responses(401, 422))
    async def episodes(limit: int = Query(50, ge=1, le=500), offset: int = Query(0, ge=0),
                       agent: str | None = Query(None, max_length=200),
                       role: str | None = Query(None, max_length=200),
                       purpose: Literal["train", "eval"] | None = None,
                       min_reward: float | None = None, max_reward: float | None = None,
                       source: Literal["recent", "archive"] = "recent") -> dict[str, Any]:
        _finite("min_reward", min_reward)
        _finite("max_reward", max_reward)
        if role and role not in env_cls.roles:
            raise HTTPException(422, f"role {role!r} is not a role of {cfg.environment.name} "
                                     f"({', '.join(env_cls.roles)})")

        def keep(r: dict[str, Any]) -> bool:
            return matches(r, agent or None, role or None, purpose, min_reward, max_reward)

        if source == "archive":
            total, page = await kept.archived(keep, offset, limit)
            return {"total": total, "source": source, "episodes": [brief(r) for r in page]}
        recs = [r for r in reversed(list(kept.recent.values())) if keep(r)]
        return {"total": len(recs), "source": source, "episodes": [brief(r) for r in recs[offset: offset + limit]]}

    @router.get("/v1/dashboard/episodes/{episode_id}", dependencies=guard, responses=responses(401, 404))
    async def episode(episode_id: str) -> dict[str, Any]:
        rec = await episode_record(kept, episode_id)
        return rec | {"board": board(env_cls, rec)}

    @router.get("/v1/dashboard/episodes/{episode_id}/tokens", dependencies=guard,
                responses=responses(401, 404))
    async def tokens(episode_id: str) -> dict[str, Any]:
        await episode_record(kept, episode_id)
        data = await kept.tokens(episode_id)
        if data is None:
            raise HTTPException(404, f"the tokens of episode {episode_id!r} are no longer kept (or it had no "
                                     "model turn)")
        return await asyncio.to_thread(decode_tokens, data, tokenizer_for)
