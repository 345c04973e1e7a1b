"""The coordinator's episodes: each one played (at most ``run.concurrent_episodes`` at a time, each training
agent within its share of them while another has groups to play: slots.py), recorded, found.

``play`` runs one episode of an environment with its players (services/play/episode.py), its turns
routed by the turn router; an env bug or a lost turn abandons that episode alone, counted per purpose
and agent (failures.py). ``record`` keeps the record in the recent cache (the API's), Redis and the
transcript archive (archive.py), and counts a training episode's play per weight version
(train_play.py). ``find`` and ``tokens`` serve an episode from the cache, Redis or the archive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from services.common.bus import Bus
from services.contracts.config import TandemConfig
from services.contracts.messages import GenerateReply, GenerateRequest, SamplingParams, new_id
from services.contracts.players import Player
from services.coordinator import failures, play_archive, train_play
from services.coordinator.archive import TranscriptArchive, store_episode
from services.coordinator.dashboard.transcripts import load_tokens
from services.coordinator.players import Players
from services.coordinator.record import RunRecord
from services.coordinator.slots import EpisodeSlots
from services.coordinator.state import RunState
from services.play.episode import EpisodeResult, play_episode

log = logging.getLogger("tandem.coordinator")

EPISODE_CACHE = 2000
Generate = Callable[[Player, GenerateRequest], Awaitable[GenerateReply]]


class EpisodeLog:
    def __init__(self, cfg: TandemConfig, bus: Bus, state: RunState, players: Players, generate: Generate,
                 run_record: RunRecord) -> None:
        self.bus, self.state, self.players, self.generate, self.run_record = bus, state, players, generate, run_record
        self.slots = EpisodeSlots(cfg.run.concurrent_episodes, state.agents,  # groups left to launch or in flight
                                  lambda a: state.agents[a].wants_groups() or state.agents[a].in_flight_groups > 0)
        self.recent: dict[str, dict[str, Any]] = {}  # recent transcripts (the API's cache)
        self.archive = TranscriptArchive(bus, cfg.run.transcripts_kept, cfg.run_dir())
        self.k_train_play, self.k_failed = bus.streams.key("coord:train_play"), bus.streams.key("coord:episodes_failed")

    async def restore(self, run_dir: Path) -> None:
        """The play counts and failed episodes as Redis (and the play archive) hold them."""
        for agent, counts in (await play_archive.load(self.bus.redis, self.k_train_play, run_dir)).items():
            if agent in self.state.agents:
                self.state.agents[agent].train_play = counts
        self.state.episodes_failed = await failures.load(self.bus.redis, self.k_failed)

    async def play(self, env: Any, group_id: str, roles: dict[str, Player], purpose: str,
                   sampling: dict[Player, SamplingParams], rng: random.Random | None = None) -> EpisodeResult | None:
        async with self.slots.hold(roles):
            try:
                tokenizers, context = await self.players.tokenizers_for(roles)
                result = await play_episode(env, new_id(), group_id, roles, tokenizers, sampling,
                                            self.generate, purpose, rng, context)
            except Exception as exc:  # an env bug or a lost turn abandons one episode, not the run (failures.py)
                log.warning("episode of group %s abandoned: %r", group_id, exc)
                await failures.record(self.bus, self.k_failed, self.state.episodes_failed, purpose, roles)
                return None
        await self.record(result)
        return result

    async def record(self, result: EpisodeResult) -> None:
        rec = result.record()
        self.recent[result.episode_id] = rec
        if len(self.recent) > EPISODE_CACHE:
            self.recent.pop(next(iter(self.recent)))
        await store_episode(self.bus, self.archive, self.run_record, result, rec)  # retried through a restart
        self.state.episodes_done += 1
        self.state.episode_times.append(time.time())
        if result.purpose == "train":  # the agents' illegal / format-failure rate, per version (train_play.py)
            await train_play.count(self.bus, self.k_train_play, self.state.agents, result)

    async def find(self, episode_id: str) -> dict[str, Any] | None:
        """The episode's record: from the recent ones, else from the run's episode hash, else from the
        transcript archive (archive.py); None when none has it."""
        rec = self.recent.get(episode_id)
        if rec is None:
            raw = await self.bus.redis.hget(self.bus.streams.episodes(), episode_id)
            rec = json.loads(raw) if raw is not None else await asyncio.to_thread(self.archive.find, episode_id)
            if rec is None:
                return None
            rec.pop("reply_tokens", None)  # archived with the record; served by the tokens route
        return dict(rec)

    async def archived(self, keep: Callable[[dict[str, Any]], bool], offset: int, limit: int
                       ) -> tuple[int, list[dict[str, Any]]]:
        """The archived transcripts ``keep`` passes, newest first: their count and one page (archive.py)."""
        return await asyncio.to_thread(self.archive.page, keep, offset, limit)

    async def tokens(self, episode_id: str) -> dict[str, Any] | None:
        """The episode's reply tokens: kept in Redis for recent episodes, in the archive with older ones."""
        data = await load_tokens(self.bus, episode_id)
        if data is None:
            archived = await asyncio.to_thread(self.archive.find, episode_id)
            data = (archived or {}).get("reply_tokens")
        return data
