"""The group ledger against a real Redis: every group ends in exactly one state, and a group that
cannot complete (a dead-lettered sample, a lost one) is abandoned after ``run.group_timeout_s``."""

from __future__ import annotations

import asyncio
import time

from services.buffer.store import SampleStore
from services.common.bus import Bus
from services.contracts.codec import FIELD, encode
from services.contracts.messages import Sample
from services.coordinator.ledger import RESTARTED, GroupLedger
from tests.helpers import make_sample

TERMINAL = {"kept", "dropped", "abandoned"}


def sample(group: str, reward: float, size: int = 2, agent: str = "A", version: int = 0) -> Sample:
    return make_sample(group, reward, agent=agent, size=size, version=version, episode_id=f"e-{group}-{reward}")


async def consume_samples(bus: Bus, store: SampleStore) -> None:
    """The buffer's consumer (its real bus loop and store) until the samples stream is drained."""
    stop = asyncio.Event()

    async def on_sample(s: Sample) -> None:
        await store.add(s)

    task = asyncio.create_task(bus.consume(bus.streams.samples("A"), "buffer", "buffer-A", on_sample, stop,
                                           block_ms=50))
    for _ in range(200):
        await asyncio.sleep(0.05)
        if not await store.samples_waiting():
            break
    stop.set()
    await task


async def test_every_group_ends_in_exactly_one_state(redis_url: str) -> None:
    bus = Bus(redis_url, "t", "coordinator")
    ledger = GroupLedger(bus, ["A"])
    store = SampleStore(bus, "A", groups_per_batch=1, max_staleness=0, filter_zero_variance=True)
    for i, gid in enumerate(("kept", "flat", "lost", "timed-out", "playing", "late")):
        await ledger.launch(gid, i, {"A"})
    await ledger.emit("kept", [sample("kept", 1.0), sample("kept", 0.0)], {})
    await ledger.emit("flat", [sample("flat", 1.0), sample("flat", 1.0)], {})
    late = sample("late", 0.0)
    await ledger.emit("lost", [sample("lost", 1.0), sample("lost", 0.0)], {})
    await ledger.emit("late", [sample("late", 1.0), late], {})
    await ledger.abandon("timed-out", {"A"}, "timeout: still playing after 5s")
    stream = bus.streams.samples("A")  # the second sample of "lost" and of "late" never arrives (trimmed)
    entries = await bus.redis.xrange(stream)
    await bus.redis.xdel(stream, entries[5][0], entries[7][0])
    await consume_samples(bus, store)
    assert await store.abandon_overdue(60.0) == []  # not overdue yet
    abandoned = await store.abandon_overdue(60.0, now=time.time() + 61)
    assert {v.group_id for v in abandoned} == {"lost", "late"}
    assert all(v.outcome == "abandoned" and v.reason.startswith("timeout") for v in abandoned)
    assert await store.abandon_overdue(60.0, now=time.time() + 120) == []  # decided once
    # the late sample arrives after the abandonment: not stored, the verdict stays
    verdict = await store.add(late)
    assert verdict is not None and verdict.outcome == "abandoned"
    assert await bus.redis.hlen(store.k_samples) == 2  # only the kept group's samples remain
    # the kept group cannot be abandoned or kept again; a stale drop is its one allowed change
    assert (await store.decide("kept", "abandoned", "timeout")).outcome == "kept"
    outcomes = await GroupLedger(bus, ["A"]).restore()  # a restarted coordinator's view
    states = {gid: o.state for gid, o in outcomes["A"].items()}
    assert states == {"kept": "kept", "flat": "dropped", "lost": "abandoned", "timed-out": "abandoned",
                      "playing": "abandoned", "late": "abandoned"}
    assert outcomes["A"]["playing"].reason == RESTARTED
    assert outcomes["A"]["flat"].reason == "zero reward variance"
    assert set(states.values()) <= TERMINAL
    assert await bus.redis.zcard(bus.streams.groups_pending("A")) == 0
    await bus.close()


async def test_a_dead_lettered_sample_abandons_its_group_after_the_timeout(redis_url: str) -> None:
    bus = Bus(redis_url, "t", "buffer-A")
    ledger = GroupLedger(bus, ["A"])
    store = SampleStore(bus, "A", groups_per_batch=1, max_staleness=0)
    await ledger.launch("g", 0, {"A"})
    member = sample("g", 0.0)
    await ledger.emit("g", [sample("g", 1.0), member], {})
    stream = bus.streams.samples("A")
    await bus.redis.xdel(stream, (await bus.redis.xrange(stream))[1][0])
    bad = member.model_dump()
    bad["loss_mask"] = [0, 0, 0]  # the member arrives corrupt: fails validation at the buffer, dead-lettered at once
    await bus.redis.xadd(stream, {FIELD: encode(Sample.model_construct(**bad))})
    await consume_samples(bus, store)
    assert await bus.redis.xlen(bus.streams.deadletter) == 1
    assert await bus.redis.hget(store.k_verdicts, "g") is None  # incomplete: without the timeout, for good
    (verdict,) = await store.abandon_overdue(1.0, now=time.time() + 2)
    assert verdict.group_id == "g" and verdict.outcome == "abandoned"
    assert verdict.reason.startswith("dead-lettered sample: invalid Sample") and "loss_mask" in verdict.reason
    assert await bus.redis.hlen(store.k_samples) == 0
    await bus.close()


async def test_no_abandonment_while_samples_wait_in_the_stream(redis_url: str) -> None:
    bus = Bus(redis_url, "t", "buffer-A")
    ledger = GroupLedger(bus, ["A"])
    store = SampleStore(bus, "A", groups_per_batch=1, max_staleness=0)
    await bus.ensure_group(bus.streams.samples("A"), "buffer")
    await ledger.launch("g", 0, {"A"})
    await ledger.emit("g", [sample("g", 1.0), sample("g", 0.0)], {})  # the buffer was down past the timeout
    assert await store.samples_waiting()
    assert await store.abandon_overdue(1.0, now=time.time() + 10) == []
    await consume_samples(bus, store)
    assert (await bus.redis.hget(store.k_verdicts, "g")) == b"kept"
    await bus.close()
