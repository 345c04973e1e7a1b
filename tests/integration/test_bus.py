"""The Redis Streams bus against a real server: dead-letter, reclaim, idempotency, trimming."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable

from services.common.bus import Bus, RedisFull, Reject
from services.common.embedded_redis import EmbeddedRedis, free_port
from services.contracts.codec import FIELD, decode, encode
from services.contracts.messages import Control
from tests.helpers import read_all


async def _run_until(bus: Bus, stream: str, group: str, consumer: str, handler, stop: asyncio.Event,
                     **kw) -> asyncio.Task:
    return asyncio.create_task(bus.consume(stream, group, consumer, handler, stop, **kw))


async def _checkpoints_waiting(bus: Bus, n: int) -> tuple[str, list[Control]]:
    """``n`` checkpoint commands published on the control stream after its group ``g`` was made."""
    stream = bus.streams.control
    await bus.ensure_group(stream, "g")
    msgs = [Control(command="checkpoint", args={"n": i}) for i in range(n)]
    for m in msgs:
        await bus.publish(stream, m)
    return stream, msgs


def _recorder(field: str) -> tuple[list[str], Callable[[Control], Awaitable[None]]]:
    """A Control handler that records each message's ``field`` (``id`` or ``command``), and what it recorded."""
    seen: list[str] = []

    async def handler(msg: Control) -> None:
        seen.append(getattr(msg, field))

    return seen, handler


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
            raise Reject("not for me")
        if msg.args.get("bug"):
            raise ValueError("a bug inside the handler")

    async def until_five_letters() -> None:
        for _ in range(500):  # polls the test's own observation, bounded
            if await bus.redis.xlen(bus.streams.deadletter) >= 6:
                break
            await asyncio.sleep(0.02)
        stop.set()

    await bus.redis.xadd(stream, {FIELD: b"\xc1not msgpack"})
    await bus.redis.xadd(stream, {"wrong": b"x"})
    await bus.redis.xadd(stream, {FIELD: encode(Control(command="pause")).replace(b"pause", b"pouse")})
    await bus.publish(stream, Control(command="pause"))
    await bus.publish(stream, Control(command="resume", args={"boom": True}))
    await bus.publish(stream, Control(command="checkpoint", args={"reject": True}))
    await bus.publish(stream, Control(command="pause", args={"bug": True}))
    await bus.publish(stream, Control(command="stop"))
    watcher = asyncio.create_task(until_five_letters())
    await asyncio.wait_for(bus.consume(stream, "g", "c1", handler, stop, claim_idle_ms=50,
                                       max_deliveries=2, block_ms=50), 10)
    await watcher

    # a failure (a ValueError too) is retried (reclaimed once), then dead-lettered; a rejection is not retried
    assert seen[:5] == ["pause", "resume", "checkpoint", "pause", "stop"] and sorted(seen[5:]) == ["pause", "resume"]
    letters = await read_all(bus, bus.streams.deadletter)
    reasons = [d.reason for d in letters]
    assert len(letters) == 6
    assert "not valid msgpack" in reasons[0]
    assert "no 'd' field" in reasons[1]
    assert "invalid Control" in reasons[2] and "command" in reasons[2]
    assert "rejected by test: not for me" in reasons[3]
    assert sorted(reasons[4:]) == [
        "processing failed in test after 2 deliveries: RuntimeError: handler exploded",
        "processing failed in test after 2 deliveries: ValueError: a bug inside the handler"]
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
    stream, msgs = await _checkpoints_waiting(bus, 3)
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


async def test_bookkeeping_is_batched_per_read_and_duplicates_run_once(redis_url):
    bus = Bus(redis_url, "t", "batch")
    stream, msgs = await _checkpoints_waiting(bus, 32)
    await bus.publish(stream, msgs[3])  # the same message twice in one read: one effect, both acknowledged
    await bus.redis.config_resetstat()
    stop = asyncio.Event()
    effects: list[str] = []

    async def handler(msg: Control) -> None:
        effects.append(msg.id)
        if len(effects) == len(msgs):
            stop.set()

    await asyncio.wait_for(bus.consume(stream, "g", "c", handler, stop, count=64, concurrency=8), 10)
    assert sorted(effects) == sorted(m.id for m in msgs)
    assert (await bus.redis.xpending(stream, "g"))["pending"] == 0
    assert await bus.redis.zcard(bus.streams.done_set(stream, "g")) == len(msgs)
    stats = await bus.redis.info("commandstats")
    assert stats["cmdstat_zmscore"]["calls"] == 1  # one done-set check for the whole read
    assert stats["cmdstat_xack"]["calls"] < len(msgs) / 2  # acknowledged in bursts, not one by one
    assert "cmdstat_zscore" not in stats
    await bus.close()


