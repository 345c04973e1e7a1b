"""The group ledger: every GRPO group, per agent that trains on it, ends in exactly one state.

States (``records.GroupState``): ``playing`` (launched; its episodes run in this coordinator) → ``emitted`` (its
samples are on ``samples:{agent}``) → the buffer's verdict ``kept`` | ``dropped:<reason>``
(zero variance; ``stale`` at release) | ``abandoned:<reason>`` (a dead-lettered sample, a
timeout in the buffer). A group that never reaches ``emitted`` is abandoned here, with its
reason: a timeout while playing, every episode failing, the agent never getting a turn, or
the coordinator restarting while it played.

One owner per fact: this ledger (``coord:ledger:{agent}``) holds what the coordinator
decides, the buffer's ``buffer_verdicts`` what the buffer decides; ``outcomes`` joins the
two. Emission is one transaction: every sample of the group, its ledger entries (with the ids
of the samples emitted, which the buffer takes as the group's membership and size rather than
trusting a sample's claim) and its place in the buffer's ``groups_pending`` — so a group is
emitted wholly or not at all, and a coordinator that dies knows exactly which groups no sample
of will ever arrive for.

Bounded (``prune``, docs/architecture.md §10): a group whose outcome can no longer change and whose
samples can no longer be trained leaves the ledger and the buffer's verdicts together, in one
transaction, after its outcome was appended (fsynced) to ``runs/<run>/ledger.<agent>.jsonl``;
``outcomes`` joins that archive with Redis, so a restart counts every group. Which groups: see ``prune``.

Why in-flight episodes are abandoned rather than re-run after a restart: an episode's
state (the environment, the token views) lives in the process that died; rebuilding it
would mean persisting every turn. Abandoning costs at most ``concurrent_episodes``
episodes, is accounted for with its reason, and the launch gate replaces the groups.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from services.common.bus import Bus
from services.common.history import append_jsonl, read_jsonl
from services.contracts.codec import FIELD, encode
from services.contracts.config import TandemConfig
from services.contracts.messages import Sample
from services.contracts.records import GroupState, LedgerEntry, Verdict

log = logging.getLogger("tandem.coordinator.ledger")
RESTARTED = "coordinator restarted while the group was playing"

# Delete archived groups from the ledger and the verdicts together, each only if its verdict is still the one
# archived ("" = none): one the buffer changed meanwhile stays, and the next prune archives it again.
# KEYS: ledger, verdicts (its entry in contracts/keys.py SCRIPTS); ARGV: group id, verdict, group id, verdict, ...
FORGET = """
local n = 0
for i = 1, #ARGV, 2 do
  local v = redis.call('HGET', KEYS[2], ARGV[i])
  if (v == false and ARGV[i + 1] == '') or v == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return n
"""


def horizons(cfg: TandemConfig) -> dict[str, int]:
    """Agent -> versions a group's outcome stays in Redis past its weight version (``GroupLedger.prune``)."""
    return {a: ac.max_staleness + 1 + max(cfg.run.state_kept_steps, ac.max_staleness + 4)
            for a, ac in cfg.agents.items()}


@dataclass
class GroupOutcome:
    """Where one agent's part of one group stands: its state, the reason, and (emitted) its mean reward."""

    group_id: str
    state: GroupState
    reason: str = ""
    at: float = 0.0
    reward: float | None = None

    @classmethod
    def of(cls, group_id: str, entry: LedgerEntry) -> GroupOutcome:
        return cls(group_id, entry.state, entry.reason or "", entry.at, entry.reward)

    def decided(self, verdict: Verdict) -> None:
        self.state, self.reason = verdict.state, verdict.reason


