"""Backpressure: a bound on the rollout's in-flight generation requests that follows the fleet.

The bound is ``max_inflight_per_engine × healthy engines``, read at every admission, so it
shrinks while an engine is down (its share waits here, not in the router or a dead socket) and
grows when it is back. ``async with limiter:`` admits one request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType


class InflightLimiter:
    def __init__(self, capacity: Callable[[], int], recheck_s: float = 0.5) -> None:
        self.capacity = capacity
        self.inflight = 0
        self.waiting = 0
        self._cond = asyncio.Condition()
        self._recheck_s = recheck_s  # the capacity can grow without a release (an engine came back)

    async def __aenter__(self) -> InflightLimiter:
        async with self._cond:
            self.waiting += 1
            try:
                while self.inflight >= self.capacity():
                    try:
                        await asyncio.wait_for(self._cond.wait(), self._recheck_s)
                    except TimeoutError:
                        pass
            finally:
                self.waiting -= 1
            self.inflight += 1
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        async with self._cond:
            self.inflight -= 1
            self._cond.notify()
