"""Waiting out a Redis restart or a full disk: which errors mean "Redis cannot serve us now", and a bounded
exponential backoff.

A Redis that cannot persist refuses every write with ``MISCONF`` (its AOF or snapshot failed: a full or
unwritable disk). That is a fault of the run, not of the service that met it: redis-py is told to raise it as
``DiskFull``, which is one of ``REDIS_DOWN``, so every service waits it out with the same backoff as a Redis
restart (the run pauses) and goes on when Redis can write again; the launcher names the disk (launcher/disk.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 5.0
RECONNECT_WINDOW_S = 600.0  # how long a Bus waits for Redis to come back before it gives up
log = logging.getLogger("tandem.bus")


class DiskFull(ResponseError, ConnectionError):
    """Redis refuses writes: it cannot persist (``MISCONF``: its disk is full or unwritable). Waited out like an
    unreachable Redis (a builtin ``ConnectionError``), never taken for a failure of the service that met it."""

    def __str__(self) -> str:
        return f"Redis cannot write to its disk (full or unwritable) and refuses writes: MISCONF {super().__str__()}"


BaseParser.EXCEPTION_CLASSES["MISCONF"] = DiskFull  # redis-py's table of error prefixes (every parser reads it)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)


class Backoff:
    """Bounded exponential backoff while Redis is unreachable; raises once it has been down ``window_s``."""

    def __init__(self, what: str, window_s: float) -> None:
        self.what, self.window_s = what, window_s
        self.delay, self.since = BACKOFF_FIRST_S, 0.0

    async def wait(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self.delay == BACKOFF_FIRST_S:
            self.since = now
        if now - self.since > self.window_s:
            raise ConnectionError(f"{self.what}: Redis unusable for {now - self.since:.0f}s: {exc}") from exc
        why = str(exc) if isinstance(exc, DiskFull) else f"Redis unreachable ({exc!r})"
        log.warning("%s: %s; retrying in %.2fs", self.what, why, self.delay)
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, BACKOFF_MAX_S)

    def reset(self) -> None:
        if self.delay != BACKOFF_FIRST_S:
            log.info("%s: Redis is back", self.what)
        self.delay = BACKOFF_FIRST_S
