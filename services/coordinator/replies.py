"""Engine replies checked at the coordinator before they enter an episode (docs/architecture.md §2.3).

The wire contract already refuses negative ids and non-finite or positive logprobs (a reply that breaks it is
dead-lettered when it is decoded); the rollout refuses ids outside the vocabulary from its engine. This is the
coordinator's own check of what reaches it, as the buffer checks samples: the reply's agent is one of the
run's, its ids are within that agent's vocabulary (its model's ``config.json``) and its logprobs are finite
and ≤ 0 (``services/common/tokens.py``).

A bad reply is rejected alone: the turn waiting for it fails, so its episode is abandoned (the group goes on
with its other episodes; a group with none left is abandoned as an episode error), the rejection is counted
per agent in Redis (``coord:rejected_replies``: ``<agent>`` replies, ``<agent>:episodes`` episodes
abandoned; shown in ``/v1/status``), and ``Reject`` sends the reply to the dead-letter stream with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.common.bus import Bus, Reject
from services.common.tokens import ids_problem, logprobs_problem, vocab_size
from services.contracts.config import TandemConfig
from services.contracts.messages import GenerateReply

log = logging.getLogger("tandem.coordinator")


class RejectedReply(RuntimeError):
    """The reply to a turn was rejected: the turn, and so its episode, fails."""


class ReplyCheck:
    def __init__(self, cfg: TandemConfig, bus: Bus) -> None:
        self.bus = bus
        self.vocab: dict[str, int | None] = {a: vocab_size(c.model_path) for a, c in cfg.agents.items()}
        self.key = bus.streams.key("coord:rejected_replies")

    def problem(self, reply: GenerateReply) -> str | None:
        """Why ``reply`` must not enter an episode, or None."""
        if reply.agent not in self.vocab:
            return f"a reply from agent {reply.agent!r}, which is not an agent of this run"
        if len(reply.output_ids) != len(reply.output_logprobs):
            return f"{len(reply.output_ids)} output ids but {len(reply.output_logprobs)} logprobs"
        return (ids_problem(reply.output_ids, self.vocab[reply.agent], "output_ids")
                or logprobs_problem(reply.output_logprobs, "output_logprobs"))

    async def reject(self, reply: GenerateReply, fut: asyncio.Future[Any] | None, problem: str) -> None:
        """Fail the turn waiting for ``reply`` (if any), count the rejection and raise ``Reject``."""
        abandoned = fut is not None and not fut.done()
        if abandoned:
            fut.set_exception(RejectedReply(f"reply {reply.request_id} rejected: {problem}"))
        log.warning("reply %s to request %s rejected%s: %s", reply.id, reply.request_id,
                    " (its episode is abandoned)" if abandoned else "", problem)
        agent = reply.agent if reply.agent in self.vocab else "?"
        await self.bus.retrying("counting a rejected reply", lambda: self._count(agent, abandoned))
        raise Reject(problem)

    async def _count(self, agent: str, abandoned: bool) -> None:
        async with self.bus.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(self.key, agent, 1)
            if abandoned:
                pipe.hincrby(self.key, f"{agent}:episodes", 1)
            await pipe.execute()

    async def counts(self) -> dict[str, dict[str, int]]:
        """Per agent: replies rejected and episodes they abandoned."""
        raw = {k.decode(): int(v) for k, v in (await self.bus.redis.hgetall(self.key)).items()}
        agents = {k.split(":")[0] for k in raw}
        return {a: {"replies": raw.get(a, 0), "episodes_abandoned": raw.get(f"{a}:episodes", 0)}
                for a in sorted(agents)}
