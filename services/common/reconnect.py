"""Waiting out a Redis restart: which errors mean "Redis is unreachable", and a bounded exponential backoff."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 5.0
RECONNECT_WINDOW_S = 600.0  # how long a Bus waits for Redis to come back before it gives up
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)
log = logging.getLogger("tandem.bus")


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
            raise ConnectionError(f"{self.what}: Redis unreachable for {now - self.since:.0f}s: {exc!r}") from exc
        log.warning("%s: Redis unreachable (%r); retrying in %.2fs", self.what, exc, self.delay)
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, BACKOFF_MAX_S)

    def reset(self) -> None:
        if self.delay != BACKOFF_FIRST_S:
            log.info("%s: Redis is back", self.what)
        self.delay = BACKOFF_FIRST_S
