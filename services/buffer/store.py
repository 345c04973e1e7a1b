"""One agent's sample store in Redis: samples by id, groups by id, a ready queue, one verdict per group.

One buffer process per agent (its consumer group reads with concurrency 1).

A sample is durable (HSET) before its stream entry is acknowledged, and
storing it twice is a no-op, so redelivery never duplicates. Who is in a group is
the coordinator's record (its ledger entry, ``streams.group_ledger``: the ids of the samples
it emitted to this agent), never the sample's claim: a sample of a group the coordinator never
emitted here, or not among its members, or whose ``group_samples`` (the agent's share of the
group, not ``environment.group_size``) disagrees with the record, is refused (``Unvouched``;
docs/architecture.md §2.3). A group is complete when every member of it is stored; it is then kept
(pushed on the ready queue) or dropped (zero-variance filter). A batch takes
the ``groups_per_batch`` oldest ready groups, drops any that are staler than
``max_staleness`` for the step it trains towards, and is written to
``batches:{agent}`` in the same transaction that removes its samples.

Every group the coordinator emitted ends in exactly one verdict (the group ledger):
``kept``, ``dropped:<reason>`` (zero variance; ``stale`` at release, the one change a kept
group may still see) or ``abandoned:<reason>``. The first verdict is recorded with HSETNX in
one script with its effect (ready-queue push, or removal of the samples), so a late sample
and the timeout sweep can never both decide. A group still without a verdict
``group_timeout_s`` after its emission (``groups_pending``) is abandoned: a sample of it was
dead-lettered (the reason is taken from the dead-letter stream) or never arrived.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgpack

from services.common.bus import Bus
from services.contracts.codec import FIELD, decode, encode
from services.contracts.messages import Batch, DeadLetter, Sample
from services.contracts.records import GroupState, LedgerEntry, Verdict

# KEYS: verdicts, ready, samples, group set, pending (its entry in contracts/keys.py SCRIPTS);
# ARGV: group id, verdict (``Verdict.encode``), push (1/0), sample ids...
# Returns the verdict now on record (the earlier one when the group was already decided).
DECIDE = """
redis.call('ZREM', KEYS[5], ARGV[1])
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return redis.call('HGET', KEYS[1], ARGV[1]) end
if ARGV[3] == '1' then
  redis.call('RPUSH', KEYS[2], ARGV[1])
else
  for i = 4, #ARGV do redis.call('HDEL', KEYS[3], ARGV[i]) end
  redis.call('DEL', KEYS[4])
end
return ARGV[2]
"""


class Unvouched(ValueError):
    """A sample the coordinator's record does not vouch for. ``member``: its id is one the coordinator
    emitted in that group (so refusing it costs the group a member)."""

    def __init__(self, message: str, member: bool) -> None:
        super().__init__(message)
        self.member = member


def vouch(sample: Sample, members: list[str] | None, agent: str) -> list[str]:
    """The group's members as the coordinator recorded them, when ``sample`` is one of them and claims the
    recorded size; ``Unvouched`` naming the reason otherwise."""
    if members is None:
        raise Unvouched(f"the coordinator emitted no group {sample.group_id!r} to agent {agent!r}", member=False)
    if sample.id not in members:
        raise Unvouched(f"not one of the {len(members)} samples the coordinator emitted in the group",
                        member=False)
    if sample.group_samples != len(members):
        raise Unvouched(f"group_samples = {sample.group_samples} disagrees with the coordinator's record of the "
                        f"group ({len(members)} samples)", member=True)
    return members


@dataclass
class GroupVerdict:
    """A group's verdict as the buffer reports it (a ``group_done`` event)."""

    group_id: str
    outcome: GroupState  # kept | dropped | abandoned
    reason: str = ""
    was_kept: bool = False  # dropped after an earlier kept verdict (stale at release)

    @property
    def kept(self) -> bool:
        return self.outcome is GroupState.KEPT

    @classmethod
    def parse(cls, group_id: str, raw: str | bytes) -> GroupVerdict:
        verdict = Verdict.parse(raw)
        return cls(group_id, verdict.state, verdict.reason)


