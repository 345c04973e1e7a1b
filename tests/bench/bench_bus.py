"""Bus benchmark: ``Bus.consume`` against plain redis-py XREADGROUP/XACK, side by side on one embedded Valkey.

Both arms decode every entry with the project codec (msgpack + pydantic) and run the same trivial handler.

* ``throughput_ratio_vs_raw``: messages per second of ``Bus.consume`` (concurrency 64, reads of 64) over a
  raw consumer with 64 concurrent handlers (XREADGROUP of 64, one XACK per read once its handlers are done),
  draining the same pre-filled stream; higher is better (goal >= 0.8). ``..._per_message_ack``: the same against a
  raw consumer that XACKs each entry after its handler.
* ``latency_ratio_vs_raw``: median time from publish to the handler, one message at a time (1 concurrent),
  ``Bus.publish`` + ``Bus.consume`` over XADD + blocking XREADGROUP + XACK, the two arms taking turns message by
  message; lower is better (goal <= 1.3).

Medians over ``rounds`` rounds, the arms alternating in order from round to round.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from services.common.bus import Bus
from services.common.embedded_redis import EmbeddedRedis
from services.contracts.codec import FIELD, decode, encode
from services.contracts.messages import GenerateRequest, SamplingParams

RUN, GROUP = "bench", "rollout"
CONCURRENT = 64


def request(i: int) -> GenerateRequest:
    return GenerateRequest(agent="A", episode_id=f"e{i}", group_id="g", turn=0, role="X", input_ids=list(range(32)),
                           sampling=SamplingParams(max_new_tokens=4), reply_stream="tandem:bench:replies:c")


async def fresh(r: aioredis.Redis, stream: str, n: int) -> None:
    """An empty stream with the group at its start, then ``n`` entries."""
    await r.delete(stream, f"{stream}:done:{GROUP}")
    await r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for start in range(0, n, 500):
        async with r.pipeline(transaction=False) as pipe:
            for i in range(start, min(n, start + 500)):
                pipe.xadd(stream, {FIELD: encode(request(i))})
            await pipe.execute()


async def raw_throughput(url: str, stream: str, n: int, batched: bool) -> float:
    """64 concurrent handlers fed by XREADGROUP of 64; each handler XACKs its entry, or (``batched``) one XACK
    per read once its handlers are done."""
    r = aioredis.from_url(url)
    await fresh(r, stream, n)
    sem, handled = asyncio.Semaphore(CONCURRENT), 0

    async def handle(entry_id: bytes, raw: bytes) -> None:
        nonlocal handled
        try:
            decode(raw, GenerateRequest)
            await asyncio.sleep(0)
            if not batched:
                await r.xack(stream, GROUP, entry_id)
            handled += 1
        finally:
            sem.release()

    async def one_read(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        jobs = []
        for entry_id, fields in entries:
            await sem.acquire()
            jobs.append(asyncio.create_task(handle(entry_id, fields[FIELD])))
        await asyncio.gather(*jobs)
        if batched:
            await r.xack(stream, GROUP, *[e for e, _ in entries])

    start, reads = time.perf_counter(), []
    while handled < n:
        resp = await r.xreadgroup(GROUP, "raw", {stream: ">"}, count=CONCURRENT, block=10)
        if resp:
            reads.append(asyncio.create_task(one_read(resp[0][1])))
        else:
            await asyncio.sleep(0)
    elapsed = time.perf_counter() - start
    await asyncio.gather(*reads)
    await r.aclose()
    return n / elapsed


async def bus_throughput(url: str, stream: str, n: int) -> float:
    bus = Bus(url, RUN, "bench")
    await fresh(bus.redis, stream, n)
    stop, handled, finished = asyncio.Event(), 0, 0.0

    async def handler(_: GenerateRequest) -> None:
        nonlocal handled, finished
        await asyncio.sleep(0)
        handled += 1
        if handled == n:
            finished = time.perf_counter()
            stop.set()

    start = time.perf_counter()
    await asyncio.wait_for(bus.consume(stream, GROUP, "bus", handler, stop, concurrency=CONCURRENT,
                                       count=CONCURRENT, block_ms=100), 60)
    await bus.close()
    return n / (finished - start)


class RawConsumer:
    """Plain redis-py at 1 concurrent: blocking XREADGROUP of one entry, decode, handler, XACK."""

    def __init__(self, url: str, stream: str, seen: asyncio.Queue[float]) -> None:
        self.r, self.stream, self.seen, self.stop = aioredis.from_url(url), stream, seen, asyncio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            resp = await self.r.xreadgroup(GROUP, "raw", {self.stream: ">"}, count=1, block=100)
            for entry_id, fields in resp[0][1] if resp else []:
                decode(fields[FIELD], GenerateRequest)
                self.seen.put_nowait(time.perf_counter())
                await self.r.xack(self.stream, GROUP, entry_id)

    async def send(self, i: int) -> None:
        await self.r.xadd(self.stream, {FIELD: encode(request(i))})


async def one(send: Callable[[int], Awaitable[object]], seen: asyncio.Queue[float], i: int) -> float:
    t0 = time.perf_counter()
    await send(i)
    return await asyncio.wait_for(seen.get(), 10) - t0


async def latency(url: str, sends: int) -> tuple[float, float]:
    """Median publish-to-handler time of each arm (seconds); the arms take turns message by message, so both
    see the same load on the machine."""
    raw_seen: asyncio.Queue[float] = asyncio.Queue()
    bus_seen: asyncio.Queue[float] = asyncio.Queue()
    raw = RawConsumer(url, f"tandem:{RUN}:turns:R", raw_seen)
    bus, stop = Bus(url, RUN, "bench"), asyncio.Event()
    bus_stream = f"tandem:{RUN}:turns:B"
    await fresh(raw.r, raw.stream, 0)
    await fresh(bus.redis, bus_stream, 0)

    async def handler(_: GenerateRequest) -> None:
        bus_seen.put_nowait(time.perf_counter())

    tasks = [asyncio.create_task(raw.run()),
             asyncio.create_task(bus.consume(bus_stream, GROUP, "bus", handler, stop, block_ms=100))]
    out: dict[str, list[float]] = {"raw": [], "bus": []}
    for i in range(sends):
        for arm in (("raw", "bus") if i % 2 == 0 else ("bus", "raw")):
            if arm == "raw":
                out[arm].append(await one(raw.send, raw_seen, i))
            else:
                out[arm].append(await one(lambda n: bus.publish(bus_stream, request(n)), bus_seen, i))
            await asyncio.sleep(0.002)  # let each arm's acknowledgement settle before the next message
    raw.stop.set()
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    await raw.r.aclose()
    await bus.close()
    return statistics.median(out["raw"]), statistics.median(out["bus"])


async def measure(url: str, messages: int, sends: int, rounds: int) -> dict[str, float]:
    stream = f"tandem:{RUN}:turns:A"
    arms: dict[str, list[float]] = {"raw_msgs_per_s": [], "raw_per_message_ack_msgs_per_s": [],
                                    "bus_msgs_per_s": [], "raw_latency_ms": [], "bus_latency_ms": []}
    for k in range(rounds):
        order = ("raw", "raw_per_message_ack", "bus") if k % 2 == 0 else ("bus", "raw_per_message_ack", "raw")
        for arm in order:
            rate = (await bus_throughput(url, stream, messages) if arm == "bus" else
                    await raw_throughput(url, stream, messages, batched=arm == "raw"))
            arms[f"{arm}_msgs_per_s"].append(rate)
        raw_s, bus_s = await latency(url, sends)
        arms["raw_latency_ms"].append(1e3 * raw_s)
        arms["bus_latency_ms"].append(1e3 * bus_s)
    out = {name: statistics.median(values) for name, values in arms.items()}
    out["throughput_ratio_vs_raw"] = out["bus_msgs_per_s"] / out["raw_msgs_per_s"]
    out["throughput_ratio_vs_raw_per_message_ack"] = out["bus_msgs_per_s"] / out["raw_per_message_ack_msgs_per_s"]
    out["latency_ratio_vs_raw"] = out["bus_latency_ms"] / out["raw_latency_ms"]
    out["rounds"] = rounds
    return out


def run(messages: int = 4000, sends: int = 400, rounds: int = 5) -> dict[str, float]:
    server = EmbeddedRedis(appendonly=False).start()
    try:
        return asyncio.run(measure(server.url, messages, sends, rounds))
    finally:
        server.stop()


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