async def test_the_pool_waits_for_a_connection_instead_of_failing(redis_url):
    bus = Bus(redis_url, "t", "pool", pool_size=2)
    stream = bus.streams.control
    clients: list[int] = []

    async def publish() -> str:
        clients.append(sum(c["name"] == "pool" for c in await bus.redis.client_list()))
        return await bus.publish(stream, Control(command="pause"))

    ids = await asyncio.gather(*(publish() for _ in range(200)))  # redis-py's own pool would raise past its cap
    assert len(set(ids)) == 200 and await bus.redis.xlen(stream) == 200
    assert max(clients) == 2
    await bus.close()


async def test_consumers_and_producers_carry_on_across_a_redis_restart(tmp_path):
    """A real Valkey with appendonly, killed and restarted on the same port and directory while a consume loop
    runs and a producer publishes: the loop carries on, and every message Redis acknowledged is handled. The
    default ``always`` makes that hold: under ``everysec`` a busy disk lets Valkey reply before it writes the
    AOF (up to 2 s), and a kill then loses acknowledged writes (docs/guides/recovery.md)."""
    port, data = free_port(), tmp_path / "valkey"
    server = EmbeddedRedis(port=port, data_dir=data, appendonly=True).start()
    bus = Bus(server.url, "t", "restart")
    stream, stop = bus.streams.control, asyncio.Event()
    seen, handler = _recorder("id")
    loop = asyncio.create_task(bus.consume(stream, "g", "c", handler, stop, block_ms=100, concurrency=4))
    first = [await bus.publish(stream, Control(command="pause", args={"n": i})) for i in range(20)]
    await until(lambda: len(seen) >= 20)
    server.proc.kill()  # SIGKILL: no shutdown, the AOF is what survives
    server.proc.wait()
    later = asyncio.create_task(publish_n(bus, stream, 20))  # published while Redis is down: waits, then lands
    await asyncio.sleep(1.0)
    assert not loop.done() and not later.done()
    server.restart()  # the same port, password and AOF
    try:
        await asyncio.wait_for(later, 30)
        await until(lambda: len(set(seen)) >= 40)
        assert not loop.done()
        await until_async(lambda: pending_is_zero(bus, stream))
        stop.set()
        await asyncio.wait_for(loop, 10)
        assert len(first) == 20 and len(set(seen)) == 40
        assert await bus.redis.zcard(bus.streams.done_set(stream, "g")) == 40
    finally:
        stop.set()
        await bus.close()
        server.stop()


async def test_a_consumer_whose_group_vanished_creates_it_again(redis_url):
    """Redis restarted without its data: the stream and the group are gone; the loop recreates them."""
    bus = Bus(redis_url, "t", "gone")
    stream, stop = bus.streams.control, asyncio.Event()
    seen, handler = _recorder("command")
    loop = asyncio.create_task(bus.consume(stream, "g", "c", handler, stop, block_ms=50))
    await bus.publish(stream, Control(command="pause"))
    await until(lambda: seen == ["pause"])
    await bus.redis.delete(stream)
    await asyncio.sleep(0.2)
    await bus.publish(stream, Control(command="resume"))
    await until(lambda: seen == ["pause", "resume"])
    assert not loop.done()
    stop.set()
    await asyncio.wait_for(loop, 10)
    await bus.close()


async def publish_n(bus: Bus, stream: str, n: int) -> None:
    for i in range(n):
        await bus.publish(stream, Control(command="resume", args={"n": i}))


async def pending_is_zero(bus: Bus, stream: str) -> bool:
    return (await bus.redis.xpending(stream, "g"))["pending"] == 0


async def until(cond, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def until_async(cond, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not await cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_the_publishes_of_one_tick_land_in_call_order_each_with_its_id(redis_url):
    """``publish`` pipelines the XADDs issued together (services/common/bus/adds.py): each caller still gets the id
    of its own entry, in the order of the calls."""
    bus = Bus(redis_url, "t", "adds")
    stream = bus.streams.control
    ids = await asyncio.gather(*(bus.publish(stream, Control(command="pause", args={"n": i})) for i in range(50)))
    entries = await bus.redis.xrange(stream)
    assert [e.decode() for e, _ in entries] == ids
    assert [decode(f[FIELD], Control).args["n"] for _, f in entries] == list(range(50))
    await bus.close()


async def test_a_full_redis_fails_each_pipelined_publish_clearly(tmp_path):
    with EmbeddedRedis(data_dir=tmp_path, appendonly=False, maxmemory_mb=1) as server:
        bus = Bus(server.url, "full", "test")
        big = Control(command="pause", args={"pad": "x" * 20_000})
        out = await asyncio.gather(*(bus.publish(bus.streams.control, big) for _ in range(200)),
                                   return_exceptions=True)
        errors = [o for o in out if isinstance(o, BaseException)]
        assert errors and all(isinstance(e, RedisFull) and "maxmemory" in str(e) for e in errors)
        assert await bus.redis.xlen(bus.streams.control) == len(out) - len(errors)
        await bus.close()
