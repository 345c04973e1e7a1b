"""Models played in-process on the inference library's ``Engine`` (continuous batching, one sampler).

``generate_on(engine, request)`` answers one turn on an in-process engine the way a rollout's
engine answers it on the streams (ids, logprobs, finish reason, the oldest weight version that
produced a token). ``LocalPlayers`` plays ``Local`` players (fixed weights from a directory: past
versions of an opponent pool, ``tandem eval`` checkpoints): one engine per directory, created on
first use, a few kept (the least recently used idle one is stopped). Concurrent episodes' turns
share the engine's running batch. Nothing a ``Local`` player generates is trained on.

Importing this module imports no torch (the coordinator imports it, docs/architecture.md §9): the
inference library's ``Engine`` is imported when the first engine is made, tokenizers and context windows
come from ``services.common.tokens``.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from services.common.tokens import context_length, load_tokenizer
from services.contracts.messages import GenerateReply, GenerateRequest, SamplingParams
from services.contracts.players import AgentPlayer, Local, Player
from services.envs.base import Environment
from services.play.episode import EpisodeResult, play_episode

if TYPE_CHECKING:
    from services.inference.generator import Engine

__all__ = ["EnginePlayers", "LocalPlayers", "context_length", "generate_on", "tokenizer"]


def tokenizer(model_path: str) -> Any:
    return load_tokenizer(model_path)


async def generate_on(engine: Engine, req: GenerateRequest, label: str,
                      weight_version: int | None = None, lora: str | None = None) -> GenerateReply:
    """Run ``req`` on an in-process engine (under its loaded adapter ``lora``, when given); ``weight_version``
    overrides the engine's (a fixed -1)."""
    from services.inference.generator import GenRequest  # imported with the engine already

    sp = req.sampling
    done = await engine.generate(GenRequest(
        rid=req.id, input_ids=list(req.input_ids), temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
        max_new_tokens=sp.max_new_tokens, stop_token_ids=frozenset(sp.stop_token_ids), seed=sp.seed,
        lora=lora))
    finish = (done.finish or {}).get("type", "abort")
    if finish == "abort":
        raise RuntimeError(f"generation failed: {(done.finish or {}).get('message')}")
    oldest = min([v for v, _ in done.version_events] + [done.weight_version])
    return GenerateReply(request_id=req.id, agent=req.agent, episode_id=req.episode_id, turn=req.turn,
                         output_ids=done.output_ids, output_logprobs=done.logprobs, finish_reason=finish,
                         weight_version=oldest if weight_version is None else weight_version, engine=label,
                         prompt_tokens=len(req.input_ids))


class LocalPlayers:
    """In-process engines for ``Local`` players, keyed by weights directory."""

    def __init__(self, max_models: int = 4, max_batch: int = 64) -> None:
        self.max_models, self.max_batch = max_models, max_batch
        self.engines: OrderedDict[str, Engine] = OrderedDict()
        self.users: dict[str, int] = {}  # turns holding each engine: only an unused one is stopped
        self.lock = threading.Lock()

    def tokenizer(self, path: str) -> Any:
        return tokenizer(path)

    def context_length(self, path: str) -> int:
        return context_length(path)

    def acquire(self, path: str) -> Engine:
        """The directory's engine, loaded on first use (blocking: call it off the event loop);
        hand it back with ``release``."""
        with self.lock:
            self.users[path] = self.users.get(path, 0) + 1
            if path in self.engines:
                self.engines.move_to_end(path)
                return self.engines[path]
            try:
                from services.inference.generator import Engine  # torch: only where a model runs

                engine = self.engines[path] = Engine(path, weight_version=-1, max_batch=self.max_batch)
            except Exception:
                self.users[path] -= 1
                raise
            unused = [p for p in self.engines if not self.users.get(p)]
            for old in unused[:max(0, len(self.engines) - self.max_models)]:
                self.engines.pop(old).stop()
            return engine

    def release(self, path: str) -> None:
        with self.lock:
            self.users[path] -= 1

    async def generate(self, player: Player, req: GenerateRequest) -> GenerateReply:
        if not isinstance(player, Local):
            raise ValueError(f"{player} is not played in-process")
        engine = await asyncio.to_thread(self.acquire, player.path)
        try:
            return await generate_on(engine, req, f"local:{player.path}", weight_version=-1)
        finally:
            self.release(player.path)

    def close(self) -> None:
        with self.lock:
            for engine in self.engines.values():
                engine.stop()
            self.engines.clear()


class EnginePlayers:
    """Agents played on in-process engines (the demo's warm-start, the RL sweep): ``AgentPlayer(a)``
    is answered by ``engines[a]``, each reply with the engine's weight version, as a rollout would."""

    def __init__(self, engines: dict[str, Engine]) -> None:
        self.engines = engines
        self.tokenizers: dict[Player, Any] = {AgentPlayer(agent=a): e.tokenizer for a, e in engines.items()}
        self.context: dict[Player, int] = {AgentPlayer(agent=a): context_length(e.model_path)
                                           for a, e in engines.items()}

    async def generate(self, player: Player, req: GenerateRequest) -> GenerateReply:
        if not isinstance(player, AgentPlayer) or player.agent not in self.engines:
            raise ValueError(f"{player} has no in-process engine")
        return await generate_on(self.engines[player.agent], req, f"inprocess:{player.agent}")

    async def play(self, env: Environment, episode_id: str, group_id: str, roles: dict[str, Player],
                   sampling: dict[Player, SamplingParams], purpose: str, rng: random.Random) -> EpisodeResult:
        return await play_episode(env, episode_id, group_id, roles, self.tokenizers, sampling, self.generate,
                                  purpose, rng, self.context)

    def stop(self) -> None:
        for engine in self.engines.values():
            engine.stop()
