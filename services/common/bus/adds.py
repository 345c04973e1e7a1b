"""The bus's publishing half: XADDs pipelined per event-loop tick, each caller waiting for its own entry id.

docs/architecture.md §2.2 (delivery; the bus batches its Redis work) and §10 (a full Redis). ``Bus.publish``
(services/common/bus/core.py) validates a message against the flow table, encodes it and hands it here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from services.common.bus.errors import full_error
from services.contracts.codec import FIELD

AGAIN = b"again"  # an entry's field: its message id may have reached the stream before (services/common/retention.py)
Retrying = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]]


class PipelinedAdds:
    """``publish``'s XADDs: those issued in the same event-loop tick (the replies of one batch, the next turns of
    the episodes one read of replies woke) go to Redis in one MULTI/EXEC pipeline; each caller waits for its own
    entry id or error. In a transaction Redis wakes a reader blocked on the stream once, after the last entry, so
    the reader gets them in one read (the rollout batches what one read brings). While Redis is unreachable the
    whole pipeline is retried with backoff, as a single XADD is; a full Redis fails each of them (``RedisFull``).

    An entry whose message id may already be on the stream carries the ``AGAIN`` field, so that its consumers check
    their done sets for it: every entry of a retried XADD or pipeline (the first try may have landed before the
    connection failed), and an entry the caller says is ``again`` (``Bus.publish``: an id it published before)."""

    def __init__(self, redis: aioredis.Redis, retrying: Retrying) -> None:
        self.redis, self.retrying = redis, retrying
        self.queue: list[tuple[str, dict[bytes, bytes], asyncio.Future[bytes]]] = []
        self.flushing: asyncio.Task[None] | None = None

    async def add(self, stream: str, payload: bytes, *, again: bool = False) -> bytes:
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.queue.append((stream, {FIELD: payload, AGAIN: b"1"} if again else {FIELD: payload}, fut))
        if self.flushing is None or self.flushing.done():  # (done without running: cancelled at a loop's end)
            self.flushing = asyncio.create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        # a new task's first step runs at the loop's next iteration: this tick's other publishes are queued by then
        batch, self.queue, self.flushing = [a for a in self.queue if not a[2].done()], [], None
        if not batch:
            return
        tries = 0

        def attempt() -> Awaitable[Any]:
            nonlocal tries
            tries += 1
            entries = batch if tries == 1 else [(stream, {**fields, AGAIN: b"1"}, f) for stream, fields, f in batch]
            if len(entries) == 1:
                stream, fields, _ = entries[0]
                return self.redis.xadd(stream, fields)  # type: ignore[arg-type]
            return self._pipeline(entries)

        try:
            what = f"publish on {batch[0][0]}" if len(batch) == 1 else f"publish of {len(batch)} entries"
            results = await self.retrying(what, attempt)
            results = [results] if len(batch) == 1 else results
        except BaseException as exc:
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(exc) if isinstance(exc, Exception) else fut.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        for (*_, fut), res in zip(batch, results, strict=True):
            if fut.done():
                continue
            if isinstance(res, ResponseError):
                fut.set_exception(full_error(res) or res)
            elif isinstance(res, Exception):
                fut.set_exception(res)
            else:
                fut.set_result(res)

    async def _pipeline(self, batch: list[tuple[str, dict[bytes, bytes], asyncio.Future[bytes]]]) -> list[Any]:
        async with self.redis.pipeline(transaction=True) as pipe:
            for stream, fields, _ in batch:
                pipe.xadd(stream, fields)  # type: ignore[arg-type]
            return list(await pipe.execute(raise_on_error=False))
