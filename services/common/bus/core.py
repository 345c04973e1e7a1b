"""The ``Bus``: publish, consume with consumer groups, reclaim, dead-letter, reconnect over Redis Streams.

What goes on which stream is the flow table (``services.contracts.flows``): ``consume``
validates every entry as its stream's message type, and ``publish`` refuses any other type.

Delivery rules:
* consumer groups with explicit XACK, sent only after the handler returned,
  i.e. after its effect is durable;
* entries left pending by a dead consumer are reclaimed with XAUTOCLAIM;
* effects are idempotent by message id: ids whose effect is done are kept in a
  per-group set and a redelivered one is acknowledged without running again; the set is
  bounded by the stream's retention, not by a TTL (services/common/retention.py says why
  that is safe); it is read only for the entries that can repeat an id (redeliveries, entries
  marked ``again`` by their producer, ids handled here lately), so a first delivery pays no
  round trip for it (retention.py, "Which deliveries are checked");
* a payload that fails to decode or validate, or whose handler raises ``Reject``,
  goes to the dead-letter stream with the reason at once and the consumer goes on;
  any other handler failure (``ValueError`` included) leaves the entry pending, so
  it is retried (reclaimed) until it has been delivered ``max_deliveries`` times,
  and only then dead-lettered; ``RetryLater`` leaves it pending without counting;
* nothing is trimmed here except by ``trim_acknowledged``, which never cuts
  past an entry some group has not acknowledged.

Speed: the bookkeeping is batched per read (at most one ZMSCORE for the done-set checks of a
whole read) and per completion burst (done-set adds, acks and dead letters in one
pipeline); the publishes of one event-loop tick go in one pipeline; the connection pool
is sized and waits for a free connection rather than failing.

Redis restarts: while Redis is unreachable (``ConnectionError``/``TimeoutError``), the
consume loops and ``publish`` wait with bounded exponential backoff and carry on when it
is back (consumer groups re-ensured, this consumer's pending entries read again); only
after ``reconnect_window_s`` without Redis do they give up and raise.

A Redis that has reached its ``maxmemory`` (noeviction) refuses writes: that is raised as ``RedisFull``,
whose message names the limit and what to do, never retried (docs/architecture.md §2.2, §10).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from pydantic import BaseModel
from redis.exceptions import ResponseError

from services.common.bus.adds import PipelinedAdds
from services.common.bus.consume import MAX_DELIVERIES, ConsumeLoop, Handler
from services.common.bus.errors import full_error
from services.common.metrics import count_dead_letter
from services.common.reconnect import RECONNECT_WINDOW_S, REDIS_DOWN, Backoff
from services.common.retention import RecentIds, trim_acknowledged
from services.contracts.codec import FIELD, encode
from services.contracts.flows import Flow, flow
from services.contracts.messages import DeadLetter
from services.contracts.streams import Streams

T = TypeVar("T")
log = logging.getLogger("tandem.bus")

POOL_SIZE = 64  # connections per Bus; a caller waits for a free one (never an error)


class Bus:
    def __init__(self, redis_url: str, run: str, service: str, *, pool_size: int = POOL_SIZE,
                 reconnect_window_s: float = RECONNECT_WINDOW_S) -> None:
        pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=pool_size, timeout=None,
                                                        decode_responses=False,
                                                        client_name=service.replace(" ", "_") or None)
        self.redis = aioredis.Redis(connection_pool=pool)
        self.streams = Streams(run)
        self.service = service
        self.reconnect_window_s = reconnect_window_s
        self.adds = PipelinedAdds(self.redis, self.retrying)
        self.published = RecentIds()  # (stream, message id) of this Bus's recent publishes

    async def close(self) -> None:
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()

    def flow(self, stream: str) -> Flow:
        """The flow-table entry of one of this run's streams."""
        return flow(self.streams.name_of(stream))

    async def retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, again with backoff while Redis is unreachable."""
        backoff = Backoff(f"{self.service} {what}", self.reconnect_window_s)
        while True:
            try:
                return await call()
            except REDIS_DOWN as exc:
                await backoff.wait(exc)
            except ResponseError as exc:
                raise full_error(exc) or exc  # noqa: B904 (RedisFull: exc is its context)

    # --- producing ----------------------------------------------------------
    async def publish(self, stream: str, msg: BaseModel) -> str:
        f = self.flow(stream)
        if not isinstance(msg, f.types):
            raise TypeError(f"{type(msg).__name__} cannot go on {stream}: the flow table says {f.message_name}")
        key = f"{stream}\n{getattr(msg, 'id', '')}"
        again = key in self.published
        self.published.add([key])
        return (await self.adds.add(stream, encode(msg), again=again)).decode()

    def letter(self, stream: str, entry_id: str, payload: bytes, reason: str) -> dict[bytes, bytes]:
        log.warning("dead-letter %s %s: %s", stream, entry_id, reason)
        count_dead_letter(stream)
        return {FIELD: encode(DeadLetter(source_stream=stream, entry_id=entry_id, service=self.service,
                                         reason=reason, payload=payload))}

    # --- consuming ----------------------------------------------------------
    async def ensure_group(self, stream: str, group: str, start: str = "0") -> bool:
        """Create the group unless it exists; whether it was created here."""
        try:
            await self.redis.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return False
        return True

    async def consume(
        self,
        stream: str,
        group: str,
        consumer: str,
        handler: Handler,
        stop: asyncio.Event,
        *,
        concurrency: int = 1,
        count: int = 16,
        block_ms: int = 500,
        claim_idle_ms: int = 30_000,
        start: str = "0",
        max_deliveries: int = MAX_DELIVERIES,
    ) -> None:
        """Run ``handler`` on every entry of ``stream`` for ``group`` until ``stop``.

        Entries are validated as the stream's message type in the flow table. ``concurrency`` > 1 runs
        handlers as concurrent tasks (order not kept).
        """
        loop = ConsumeLoop(self, stream, group, consumer, handler, concurrency, count, block_ms, claim_idle_ms,
                            start, max_deliveries)
        await loop.run(stop)

    async def deliveries(self, stream: str, group: str, entry_id: str) -> int:
        info = await self.redis.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
        return int(info[0]["times_delivered"]) if info else 1

    # --- housekeeping -------------------------------------------------------
    async def trim_acknowledged(self, stream: str) -> int:
        """Trim entries that every group has acknowledged; returns entries removed."""
        return await trim_acknowledged(self.redis, stream)
