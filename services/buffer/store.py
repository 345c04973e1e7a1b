"""One agent's sample store in Redis: samples by id, groups by id, a ready queue.

One buffer process per agent (its consumer group reads with concurrency 1).

A sample is durable (HSET) before its stream entry is acknowledged, and
storing it twice is a no-op, so redelivery never duplicates. A group is
complete when ``group_size`` samples of it are stored; it is then kept
(pushed on the ready queue) or dropped (zero-variance filter). A batch takes
the ``groups_per_batch`` oldest ready groups, drops any that are staler than
``max_staleness`` for the step it trains towards, and is written to
``batches:{agent}`` in the same transaction that removes its samples.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.bus import Bus
from services.contracts.codec import FIELD, decode, encode
from services.contracts.messages import Batch, Sample


@dataclass
class GroupVerdict:
    group_id: str
    kept: bool
    reason: str = ""
    was_kept: bool = False  # dropped after an earlier "kept" verdict (stale at release)


class SampleStore:
    def __init__(self, bus: Bus, agent: str, groups_per_batch: int, max_staleness: int,
                 filter_zero_variance: bool = False, max_batches: int | None = None) -> None:
        self.bus, self.agent, self.max_batches = bus, agent, max_batches
        self.gpb, self.max_staleness, self.filter_zero_variance = groups_per_batch, max_staleness, filter_zero_variance
        s = bus.streams
        self.k_samples = s.buffer_samples(agent)
        self.k_ready = s.buffer_ready(agent)
        self.k_verdicts = s.key(f"buffer:{agent}:verdicts")  # group id -> "kept" or the drop reason
        self.k_released = s.key(f"buffer:{agent}:released")

    def k_group(self, group_id: str) -> str:
        return self.bus.streams.buffer_group(self.agent, group_id)

    async def add(self, sample: Sample) -> GroupVerdict | None:
        """Store a sample; return the group's verdict once the group is complete.

        Safe to repeat: storing is keyed by sample id, and the verdict of a group
        is decided once, recorded with the ready-queue push in one transaction,
        and returned again on a repeat (so a verdict event lost to a crash is
        re-sent on redelivery; the coordinator ignores duplicates)."""
        if sample.agent != self.agent:
            raise ValueError(f"sample of agent {sample.agent!r} reached the buffer of {self.agent!r}")
        r = self.bus.redis
        decided = await r.hget(self.k_verdicts, sample.group_id)
        if decided is not None:  # a redelivery after the verdict: store nothing, repeat the verdict
            reason = decided.decode()
            return GroupVerdict(sample.group_id, reason == "kept", "" if reason == "kept" else reason)
        async with r.pipeline(transaction=True) as pipe:
            pipe.hset(self.k_samples, sample.id, encode(sample))
            pipe.sadd(self.k_group(sample.group_id), sample.id)
            pipe.scard(self.k_group(sample.group_id))
            _, _, size = await pipe.execute()
        if size < sample.group_size:
            return None
        samples = await self.group_samples(sample.group_id)
        if self.filter_zero_variance and len({s.reward for s in samples}) == 1:
            await self.drop(sample.group_id, samples, "zero reward variance")
            return GroupVerdict(sample.group_id, False, "zero reward variance")
        async with r.pipeline(transaction=True) as pipe:
            pipe.hset(self.k_verdicts, sample.group_id, "kept")
            pipe.rpush(self.k_ready, sample.group_id)
            await pipe.execute()
        return GroupVerdict(sample.group_id, True)

    async def group_samples(self, group_id: str) -> list[Sample]:
        ids = sorted(await self.bus.redis.smembers(self.k_group(group_id)))
        raws = await self.bus.redis.hmget(self.k_samples, ids) if ids else []
        return [decode(raw, Sample) for raw in raws if raw is not None]

    async def drop(self, group_id: str, samples: list[Sample], reason: str) -> None:
        async with self.bus.redis.pipeline(transaction=True) as pipe:
            if samples:
                pipe.hdel(self.k_samples, *[s.id for s in samples])
            pipe.hset(self.k_verdicts, group_id, reason)
            pipe.delete(self.k_group(group_id))
            pipe.lrem(self.k_ready, 0, group_id)
            await pipe.execute()

    async def release(self) -> tuple[list[Batch], list[GroupVerdict]]:
        """Release every batch that can be formed now; return them and stale drops."""
        r = self.bus.redis
        batches: list[Batch] = []
        dropped: list[GroupVerdict] = []
        while await r.llen(self.k_ready) >= self.gpb:
            released = int(await r.get(self.k_released) or 0)
            if self.max_batches is not None and released >= self.max_batches:
                break  # the run's last step is trained; later samples stay stored, unused
            step = released + 1
            group_ids = [g.decode() for g in await r.lrange(self.k_ready, 0, self.gpb - 1)]
            groups = {g: await self.group_samples(g) for g in group_ids}
            stale = [g for g, ss in groups.items()
                     if not ss or (step - 1) - min(s.min_weight_version for s in ss) > self.max_staleness]
            if stale:
                for g in stale:
                    await self.drop(g, groups[g], "stale")
                    dropped.append(GroupVerdict(g, False, "stale", was_kept=True))
                continue
            samples = [s for g in group_ids for s in groups[g]]
            batch = Batch(agent=self.agent, step=step, samples=samples)
            async with r.pipeline(transaction=True) as pipe:
                pipe.xadd(self.bus.streams.batches(self.agent), {FIELD: encode(batch)})
                pipe.ltrim(self.k_ready, self.gpb, -1)
                pipe.hdel(self.k_samples, *[s.id for s in samples])
                for g in group_ids:
                    pipe.delete(self.k_group(g))
                pipe.incr(self.k_released)
                await pipe.execute()
            batches.append(batch)
        return batches, dropped
