"""Which deliveries pay the done-set check (services/common/retention.py, "Which deliveries are checked"), against a
real server: first deliveries skip it; every copy of a message id the bus can make is still checked and runs once."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from services.common.bus import Bus
from services.common.bus.adds import AGAIN
from services.common.retention import RecentIds, entry_ms
from services.contracts.messages import Control
from tests.helpers import read_all


def recorder(stop_after: int) -> tuple[list[str], asyncio.Event, Any]:
    seen: list[str] = []
    stop = asyncio.Event()

    async def handler(msg: Control) -> None:
        seen.append(msg.id)
        if len(seen) >= stop_after:
            stop.set()

    return seen, stop, handler


async def consume_until(bus: Bus, stream: str, handler: Any, stop: asyncio.Event, **kw: Any) -> None:
    await asyncio.wait_for(bus.consume(stream, "g", "c", handler, stop, block_ms=50, **kw), 10)


async def zmscore_calls(bus: Bus) -> int:
    return int((await bus.redis.info("commandstats")).get("cmdstat_zmscore", {}).get("calls", 0))


async def test_first_deliveries_skip_the_done_set_and_redeliveries_check_it(redis_url: str) -> None:
    bus = Bus(redis_url, "t", "first")
    stream = bus.streams.control
    await bus.ensure_group(stream, "g")
    msgs = [Control(command="pause", args={"n": i}) for i in range(20)]
    for m in msgs:
        await bus.publish(stream, m)
    await bus.redis.config_resetstat()
    seen, stop, handler = recorder(len(msgs))
    await consume_until(bus, stream, handler, stop, count=8)
    assert seen == [m.id for m in msgs]
    assert await zmscore_calls(bus) == 0  # no entry could repeat an id: no round trip for the check
    assert await bus.redis.zcard(bus.streams.done_set(stream, "g")) == len(msgs)  # still recorded done

    # read but not acknowledged (a consumer that died), then handled elsewhere: the re-read pending copy is checked
    await bus.publish(stream, Control(command="resume"))
    [(_, [(entry_id, _)])] = await bus.redis.xreadgroup("g", "c", {stream: ">"}, count=1)
    resume_id = (await read_all(bus, stream))[-1].id
    await bus.redis.zadd(bus.streams.done_set(stream, "g"), {resume_id: entry_ms(entry_id)})
    await bus.publish(stream, Control(command="stop"))
    seen2, stop2, handler2 = recorder(1)
    await consume_until(bus, stream, handler2, stop2)
    assert resume_id not in seen2 and len(seen2) == 1
    assert await zmscore_calls(bus) == 1  # the pending re-read only
    assert (await bus.redis.xpending(stream, "g"))["pending"] == 0
    await bus.close()


class ReplyLostOnce:
    """The Redis client, except that the first XADD lands and then its reply is lost (the connection drops)."""

    def __init__(self, redis: Any) -> None:
        self.redis, self.lost = redis, False

    async def xadd(self, stream: str, fields: dict[bytes, bytes]) -> bytes:
        entry_id = await self.redis.xadd(stream, fields)
        if not self.lost:
            self.lost = True
            raise RedisConnectionError("reply lost")
        return entry_id


async def test_a_retried_publish_is_marked_and_its_copy_runs_once(redis_url: str) -> None:
    bus = Bus(redis_url, "t", "retry")
    stream = bus.streams.control
    await bus.ensure_group(stream, "g")
    bus.adds.redis = ReplyLostOnce(bus.redis)  # type: ignore[assignment]
    msg = Control(command="pause")
    await bus.publish(stream, msg)  # lands twice: the try whose reply was lost, and the retry
    entries = await bus.redis.xrange(stream)
    assert len(entries) == 2
    assert AGAIN not in entries[0][1] and entries[1][1][AGAIN] == b"1"

    # handled once, whether both copies reach one consumer or the copy reaches a consumer that knows nothing
    await bus.publish(stream, Control(command="stop"))
    seen, stop, handler = recorder(2)
    await consume_until(bus, stream, handler, stop, count=1)
    assert seen.count(msg.id) == 1

    fresh = Bus(redis_url, "t", "retry-2")
    await fresh.redis.xadd(stream, entries[1][1])  # the marked copy again, to a loop with no memory of msg
    await fresh.publish(stream, Control(command="stop"))
    seen2, stop2, handler2 = recorder(1)
    await consume_until(fresh, stream, handler2, stop2)
    assert msg.id not in seen2
    assert (await bus.redis.xpending(stream, "g"))["pending"] == 0
    await bus.close()
    await fresh.close()


async def test_republished_and_replayed_ids_run_once(redis_url: str) -> None:
    """The same message object published again is marked by its Bus; an entry copied byte for byte onto the
    stream (not through a Bus) is absorbed by the consume loop that handled it."""
    bus = Bus(redis_url, "t", "replay")
    stream = bus.streams.control
    await bus.ensure_group(stream, "g")
    msg = Control(command="pause")
    await bus.publish(stream, msg)
    seen, stop, handler = recorder(3)
    loop = asyncio.create_task(bus.consume(stream, "g", "c", handler, stop, block_ms=50))
    await bus.publish(stream, msg)
    [_, (_, fields)] = await bus.redis.xrange(stream)
    assert fields[AGAIN] == b"1"
    await bus.redis.xadd(stream, {k: v for k, v in fields.items() if k != AGAIN})
    await bus.publish(stream, Control(command="resume"))
    await bus.publish(stream, Control(command="stop"))
    await asyncio.wait_for(loop, 10)
    assert seen.count(msg.id) == 1 and len(seen) == 3
    await bus.close()


async def test_a_group_made_again_over_a_surviving_done_set_checks_every_entry(redis_url: str) -> None:
    bus = Bus(redis_url, "t", "again")
    stream = bus.streams.control
    await bus.ensure_group(stream, "g")
    msgs = [Control(command="pause") for _ in range(3)]
    for m in msgs:
        await bus.publish(stream, m)
    seen, stop, handler = recorder(3)
    await consume_until(bus, stream, handler, stop)
    await bus.redis.xgroup_destroy(stream, "g")  # the group is lost; the stream and the done set are not
    await bus.publish(stream, Control(command="stop"))
    seen2, stop2, handler2 = recorder(1)
    fresh = Bus(redis_url, "t", "again-2")
    await consume_until(fresh, stream, handler2, stop2)
    assert not set(seen2) & {m.id for m in msgs} and len(seen2) == 1
    await bus.close()
    await fresh.close()


def test_recent_ids_forget_the_oldest_first() -> None:
    recent = RecentIds(size=3)
    recent.add(["a", "b", "c"])
    recent.add(["a", "d"])  # "a" is refreshed; "b" is the oldest now
    assert "b" not in recent and all(x in recent for x in "acd")
    assert len(recent.ids) == 3
