"""The coordinator's turn router: each model turn to its engine, each engine reply back to the turn.

A turn of an agent goes on ``turns:{agent}`` with the coordinator's reply stream; ``on_reply`` (the
replies stream's handler) checks the reply (replies.py: a bad one is dead-lettered and its episode
abandoned) and completes the turn waiting for it. A ``Local`` player (a past version or fixed
weights) generates in-process (services/play/local.py).
"""

from __future__ import annotations

import asyncio

from services.common.bus import Bus
from services.contracts.messages import GenerateReply, GenerateRequest
from services.contracts.players import Local, Player
from services.coordinator.replies import ReplyCheck
from services.play.local import LocalPlayers  # torch is imported when a Local player first plays

TURN_TIMEOUT_S = 300.0


class TurnRouter:
    def __init__(self, bus: Bus, name: str, replies: ReplyCheck, local: LocalPlayers) -> None:
        self.bus, self.name, self.replies, self.local = bus, name, replies, local
        self.reply_stream = bus.streams.replies(name)
        self.pending: dict[str, asyncio.Future[GenerateReply]] = {}

    async def generate(self, player: Player, req: GenerateRequest) -> GenerateReply:
        if isinstance(player, Local):
            return await self.local.generate(player, req)
        req = req.model_copy(update={"reply_stream": self.reply_stream})
        fut: asyncio.Future[GenerateReply] = asyncio.get_running_loop().create_future()
        self.pending[req.id] = fut
        try:
            await self.bus.publish(self.bus.streams.turns(req.agent), req)
            return await asyncio.wait_for(fut, TURN_TIMEOUT_S)
        finally:
            self.pending.pop(req.id, None)

    async def on_reply(self, reply: GenerateReply) -> None:
        fut = self.pending.get(reply.request_id)
        if (problem := self.replies.problem(reply)) is not None:  # rejected alone, its episode abandoned
            await self.replies.reject(reply, fut, problem)  # raises Reject: dead-lettered with the reason
        if fut is not None and not fut.done():
            if reply.error:
                fut.set_exception(RuntimeError(f"generation failed: {reply.error}"))
            else:
                fut.set_result(reply)
