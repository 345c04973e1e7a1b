"""The Redis Streams bus against a real server: dead-letter, reclaim, idempotency, trimming."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap

from services.common.bus import Bus
from services.contracts.codec import FIELD, encode
from services.contracts.messages import Control


async def _run_until(bus: Bus, stream: str, group: str, consumer: str, handler, stop: asyncio.Event,
                     **kw) -> asyncio.Task:
    return asyncio.create_task(bus.consume(stream, group, consumer, handler, stop, **kw))


async def test_malformed_entries_go_to_deadletter_and_consumer_goes_on(redis_url):
    bus = Bus(redis_url, "t", "test")
    stream = bus.streams.control
    seen: list[str] = []
    stop = asyncio.Event()

    async def handler(msg: Control) -> None:
        seen.append(msg.command)
        if msg.args.get("boom"):
            raise RuntimeError("handler exploded")
        if msg.args.get("reject"):
            raise ValueError("not for me")

    async def until_five_letters() -> None:
        for _ in range(500):  # polls the test's own observation, bounded
            if await bus.redis.xlen(bus.streams.deadletter) >= 5:
                break
            await asyncio.sleep(0.02)
        stop.set()

    await bus.redis.xadd(stream, {FIELD: b"\xc1not msgpack"})
    await bus.redis.xadd(stream, {"wrong": b"x"})
    await bus.redis.xadd(stream, {FIELD: encode(Control(command="pause")).replace(b"pause", b"pouse")})
    await bus.publish(stream, Control(command="pause"))
    await bus.publish(stream, Control(command="resume", args={"boom": True}))
    await bus.publish(stream, Control(command="checkpoint", args={"reject": True}))
    await bus.publish(stream, Control(command="stop"))
    watcher = asyncio.create_task(until_five_letters())
    await asyncio.wait_for(bus.consume(stream, "g", "c1", handler, stop, claim_idle_ms=50,
                                       max_deliveries=2, block_ms=50), 10)
    await watcher

    # a transient failure is retried (reclaimed once), then dead-lettered; a rejection is not retried
    assert seen == ["pause", "resume", "checkpoint", "stop", "resume"]
    letters = await bus.read_all(bus.streams.deadletter)
    reasons = [d.reason for d in letters]
    assert len(letters) == 5
    assert "not valid msgpack" in reasons[0]
    assert "no 'd' field" in reasons[1]
    assert "invalid Control" in reasons[2] and "command" in reasons[2]
    assert "rejected by test: not for me" in reasons[3]
    assert "handler exploded" in reasons[4] and "after 2 deliveries" in reasons[4]
    assert letters[0].payload == b"\xc1not msgpack" and letters[0].source_stream == stream
    pending = await bus.redis.xpending(stream, "g")
    assert pending["pending"] == 0
    await bus.close()


CRASHING_CONSUMER = textwrap.dedent("""
    import asyncio, sys
    from services.common.bus import Bus
    from services.contracts.messages import Control

    async def main():
        bus = Bus(sys.argv[1], "t", "doomed")
        async def handler(msg):
            await bus.redis.rpush("got", msg.id)     # read, effect not yet done...
            await asyncio.sleep(3600)                # ...and killed here, before the ack
        await bus.consume(bus.streams.control, "g", "doomed", handler, asyncio.Event())
    asyncio.run(main())
""")


async def test_killed_consumer_entry_is_reclaimed_and_effect_happens_once(redis_url):
    bus = Bus(redis_url, "t", "survivor")
    stream = bus.streams.control
    await bus.ensure_group(stream, "g")
    msgs = [Control(command="checkpoint", args={"n": i}) for i in range(3)]
    for m in msgs:
        await bus.publish(stream, m)
    doomed = await asyncio.create_subprocess_exec(sys.executable, "-c", CRASHING_CONSUMER, redis_url)
    try:
        for _ in range(200):
            if await bus.redis.llen("got") >= 1:
                break
            await asyncio.sleep(0.05)
        assert await bus.redis.llen("got") >= 1, "the doomed consumer never read"
    finally:
        doomed.send_signal(signal.SIGKILL)
        await doomed.wait()
    pending = await bus.redis.xpending(stream, "g")
    assert pending["pending"] >= 1  # read but never acknowledged

    stop = asyncio.Event()

    async def effect(msg: Control) -> None:
        await bus.redis.incr(f"effect:{msg.id}")
        if all([await bus.redis.get(f"effect:{m.id}") for m in msgs]):
            stop.set()

    await asyncio.wait_for(bus.consume(stream, "g", "survivor", effect, stop, claim_idle_ms=200), 15)
    for m in msgs:
        assert int(await bus.redis.get(f"effect:{m.id}")) == 1
    assert (await bus.redis.xpending(stream, "g"))["pending"] == 0

    # a duplicate delivery of an already-handled message (same id) has no second effect
    await bus.publish(stream, msgs[0])
    await bus.publish(stream, Control(command="stop"))
    stop2 = asyncio.Event()

    async def effect2(msg: Control) -> None:
        await effect(msg)
        if msg.command == "stop":
            stop2.set()

    await asyncio.wait_for(bus.consume(stream, "g", "survivor", effect2, stop2), 10)
    assert int(await bus.redis.get(f"effect:{msgs[0].id}")) == 1
    await bus.close()


async def test_trim_never_cuts_unacknowledged_entries(redis_url):
    bus = Bus(redis_url, "t", "trim")
    stream = bus.streams.control
    await bus.ensure_group(stream, "fast")
    await bus.ensure_group(stream, "slow")
    ids = [await bus.publish(stream, Control(command="pause")) for _ in range(5)]
    # "fast" reads and acks all; "slow" reads two and acks only the first
    fast = await bus.redis.xreadgroup("fast", "f", {stream: ">"})
    await bus.redis.xack(stream, "fast", *[e for e, _ in fast[0][1]])
    slow = await bus.redis.xreadgroup("slow", "s", {stream: ">"}, count=2)
    await bus.redis.xack(stream, "slow", slow[0][1][0][0])
    removed = await bus.trim_acknowledged(stream)
    assert removed == 1
    left = [e.decode() for e, _ in await bus.redis.xrange(stream)]
    assert left == ids[1:]
    await bus.close()