class GroupLedger:
    def __init__(self, bus: Bus, agents: list[str], archive_dir: Path | None = None,
                 horizons: dict[str, int] | None = None) -> None:
        """``archive_dir`` (the run directory) and ``horizons`` (agent -> versions a group's outcome is kept
        in Redis past its weight version, ``horizon``) enable ``prune``; without them nothing is pruned."""
        self.bus, self.agents = bus, agents
        self.k_launched = bus.streams.key("coord:groups_launched")  # every group index below: launched
        self.k_ahead = bus.streams.key("coord:groups_ahead")  # indices above it launched past a gated group
        self.archive_dir, self.horizons = archive_dir, horizons or {}
        self._forget = bus.redis.register_script(FORGET)

    def archive(self, agent: str) -> Path:
        assert self.archive_dir is not None
        return self.archive_dir / f"ledger.{agent}.jsonl"

    def key(self, agent: str) -> str:
        return self.bus.streams.group_ledger(agent)

    async def launch(self, group_id: str, index: int, agents: set[str], launched: int | None = None,
                     ahead: set[int] | None = None) -> None:
        """The group starts playing; in the same step the run's launched indices become ``launched`` (every
        index below it) and ``ahead`` (those above it; default: ``index + 1`` and none), so a restart launches
        each index once (repeatable: a Redis outage is waited out with the bus's backoff)."""
        entry = LedgerEntry(state=GroupState.PLAYING, at=time.time(), index=index).dump()

        async def write() -> None:
            async with self.bus.redis.pipeline(transaction=True) as pipe:
                for agent in sorted(agents):
                    pipe.hset(self.key(agent), group_id, entry)
                pipe.set(self.k_launched, index + 1 if launched is None else launched)
                pipe.delete(self.k_ahead)
                if ahead:
                    pipe.sadd(self.k_ahead, *sorted(ahead))
                await pipe.execute()

        await self.bus.retrying("launching a group", write)

    async def emit(self, group_id: str, samples: list[Sample], empty: dict[str, str]) -> dict[str, float]:
        """Publish the group's samples and record the emission, in one transaction; the agents in
        ``empty`` (agent -> reason) had no sample in it and are abandoned in the same step.

        Returns each emitted agent's mean reward in the group."""
        now = time.time()
        rewards: dict[str, list[float]] = {}
        ids: dict[str, list[str]] = {}
        versions: dict[str, int] = {}  # the oldest weight version a sample of the agent's part was played with
        s = self.bus.streams
        async with self.bus.redis.pipeline(transaction=True) as pipe:
            for sample in samples:
                pipe.xadd(s.samples(sample.agent), {FIELD: encode(sample)})
                rewards.setdefault(sample.agent, []).append(sample.reward)
                ids.setdefault(sample.agent, []).append(sample.id)
                versions[sample.agent] = min(versions.get(sample.agent, sample.min_weight_version),
                                             sample.min_weight_version)
            means = {a: sum(rs) / len(rs) for a, rs in rewards.items()}
            for agent, mean in means.items():  # the buffer's record of who is in the group (streams.group_ledger)
                entry = LedgerEntry(state=GroupState.EMITTED, at=now, reward=mean, samples=ids[agent],
                                    version=versions[agent])
                pipe.hset(self.key(agent), group_id, entry.dump())
                pipe.zadd(s.groups_pending(agent), {group_id: now})
            for agent, reason in empty.items():
                pipe.hset(self.key(agent), group_id,
                          LedgerEntry(state=GroupState.ABANDONED, at=now, reason=reason).dump())
            await pipe.execute()
        return means

    async def abandon(self, group_id: str, agents: set[str], reason: str) -> None:
        """Abandon a group that was never emitted (this coordinator decides; no buffer will)."""
        entry = LedgerEntry(state=GroupState.ABANDONED, at=time.time(), reason=reason).dump()
        for agent in sorted(agents):
            raw = await self.bus.redis.hget(self.key(agent), group_id)
            if raw is None or LedgerEntry.parse(raw).state is GroupState.PLAYING:  # an emitted group is the buffer's
                await self.bus.redis.hset(self.key(agent), group_id, entry)

    async def outcomes(self, agent: str) -> dict[str, GroupOutcome]:
        """Every group of ``agent``: the archived outcomes (``prune``), then the ledger's state, with the
        buffer's verdict where it gave one."""
        raw = await self.bus.redis.hgetall(self.key(agent))
        verdicts = {k.decode(): Verdict.parse(v)
                    for k, v in (await self.bus.redis.hgetall(self.bus.streams.buffer_verdicts(agent))).items()}
        out = {}
        if self.archive_dir is not None:
            for rec in await asyncio.to_thread(lambda: list(read_jsonl(self.archive(agent)))):
                out[rec["group_id"]] = GroupOutcome(rec["group_id"], GroupState(rec["state"]), rec.get("reason") or "",
                                                    rec.get("at") or 0.0, rec.get("reward"))
        for gid_b, value in raw.items():
            gid = gid_b.decode()
            o = GroupOutcome.of(gid, LedgerEntry.parse(value))
            if o.state is GroupState.EMITTED and gid in verdicts:
                o.decided(verdicts[gid])
            out[gid] = o
        return out

    async def restore(self) -> dict[str, dict[str, GroupOutcome]]:
        """Outcomes of every agent after a restart: groups that were playing in the process that died
        are abandoned now (their episodes are gone and none of their samples was published)."""
        out = {}
        for agent in self.agents:
            outcomes = await self.outcomes(agent)
            lost = {gid for gid, o in outcomes.items() if o.state is GroupState.PLAYING}
            for gid in lost:
                await self.abandon(gid, {agent}, RESTARTED)
                outcomes[gid].decided(Verdict(state=GroupState.ABANDONED, reason=RESTARTED))
            out[agent] = outcomes
        return out

    async def prune(self, agent: str) -> int:
        """Move the outcomes that are final and can no longer matter to the buffer or the trainer out of Redis
        (archive first, fsynced; then one transaction deletes the ledger entries with their verdicts). Returns
        how many left. A group ``g`` of weight version ``w`` (its samples' oldest) qualifies when

        * its outcome is final: abandoned here (never emitted, so no sample of it exists: the play was
          cancelled or failed, or its coordinator died, or the agent had no sample in an emission), or emitted
          with a verdict that is not ``kept``, or ``kept`` and released (its sample set is gone from the
          buffer: a released group's verdict changes only if its batch's step is skipped, which needs the
          version below);
        * its samples can no longer be trained: a batch training version ``v`` takes only groups with
          ``v - 1 - w <= max_staleness``, and the trainer has published ``P >= w + horizon`` with
          ``horizon = max_staleness + 1 + kept``, so every batch that could hold ``g`` was trained or skipped
          at least ``kept`` versions ago;
        * and what reaches the buffer later fails closed: a redelivered sample of a pruned group finds no
          ledger entry, is refused ("emitted no group") and dead-lettered, never stored or trained. The ledger
          entry and the verdict leave in one transaction, so a sample never finds the entry without the
          verdict (which would store it again)."""
        if self.archive_dir is None or agent not in self.horizons:
            return 0
        r, s = self.bus.redis, self.bus.streams
        published = int(await r.get(s.published_weight_version(agent)) or 0)
        entries = await r.hgetall(self.key(agent))
        verdicts = {k.decode(): v.decode() for k, v in (await r.hgetall(s.buffer_verdicts(agent))).items()}
        done: list[GroupOutcome] = []
        for gid_b, value in entries.items():
            gid = gid_b.decode()
            outcome = await self._final(agent, gid, LedgerEntry.parse(value), verdicts.get(gid), published)
            if outcome is not None:
                done.append(outcome)
        if not done:
            return 0
        done.sort(key=lambda o: o.at)
        lines = [json.dumps(asdict(o)).encode() for o in done]
        try:
            await asyncio.to_thread(append_jsonl, self.archive(agent), lines)
        except OSError as exc:  # a full or unwritable disk: the outcomes stay in Redis until a later prune
            log.warning("cannot archive group outcomes to %s: %r", self.archive(agent), exc)
            return 0
        args = [x for o in done for x in (o.group_id, verdicts.get(o.group_id, ""))]
        return int(await self._forget(keys=[self.key(agent), s.buffer_verdicts(agent)], args=args))

    async def _final(self, agent: str, gid: str, entry: LedgerEntry, raw_verdict: str | None,
                     published: int) -> GroupOutcome | None:
        """The group's outcome when ``prune`` may archive it (see there); None to keep it in Redis."""
        o = GroupOutcome.of(gid, entry)
        if o.state is GroupState.ABANDONED:
            return o
        if o.state is not GroupState.EMITTED or raw_verdict is None or entry.version is None:
            return None  # playing, undecided, or written before records carried a version: kept
        if entry.version + self.horizons[agent] > published:
            return None
        verdict = Verdict.parse(raw_verdict)
        if verdict.kept and await self.bus.redis.exists(self.bus.streams.buffer_group(agent, gid)):
            return None  # still in the ready queue (the buffer may yet drop it stale)
        o.decided(verdict)
        return o

    async def groups_launched(self) -> int:
        return int(await self.bus.redis.get(self.k_launched) or 0)

    async def launched_ahead(self) -> set[int]:
        return {int(i) for i in await self.bus.redis.smembers(self.k_ahead)}
