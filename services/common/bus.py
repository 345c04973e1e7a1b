"""Redis Streams bus: publish, consume with consumer groups, reclaim, dead-letter.

What goes on which stream is the flow table (``services.contracts.flows``): ``consume``
validates every entry as its stream's message type, and ``publish`` refuses any other type.

Delivery rules:
* consumer groups with explicit XACK, sent only after the handler returned,
  i.e. after its effect is durable;
* entries left pending by a dead consumer are reclaimed with XAUTOCLAIM;
* effects are idempotent by message id: ids whose effect is done are kept in a
  per-group set and a redelivered one is acknowledged without running again;
* a payload that fails to decode or validate, or whose handler rejects it
  (``ValueError``), goes to the dead-letter stream with the reason at once and
  the consumer goes on; any other handler failure leaves the entry pending, so
  it is retried (reclaimed) until it has been delivered ``max_deliveries``
  times, and only then dead-lettered;
* nothing is trimmed here except by ``trim_acknowledged``, which never cuts
  past an entry some group has not acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel, ValidationError
from redis.exceptions import ResponseError

from services.contracts.codec import FIELD, decode, encode
from services.contracts.flows import Flow, flow
from services.contracts.messages import DeadLetter
from services.contracts.streams import Streams

Handler = Callable[[Any], Awaitable[None]]
log = logging.getLogger("tandem.bus")


class RetryLater(Exception):
    """Raised by a handler to leave the entry pending; it is reclaimed later."""


MAX_DELIVERIES = 3
DONE_TTL_S = 7 * 24 * 3600  # done-id sets outlive any redelivery, then expire


class Bus:
    def __init__(self, redis_url: str, run: str, service: str) -> None:
        self.redis = aioredis.from_url(redis_url, decode_responses=False)
        self.streams = Streams(run)
        self.service = service

    async def close(self) -> None:
        await self.redis.aclose()

    def flow(self, stream: str) -> Flow:
        """The flow-table entry of one of this run's streams."""
        return flow(self.streams.name_of(stream))

    # --- producing ----------------------------------------------------------
    async def publish(self, stream: str, msg: BaseModel) -> str:
        f = self.flow(stream)
        if not isinstance(msg, f.types):
            raise TypeError(f"{type(msg).__name__} cannot go on {stream}: the flow table says {f.message_name}")
        entry_id = await self.redis.xadd(stream, {FIELD: encode(msg)})
        return entry_id.decode()

    async def dead_letter(self, stream: str, entry_id: str, payload: bytes, reason: str) -> None:
        log.warning("dead-letter %s %s: %s", stream, entry_id, reason)
        letter = DeadLetter(source_stream=stream, entry_id=entry_id, service=self.service,
                            reason=reason, payload=payload)
        await self.redis.xadd(self.streams.deadletter, {FIELD: encode(letter)})

    # --- consuming ----------------------------------------------------------
    async def ensure_group(self, stream: str, group: str, start: str = "0") -> None:
        try:
            await self.redis.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

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
        f = self.flow(stream)
        await self.ensure_group(stream, group, start)
        sem = asyncio.Semaphore(concurrency)
        tasks: set[asyncio.Task[None]] = set()
        working: set[bytes] = set()  # entries this consumer is handling now: never reclaim those
        pending_id: str | None = "0"  # first our own pending entries (a restart), then new ones
        next_claim = 0.0
        while not stop.is_set():
            entries: list[tuple[bytes, dict[bytes, bytes]]] = []
            if time.monotonic() >= next_claim:
                entries = await self._autoclaim(stream, group, consumer, claim_idle_ms, count)
                next_claim = time.monotonic() + max(claim_idle_ms / 2000, 0.05)
            if not entries:
                read_id = pending_id or ">"
                resp = await self.redis.xreadgroup(group, consumer, {stream: read_id}, count=count,
                                                   block=None if pending_id else block_ms)
                entries = resp[0][1] if resp else []
                if pending_id and not entries:
                    pending_id = None
                elif pending_id:
                    pending_id = entries[-1][0].decode()
            for entry_id, fields in entries:
                if entry_id in working:
                    continue
                job = self._handle(stream, group, entry_id.decode(), fields, f, handler, max_deliveries)
                if concurrency == 1:
                    await job
                    continue
                await sem.acquire()
                working.add(entry_id)
                task = asyncio.create_task(job)
                tasks.add(task)
                task.add_done_callback(
                    lambda t, e=entry_id: (tasks.discard(t), working.discard(e), sem.release()))
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _autoclaim(self, stream: str, group: str, consumer: str, idle_ms: int,
                         count: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        resp = await self.redis.xautoclaim(stream, group, consumer, min_idle_time=idle_ms,
                                           start_id="0-0", count=count)
        claimed = [(eid, fields) for eid, fields in resp[1] if fields is not None]
        if claimed:
            log.info("%s reclaimed %d pending entries of %s", consumer, len(claimed), stream)
        return claimed

    async def _deliveries(self, stream: str, group: str, entry_id: str) -> int:
        info = await self.redis.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
        return int(info[0]["times_delivered"]) if info else 1

    async def _handle(self, stream: str, group: str, entry_id: str, fields: dict[bytes, bytes],
                      f: Flow, handler: Handler, max_deliveries: int) -> None:
        raw = fields.get(FIELD)
        if raw is None:
            await self.dead_letter(stream, entry_id, b"", f"entry has no {FIELD.decode()!r} field")
            await self.redis.xack(stream, group, entry_id)
            return
        try:
            msg = decode(raw, f.message)
        except (ValueError, ValidationError) as exc:
            await self.dead_letter(stream, entry_id, raw, f"invalid {f.message_name}: {exc}")
            await self.redis.xack(stream, group, entry_id)
            return
        done_key = self.streams.done_set(stream, group)
        msg_id = getattr(msg, "id", entry_id)
        if await self.redis.sismember(done_key, msg_id):
            await self.redis.xack(stream, group, entry_id)
            return
        try:
            await handler(msg)
        except RetryLater as exc:
            log.info("leaving %s %s pending: %s", stream, entry_id, exc)
            return
        except asyncio.CancelledError:
            raise
        except (ValueError, ValidationError) as exc:  # the message itself is unusable
            await self.dead_letter(stream, entry_id, raw, f"rejected by {self.service}: {exc}")
        except Exception as exc:  # a failing message must not stop the service
            tries = await self._deliveries(stream, group, entry_id)
            if tries < max_deliveries:
                log.warning("handler failed on %s %s (delivery %d of %d), will retry: %r",
                            stream, entry_id, tries, max_deliveries, exc)
                return
            log.exception("handler failed on %s %s for the last time", stream, entry_id)
            await self.dead_letter(stream, entry_id, raw, f"processing failed in {self.service} after "
                                   f"{tries} deliveries: {type(exc).__name__}: {exc}")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(done_key, msg_id)
            pipe.expire(done_key, DONE_TTL_S)
            pipe.xack(stream, group, entry_id)
            await pipe.execute()

    # --- reading and housekeeping ------------------------------------------
    async def read_all(self, stream: str) -> list[Any]:
        """Every valid entry of ``stream`` as its flow's message type (invalid ones are skipped)."""
        model = self.flow(stream).message
        out: list[Any] = []
        for _, fields in await self.redis.xrange(stream):
            try:
                out.append(decode(fields[FIELD], model))
            except (KeyError, ValueError, ValidationError):
                continue
        return out

    async def trim_acknowledged(self, stream: str) -> int:
        """Trim entries that every group has acknowledged; returns entries removed."""
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError:
            return 0
        if not groups:
            return 0
        floor: tuple[int, int] | None = None
        for g in groups:
            name = g["name"]
            pending = await self.redis.xpending(stream, name)
            if pending["pending"]:
                cut = pending["min"]
            else:
                last = g["last-delivered-id"]
                ms, seq = (int(x) for x in (last.decode() if isinstance(last, bytes) else last).split("-"))
                cut = f"{ms}-{seq + 1}"
            cut_s = cut.decode() if isinstance(cut, bytes) else cut
            key = tuple(int(x) for x in cut_s.split("-"))
            floor = key if floor is None or key < floor else floor
        assert floor is not None
        return int(await self.redis.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))
