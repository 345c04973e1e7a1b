"""Turn batching: the turns one bus read hands the rollout go to the router as one batch ``/generate``.

docs/architecture.md §5 (the rollout). The bus runs one handler task per turn of a read; each reaches
``TurnBatcher.generate`` within the same few event-loop ticks. The batcher waits until a tick brings
no new turn, then sends every waiting turn with the same sampling parameters (SGLang's router takes
one shared ``sampling_params`` per batch) and the same adapter (``lora_path``) as one call, split into
one chunk per healthy engine so the router still spreads them; a lone turn goes as a plain ``/generate``.
Each handler gets its own result or error back and acknowledges its own entry, so the bus's delivery
rules are per turn as before.

A call answered with a 4xx (one bad prompt fails a whole batch) is sent again one turn at a time, so
only the bad turn is rejected. An item whose reply is malformed fails alone; a call that fails as a
whole (router down, timeout) fails each of its turns, and their handlers retry as before.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import uuid
from collections.abc import Callable
from typing import Any

from services.rollout.engine_client import EngineClient, EngineClientError, GenerateResult

log = logging.getLogger("tandem.rollout")
MAX_SETTLE_TICKS = 8  # ticks to wait at most for the rest of a read's turns (each tick that brings none ends it)

_Waiting = tuple[list[int], str, "asyncio.Future[GenerateResult]"]


class TurnBatcher:
    """Collects the turns that arrive together and sends them as batch calls; ``max_batch`` bounds a call."""

    def __init__(self, client: EngineClient, engines: Callable[[], int], max_batch: int = 64) -> None:
        self.client, self.engines, self.max_batch = client, engines, max(1, max_batch)
        self.waiting: dict[str, tuple[dict[str, Any], str | None, list[_Waiting]]] = {}
        self.flushing: asyncio.Task[None] | None = None
        self.calls: set[asyncio.Task[None]] = set()
        self.prefix = uuid.uuid4().hex[:12]
        self.counter = itertools.count()
        self.batch_calls = self.batched_turns = self.lone_turns = 0  # for the log and the tests

    async def generate(self, input_ids: list[int], sampling: dict[str, Any], rid: str,
                       lora: str | None = None) -> GenerateResult:
        """This turn's result (under the adapter ``lora``, when given), from a batch call or on its own."""
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        key = json.dumps([sampling, lora], sort_keys=True)
        self.waiting.setdefault(key, (sampling, lora, []))[2].append((input_ids, rid, fut))
        if self.flushing is None or self.flushing.done():  # (done without running: cancelled at a loop's end)
            self.flushing = asyncio.create_task(self._flush_soon())
        return await fut

    def _count(self) -> int:
        return sum(len(items) for _, _, items in self.waiting.values())

    async def _flush_soon(self) -> None:
        seen = -1
        for _ in range(MAX_SETTLE_TICKS):
            if (n := self._count()) == seen or n >= self.max_batch:
                break
            seen = n
            await asyncio.sleep(0)
        waiting, self.waiting, self.flushing = self.waiting, {}, None
        for sampling, lora, items in waiting.values():
            for chunk in self._chunks(items):
                task = asyncio.create_task(self._send(sampling, lora, chunk))
                self.calls.add(task)
                task.add_done_callback(self.calls.discard)

    def _chunks(self, items: list[_Waiting]) -> list[list[_Waiting]]:
        """At most ``max_batch`` per call, and one call per healthy engine when there are enough turns."""
        per_call = min(self.max_batch, math.ceil(len(items) / max(1, self.engines())))
        return [items[i:i + per_call] for i in range(0, len(items), per_call)]

    async def _send(self, sampling: dict[str, Any], lora: str | None, chunk: list[_Waiting]) -> None:
        """Send one chunk; whatever happens, every turn in it gets its result or an error (never left waiting)."""
        try:
            await self._call(sampling, lora, chunk)
        except BaseException as exc:
            for _, _, fut in chunk:
                if not fut.done():
                    fut.set_exception(exc) if isinstance(exc, Exception) else fut.cancel()
            if not isinstance(exc, Exception):
                raise

    async def _call(self, sampling: dict[str, Any], lora: str | None, chunk: list[_Waiting]) -> None:
        live = [w for w in chunk if not w[2].done()]  # a cancelled handler (shutdown) is not sent
        if len(live) == 1:
            return await self._one(sampling, lora, live[0])
        if not live:
            return None
        rid = f"{self.prefix}-{next(self.counter):x}"
        try:
            results = await self.client.generate_batch([ids for ids, _, _ in live], sampling, rid, lora)
        except EngineClientError as exc:
            if exc.request_rejected:  # one bad prompt rejects the call: each alone, so only it is refused
                await asyncio.gather(*(self._one(sampling, lora, w) for w in live))
                return None
            return _settle(live, [exc] * len(live))
        self.batch_calls += 1
        self.batched_turns += len(live)
        return _settle(live, results)

    async def _one(self, sampling: dict[str, Any], lora: str | None, w: _Waiting) -> None:
        ids, rid, fut = w
        self.lone_turns += 1
        try:
            res: GenerateResult | EngineClientError = await self.client.generate(ids, sampling, rid, lora)
        except EngineClientError as exc:
            res = exc
        _settle([w], [res])

    async def aclose(self) -> None:
        """Cancel the calls in flight (their handlers are being cancelled too)."""
        log.info("turns sent: %d in %d batch calls, %d alone", self.batched_turns, self.batch_calls, self.lone_turns)
        for task in [*self.calls, *([self.flushing] if self.flushing else [])]:
            task.cancel()
        await asyncio.gather(*self.calls, return_exceptions=True)


def _settle(items: list[_Waiting], results: list[GenerateResult | EngineClientError]) -> None:
    for (_, _, fut), res in zip(items, results, strict=True):
        if fut.done():
            continue
        if isinstance(res, EngineClientError):
            fut.set_exception(res)
        else:
            fut.set_result(res)