class SampleStore:
    def __init__(self, bus: Bus, agent: str, groups_per_batch: int, max_staleness: int,
                 filter_zero_variance: bool = False, max_batches: int | None = None) -> None:
        self.bus, self.agent, self.max_batches = bus, agent, max_batches
        self.gpb, self.max_staleness, self.filter_zero_variance = groups_per_batch, max_staleness, filter_zero_variance
        s = bus.streams
        self.k_samples = s.buffer_samples(agent)
        self.k_ready = s.buffer_ready(agent)
        self.k_verdicts = s.buffer_verdicts(agent)
        self.k_pending = s.groups_pending(agent)
        self.k_released = s.batches_released(agent)
        self.k_ledger = s.group_ledger(agent)
        self._decide = bus.redis.register_script(DECIDE)
        self.lock = asyncio.Lock()  # a sample's store-and-decide and the timeout sweep never interleave

    def k_group(self, group_id: str) -> str:
        return self.bus.streams.buffer_group(self.agent, group_id)

    async def decide(self, group_id: str, outcome: GroupState, reason: str = "",
                     samples: list[Sample] | None = None) -> GroupVerdict:
        """Record the group's first verdict with its effect; return the verdict on record."""
        verdict = Verdict(state=outcome, reason=reason)
        keys = [self.k_verdicts, self.k_ready, self.k_samples, self.k_group(group_id), self.k_pending]
        ids = [s.id for s in samples or []]
        got = await self._decide(keys=keys, args=[group_id, verdict.encode(), "1" if verdict.kept else "0", *ids])
        return GroupVerdict.parse(group_id, got if isinstance(got, bytes) else str(got))

    async def members(self, group_id: str) -> list[str] | None:
        """The ids of the samples the coordinator emitted to this agent in ``group_id`` (its ledger entry,
        written in the transaction that published them); None for a group it never emitted here."""
        raw = await self.bus.redis.hget(self.k_ledger, group_id)
        try:
            return LedgerEntry.parse(raw).samples if raw is not None else None
        except ValueError:  # not a ledger entry (pydantic's ValidationError is one): it vouches for nothing
            return None

    async def vouch(self, sample: Sample) -> list[str]:
        """``sample``'s group members from the coordinator's record; ``Unvouched`` when it is not one."""
        return vouch(sample, await self.members(sample.group_id), self.agent)

    async def add(self, sample: Sample, members: list[str] | None = None) -> GroupVerdict | None:
        """Store a sample; return the group's verdict once the group is complete.

        The group's ``members`` are the coordinator's record (read here when not given); a sample it does
        not vouch for raises ``Unvouched`` and is not stored.

        Safe to repeat: storing is keyed by sample id, and the verdict of a group
        is decided once, recorded with the ready-queue push in one script,
        and returned again on a repeat (so a verdict event lost to a crash is
        re-sent on redelivery; the coordinator ignores duplicates). A sample of a
        group already decided (say, abandoned) is not stored."""
        if sample.agent != self.agent:
            raise ValueError(f"sample of agent {sample.agent!r} reached the buffer of {self.agent!r}")
        members = vouch(sample, members, self.agent) if members is not None else await self.vouch(sample)
        async with self.lock:
            return await self._add(sample, len(members))

    async def _add(self, sample: Sample, expected: int) -> GroupVerdict | None:
        r = self.bus.redis
        decided = await r.hget(self.k_verdicts, sample.group_id)
        if decided is not None:  # a redelivery after the verdict: store nothing, repeat the verdict
            return GroupVerdict.parse(sample.group_id, decided)
        async with r.pipeline(transaction=True) as pipe:
            pipe.hset(self.k_samples, sample.id, encode(sample))
            pipe.sadd(self.k_group(sample.group_id), sample.id)
            pipe.scard(self.k_group(sample.group_id))
            _, _, size = await pipe.execute()
        if size < expected:
            return None
        samples = await self.stored_samples(sample.group_id)
        if self.filter_zero_variance and len({s.reward for s in samples}) == 1:
            return await self.decide(sample.group_id, GroupState.DROPPED, "zero reward variance", samples)
        return await self.decide(sample.group_id, GroupState.KEPT)

    async def stored_samples(self, group_id: str) -> list[Sample]:
        ids = sorted(await self.bus.redis.smembers(self.k_group(group_id)))
        raws = await self.bus.redis.hmget(self.k_samples, ids) if ids else []
        return [decode(raw, Sample) for raw in raws if raw is not None]

    async def drop(self, group_id: str, samples: list[Sample], reason: str) -> None:
        """Drop a group that was kept (stale at release): the one verdict that overwrites another."""
        async with self.bus.redis.pipeline(transaction=True) as pipe:
            if samples:
                pipe.hdel(self.k_samples, *[s.id for s in samples])
            pipe.hset(self.k_verdicts, group_id, Verdict(state=GroupState.DROPPED, reason=reason).encode())
            pipe.delete(self.k_group(group_id))
            pipe.lrem(self.k_ready, 0, group_id)
            await pipe.execute()

    # --- the group timeout --------------------------------------------------
    async def abandon_overdue(self, timeout_s: float, now: float | None = None) -> list[GroupVerdict]:
        """Abandon every emitted group still without a verdict ``timeout_s`` after its emission.

        Skipped while samples wait in the stream (undelivered or pending): a group waiting on them
        is slow, not stalled. A buffer that was down therefore stores what arrived first."""
        horizon = (time.time() if now is None else now) - timeout_s
        overdue = [g.decode() for g in await self.bus.redis.zrangebyscore(self.k_pending, "-inf", horizon)]
        if not overdue or await self.samples_waiting():
            return []
        letters = await self.dead_lettered_groups()
        out = []
        async with self.lock:
            for gid in overdue:
                reason = (f"dead-lettered sample: {letters[gid]}" if gid in letters
                          else f"timeout: incomplete {timeout_s:g}s after emission")
                verdict = await self.decide(gid, GroupState.ABANDONED, reason, await self.stored_samples(gid))
                if verdict.outcome is GroupState.ABANDONED and verdict.reason == reason:
                    out.append(verdict)
        return out

    async def abandon(self, group_id: str, reason: str) -> GroupVerdict | None:
        """Abandon an emitted group at once (a member was rejected): its stored samples are removed, samples
        still to come are not stored (the verdict is on record). Returns the verdict when this call made it;
        None for a group the coordinator never emitted or one already decided."""
        async with self.lock:
            if await self.bus.redis.zscore(self.k_pending, group_id) is None:
                return None
            verdict = await self.decide(group_id, GroupState.ABANDONED, reason, await self.stored_samples(group_id))
        return verdict if verdict.outcome is GroupState.ABANDONED and verdict.reason == reason else None

    async def samples_waiting(self) -> bool:
        """Entries of ``samples:{agent}`` the buffer's consumer group has not acknowledged yet."""
        stream = self.bus.streams.samples(self.agent)
        last = await self.bus.redis.xrevrange(stream, count=1)
        if not last:
            return False
        for g in await self.bus.redis.xinfo_groups(stream):
            if g["name"] in (b"buffer", "buffer"):
                delivered = g["last-delivered-id"]
                delivered = delivered.decode() if isinstance(delivered, bytes) else delivered
                return int(g["pending"]) > 0 or _id(delivered) < _id(last[0][0].decode())
        return True  # no consumer group yet: nothing was read

    async def dead_lettered_groups(self) -> dict[str, str]:
        """Group id -> reason, for this agent's samples on the dead-letter stream."""
        stream = self.bus.streams.samples(self.agent)
        out: dict[str, str] = {}
        for _, fields in await self.bus.redis.xrange(self.bus.streams.deadletter):
            try:
                letter = decode(fields[FIELD], DeadLetter)
                if letter.source_stream != stream:
                    continue
                payload = msgpack.unpackb(letter.payload, raw=False)
            except Exception:  # noqa: BLE001 (a letter we cannot read names no group)
                continue
            if isinstance(payload, dict) and isinstance(payload.get("group_id"), str):
                out[payload["group_id"]] = letter.reason
        return out

    # --- batches ------------------------------------------------------------
    async def release(self) -> tuple[list[Batch], list[GroupVerdict]]:
        """Release every batch that can be formed now; return them and stale drops."""
        r = self.bus.redis
        batches: list[Batch] = []
        dropped: list[GroupVerdict] = []
        while await r.llen(self.k_ready) >= self.gpb:
            released = int(await r.get(self.k_released) or 0)
            if self.max_batches is not None and released >= self.max_batches:
                break  # the run's last step is trained; later samples stay stored, unused
            version = released + 1  # the weight version the batch trains into
            group_ids = [g.decode() for g in await r.lrange(self.k_ready, 0, self.gpb - 1)]
            groups = {g: await self.stored_samples(g) for g in group_ids}
            stale = [g for g, ss in groups.items()
                     if not ss or (version - 1) - min(s.min_weight_version for s in ss) > self.max_staleness]
            if stale:
                for g in stale:
                    await self.drop(g, groups[g], "stale")
                    dropped.append(GroupVerdict(g, GroupState.DROPPED, "stale", was_kept=True))
                continue
            samples = [s for g in group_ids for s in groups[g]]
            batch = Batch(agent=self.agent, weight_version=version, samples=samples)
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


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
