"""The bus's consuming half: one ``Bus.consume`` loop (docs/architecture.md §2.2, delivery).

``ConsumeLoop`` reads a stream for a consumer group, checks the done set for the entries that can repeat a
message id, runs the handlers, and acknowledges completions in bursts; it survives Redis restarts. The delivery
rules are the bus's (services/common/bus/core.py); the done set and which deliveries are checked are
services/common/retention.py's.

Work in progress is never reclaimed: while an entry is being handled here, ``_keepalive`` resets its idle
time every third of ``claim_idle_ms`` (XCLAIM JUSTID: no delivery is counted), so neither this consumer's
XAUTOCLAIM nor another's takes it however long the handler runs. Only an entry whose consumer died (or
released it) idles long enough to be reclaimed: after the claim idle time, at least ``claim_idle_ms`` and
otherwise four times the slowest recent handling here (``services/common/latency.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ResponseError

from services.common.bus.adds import AGAIN
from services.common.bus.errors import Reject, RetryLater, full_error
from services.common.latency import LatencyWindow
from services.common.metrics import observed
from services.common.reconnect import REDIS_DOWN, Backoff
from services.common.retention import DoneIds, RecentIds
from services.contracts.codec import FIELD, decode
from services.contracts.flows import Flow
from services.contracts.streams import Streams

Handler = Callable[[Any], Awaitable[None]]
log = logging.getLogger("tandem.bus")

MAX_DELIVERIES = 3
CLOSE_FLUSH_S = 5.0  # at close, how long to try acknowledging what was handled


class BusPort(Protocol):
    """What a consume loop uses of its ``Bus`` (services/common/bus/core.py), which builds the loop."""

    redis: aioredis.Redis
    streams: Streams
    service: str
    reconnect_window_s: float

    def flow(self, stream: str) -> Flow: ...

    async def ensure_group(self, stream: str, group: str, start: str = "0") -> bool: ...

    async def deliveries(self, stream: str, group: str, entry_id: str) -> int: ...

    def letter(self, stream: str, entry_id: str, payload: bytes, reason: str) -> dict[bytes, bytes]: ...


@dataclass
class _Entry:
    entry_id: bytes
    raw: bytes
    msg: Any = None  # the decoded message; None when it could not be decoded
    msg_id: str = ""
    letter: str | None = None  # why it goes to the dead-letter stream
    again: bool = False  # its producer marked it: the message id may have been on the stream before
    owner: bool = False  # handled here: later entries with its message id are acknowledged with it


class ConsumeLoop:
    """One ``Bus.consume``: reads, batches the bookkeeping, runs the handlers, survives Redis restarts."""

    def __init__(self, bus: BusPort, stream: str, group: str, consumer: str, handler: Handler, concurrency: int,
                 count: int, block_ms: int, claim_idle_ms: int, start: str, max_deliveries: int) -> None:
        self.bus, self.r, self.stream, self.group, self.consumer = bus, bus.redis, stream, group, consumer
        self.flow, self.handler = bus.flow(stream), handler
        self.concurrency, self.count, self.block_ms, self.claim_idle_ms = concurrency, count, block_ms, claim_idle_ms
        self.start, self.max_deliveries = start, max_deliveries
        self.done = DoneIds(bus.redis, stream, bus.streams.done_set(stream, group), grace_s=bus.reconnect_window_s)
        self.recent = RecentIds()  # message ids handled and recorded done here lately
        self.check_all = False  # the group was made again over a stream that has a done set: check every entry
        self.sem = asyncio.Semaphore(concurrency)
        self.tasks: set[asyncio.Task[None]] = set()
        self.working: set[bytes] = set()  # read and not yet acknowledged here: never handle or reclaim twice
        self.inflight: dict[str, list[bytes]] = {}  # message id being handled -> later entries with that id
        self.completed: list[_Entry] = []  # handled (or to dead-letter), not yet acknowledged
        self.wake = asyncio.Event()
        self.closing = False
        self.handling = LatencyWindow()  # how long the handlers took lately: the reclaim idle time follows it

    def claim_idle(self) -> int:
        """Milliseconds an entry must idle before it is reclaimed: ``claim_idle_ms`` or 4 x the slowest handling."""
        return int(self.handling.bound(self.claim_idle_ms / 1000) * 1000)

    async def run(self, stop: asyncio.Event) -> None:
        backoff = Backoff(f"{self.bus.service} consuming {self.stream}", self.bus.reconnect_window_s)
        flusher = asyncio.create_task(self._flusher())
        keepalive = asyncio.create_task(self._keepalive())
        pending_id: str | None = "0"  # first our own pending entries (a restart), then new ones
        next_claim, fresh = 0.0, True
        try:
            while not stop.is_set():
                if flusher.done():  # it only ends early on an error it cannot wait out (RedisFull)
                    flusher.result()
                try:
                    if fresh:
                        await self._join()
                        fresh = False
                    entries: list[tuple[bytes, dict[bytes, bytes]]] = []
                    if time.monotonic() >= next_claim:
                        entries = await self._autoclaim()
                        next_claim = time.monotonic() + max(self.claim_idle() / 2000, 0.05)
                    redelivered = bool(entries) or pending_id is not None
                    if not entries:
                        entries, pending_id = await self._read(pending_id)
                    await self._dispatch(entries, redelivered)
                    backoff.reset()
                except REDIS_DOWN as exc:
                    await backoff.wait(exc)
                    pending_id, fresh = "0", True  # Redis may have restarted: re-ensure the group, re-read ours
                except ResponseError as exc:
                    if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                        raise full_error(exc) or exc  # noqa: B904 (RedisFull: exc is its context)
                    log.warning("%s: the group %s of %s is gone (Redis lost its data?); creating it again",
                                self.consumer, self.group, self.stream)
                    pending_id, fresh = "0", True
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)
        finally:
            keepalive.cancel()
            await asyncio.shield(self._close(flusher))

    async def _join(self) -> None:
        """Ensure the group; made again over a stream whose done set survived, every delivery is checked."""
        if await self.bus.ensure_group(self.stream, self.group, self.start) and await self.r.exists(self.done.key):
            self.check_all = True
        await self.done.migrate()

    async def _read(self, pending_id: str | None) -> tuple[list[tuple[bytes, dict[bytes, bytes]]], str | None]:
        resp = await self.r.xreadgroup(self.group, self.consumer, {self.stream: pending_id or ">"}, count=self.count,
                                       block=None if pending_id else self.block_ms)
        entries = resp[0][1] if resp else []
        if pending_id:
            pending_id = entries[-1][0].decode() if entries else None
        return entries, pending_id

    async def _autoclaim(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        resp = await self.r.xautoclaim(self.stream, self.group, self.consumer, min_idle_time=self.claim_idle(),
                                       start_id="0-0", count=self.count)
        claimed = [(eid, fields) for eid, fields in resp[1] if fields is not None and eid not in self.working]
        if claimed:
            log.info("%s reclaimed %d pending entries of %s", self.consumer, len(claimed), self.stream)
        return claimed

    async def _keepalive(self) -> None:
        """Reset the idle time of the entries being handled here, so that no consumer reclaims them meanwhile."""
        while True:  # every third of the floor: another consumer may have measured nothing yet
            await asyncio.sleep(max(self.claim_idle_ms / 3000, 0.02))
            ids = list(self.working)
            try:
                for i in range(0, len(ids), 1000):
                    await self.r.xclaim(self.stream, self.group, self.consumer, 0, ids[i:i + 1000], justid=True)
            except REDIS_DOWN:
                continue  # the consume loop waits Redis out; the entries stay ours meanwhile
            except ResponseError as exc:
                log.warning("%s: could not keep %d entries of %s alive: %s", self.consumer, len(ids), self.stream, exc)

    def _parse(self, entry_id: bytes, fields: dict[bytes, bytes]) -> _Entry:
        raw = fields.get(FIELD)
        if raw is None:
            return _Entry(entry_id, b"", letter=f"entry has no {FIELD.decode()!r} field")
        try:
            msg = decode(raw, self.flow.message)
        except (ValueError, ValidationError) as exc:
            return _Entry(entry_id, raw, letter=f"invalid {self.flow.message_name}: {exc}")
        return _Entry(entry_id, raw, msg, getattr(msg, "id", entry_id.decode()), again=AGAIN in fields)

    async def _which_done(self, valid: list[_Entry], redelivered: bool) -> list[bool]:
        """Whether each entry's message is done; only entries that can repeat an id ask Redis (one ZMSCORE)."""
        ask = [e.msg_id for e in valid if e.msg_id not in self.recent and (redelivered or e.again or self.check_all)]
        answers = dict(zip(ask, await self.done.which_done(ask), strict=True))
        return [e.msg_id in self.recent or answers.get(e.msg_id, False) for e in valid]

    async def _dispatch(self, entries: list[tuple[bytes, dict[bytes, bytes]]], redelivered: bool) -> None:
        """One read: parse, check the done set once, settle what needs no handler, run the handlers."""
        parsed = [self._parse(eid, fields) for eid, fields in entries if eid not in self.working]
        if not parsed:
            return
        valid = [e for e in parsed if e.letter is None]
        done = await self._which_done(valid, redelivered)
        self.working.update(e.entry_id for e in parsed)  # (after the check: if Redis fails there, none is held)
        settled = [e for e in parsed if e.letter is not None]
        todo: list[_Entry] = []
        for e, is_done in zip(valid, done, strict=True):
            if is_done:
                settled.append(e)
            elif e.msg_id in self.inflight:  # the same message twice at once: acknowledged with the first
                self.inflight[e.msg_id].append(e.entry_id)
            else:
                self.inflight[e.msg_id], e.owner = [], True
                todo.append(e)
        self.completed.extend(settled)
        if settled:
            self.wake.set()
        for e in todo:
            if self.concurrency == 1:
                await observed(self.stream, self.group, self._handle(e))
                continue
            await self.sem.acquire()
            task = asyncio.create_task(observed(self.stream, self.group, self._handle(e)))
            self.tasks.add(task)
            task.add_done_callback(lambda t: (self.tasks.discard(t), self.sem.release()))

    async def _handle(self, e: _Entry) -> None:
        """Run the handler; on success or a final failure the entry joins ``completed`` (acknowledged in a burst);
        otherwise it stays pending and is released for a later reclaim."""
        started = time.monotonic()
        try:
            await self.handler(e.msg)
            self.handling.add(time.monotonic() - started)
        except RetryLater as exc:
            log.info("leaving %s %s pending: %s", self.stream, e.entry_id.decode(), exc)
            return self._release(e)
        except asyncio.CancelledError:
            self._release(e)
            raise
        except Reject as exc:  # the message itself is unusable
            e.letter = f"rejected by {self.bus.service}: {exc}"
        except Exception as exc:  # a failing message must not stop the service
            if not await self._last_try(e, exc):
                return self._release(e)
        self.completed.append(e)
        self.wake.set()

    async def _last_try(self, e: _Entry, exc: Exception) -> bool:
        """Whether a failed entry has used up its deliveries (then it is marked for the dead-letter stream)."""
        if isinstance(exc, REDIS_DOWN):
            log.warning("Redis unreachable in the handler of %s %s; it stays pending", self.stream, e.entry_id)
            return False
        try:
            tries = await self.bus.deliveries(self.stream, self.group, e.entry_id.decode())
        except REDIS_DOWN:
            return False
        if tries < self.max_deliveries:
            log.warning("handler failed on %s %s (delivery %d of %d), will retry: %r",
                        self.stream, e.entry_id.decode(), tries, self.max_deliveries, exc)
            return False
        log.error("handler failed on %s %s for the last time", self.stream, e.entry_id.decode(), exc_info=exc)
        e.letter = (f"processing failed in {self.bus.service} after {tries} deliveries: "
                    f"{type(exc).__name__}: {exc}")
        return True

    def _release(self, e: _Entry) -> None:
        """Not acknowledged: forget it here, so a later reclaim handles it again (with its duplicates)."""
        self.working.discard(e.entry_id)
        self.working.difference_update(self.inflight.pop(e.msg_id, []) if e.owner else [])

    async def _flush(self) -> None:
        """Acknowledge every completed entry in one pipeline: dead letters, done-set adds, acks."""
        batch, self.completed = self.completed, []
        if not batch:
            return
        try:
            await self._settle(batch)
        except BaseException:
            self.completed[:0] = batch  # not acknowledged: kept for the next flush
            raise
        self.recent.add(e.msg_id for e in batch if e.msg_id)
        for e in batch:
            self.working.discard(e.entry_id)
            self.working.difference_update(self.inflight.pop(e.msg_id, []) if e.owner else [])

    async def _settle(self, batch: list[_Entry]) -> None:
        ids = [e.entry_id for e in batch] + [d for e in batch if e.owner for d in self.inflight.get(e.msg_id, [])]
        async with self.r.pipeline(transaction=True) as pipe:
            for e in batch:
                if e.letter is not None:
                    pipe.xadd(self.bus.streams.deadletter,
                              self.bus.letter(self.stream, e.entry_id.decode(), e.raw, e.letter))
            self.done.add(pipe, [(e.msg_id, e.entry_id) for e in batch if e.msg_id])
            pipe.xack(self.stream, self.group, *ids)
            try:
                await pipe.execute()
            except ResponseError as exc:
                raise full_error(exc) or exc  # noqa: B904 (RedisFull: exc is its context)
        await self.done.prune()

    async def _flusher(self) -> None:
        """Acknowledge, beside the reads and handlers, what completed while the previous burst was being
        acknowledged; returns once the loop is closing and nothing is left."""
        backoff = Backoff(f"{self.bus.service} acknowledging {self.stream}", self.bus.reconnect_window_s)
        while not (self.closing and not self.completed):
            await self.wake.wait()
            self.wake.clear()
            try:
                await self._flush()
                backoff.reset()
            except REDIS_DOWN as exc:
                await backoff.wait(exc)
                self.wake.set()

    async def _close(self, flusher: asyncio.Task[None]) -> None:
        """Acknowledge what is handled (waiting at most CLOSE_FLUSH_S for Redis); the rest is redelivered later."""
        self.closing = True
        self.wake.set()
        try:
            await asyncio.wait_for(flusher, CLOSE_FLUSH_S)
        except (TimeoutError, *REDIS_DOWN) as exc:
            log.warning("%s: %d handled entries left unacknowledged: %r", self.stream, len(self.completed), exc)
