"""Bounded run state (issue 12, docs/architecture.md §2.2, §10): done-id sets pruned by the stream's retention,
a full Redis failing clearly, the AOF rewritten on a schedule, transcripts archived past a count per purpose."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis

from services.common.bus import Bus, RedisFull
from services.common.embedded_redis import EmbeddedRedis
from services.common.retention import DoneIds
from services.contracts.messages import Control
from services.coordinator.archive import TranscriptArchive, read_archive
from services.coordinator.dashboard.transcripts import tokens_key


async def consume_all(bus: Bus, stream: str, n: int) -> None:
    seen: list[str] = []
    stop = asyncio.Event()

    async def handler(msg: Control) -> None:
        seen.append(msg.id)
        if len(seen) == n:
            stop.set()

    await asyncio.wait_for(bus.consume(stream, "g", "c", handler, stop, count=64), 10)


async def test_done_ids_are_pruned_only_past_the_streams_retained_range(redis_url):
    bus = Bus(redis_url, "bounded", "test")
    stream = bus.streams.control
    for _ in range(20):
        await bus.publish(stream, Control(command="pause"))
    await consume_all(bus, stream, 20)
    key = bus.streams.done_set(stream, "g")
    assert await bus.redis.zcard(key) == 20
    assert await DoneIds(bus.redis, stream, key, grace_s=0).prune(force=True) == 0  # every entry still retained
    assert await bus.trim_acknowledged(stream) == 20
    # the entries are gone: none can be delivered again; within the grace window the ids stay
    assert await DoneIds(bus.redis, stream, key, grace_s=600).prune(force=True) == 0
    assert await DoneIds(bus.redis, stream, key, grace_s=0).prune(force=True) == 20
    assert await bus.redis.zcard(key) == 0
    await bus.close()


async def test_a_done_set_of_older_code_is_converted_and_still_counts(redis_url):
    bus = Bus(redis_url, "bounded2", "test")
    stream = bus.streams.control
    msg = Control(command="pause")
    await bus.redis.sadd(bus.streams.done_set(stream, "g"), msg.id)  # handled by older code
    await bus.publish(stream, msg)  # redelivered copy
    await bus.publish(stream, Control(command="resume"))
    ran: list[str] = []
    stop = asyncio.Event()

    async def handler(m: Control) -> None:
        ran.append(m.command)
        stop.set()

    await asyncio.wait_for(bus.consume(stream, "g", "c", handler, stop), 10)
    assert ran == ["resume"]
    assert await bus.redis.type(bus.streams.done_set(stream, "g")) == b"zset"
    await bus.close()


async def test_a_full_redis_is_a_clear_error_naming_maxmemory(tmp_path):
    with EmbeddedRedis(data_dir=tmp_path, appendonly=False, maxmemory_mb=1) as server:
        cfg = redis.Redis.from_url(server.url).config_get("*")
        assert cfg["maxmemory-policy"] == "noeviction" and int(cfg["maxmemory"]) == 1 << 20
        assert int(cfg["auto-aof-rewrite-percentage"]) == 100 and int(cfg["auto-aof-rewrite-min-size"]) > 0
        bus = Bus(server.url, "full", "test")
        with pytest.raises(RedisFull, match="maxmemory"):
            for _ in range(10_000):  # an empty server already uses about 1 MB
                await bus.publish(bus.streams.control, Control(command="pause", args={"pad": "x" * 1000}))
        await bus.close()


async def test_transcripts_past_the_kept_count_are_archived_compressed(redis_url, tmp_path):
    bus = Bus(redis_url, "bounded3", "test")
    archive = TranscriptArchive(bus, keep=3, run_dir=tmp_path, batch=2)
    ids = {p: [f"{p}-{i}" for i in range(10)] for p in ("train", "eval")}
    for i in range(10):
        for purpose in ("train", "eval"):
            eid = ids[purpose][i]
            await bus.redis.hset(bus.streams.episodes(), eid, json.dumps({"id": eid, "purpose": purpose}))
            await bus.redis.set(tokens_key(bus.streams.key, eid), json.dumps({"r": {"turns": []}}))
            await archive.add(eid, purpose)
    held = {k.decode() for k in await bus.redis.hkeys(bus.streams.episodes())}
    records = list(read_archive(tmp_path / "transcripts.jsonl.gz"))
    archived = [r["id"] for r in records]
    assert all(r["reply_tokens"] == {"r": {"turns": []}} for r in records)
    for eid in archived:  # the dashboard's tokens left Redis with the record
        assert not await bus.redis.exists(tokens_key(bus.streams.key, eid))
    for purpose in ("train", "eval"):
        kept = [e for e in ids[purpose] if e in held]
        assert 3 <= len(kept) <= 3 + 2 - 1 and kept == ids[purpose][-len(kept):]  # the newest stay
        assert [e for e in archived if e.startswith(purpose)] == ids[purpose][:-len(kept)]  # the rest, in order
    await archive.spill("train")
    assert len([k for k in await bus.redis.hkeys(bus.streams.episodes()) if k.startswith(b"train")]) == 3
    await bus.close()
