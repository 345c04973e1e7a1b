"""The group ledger: every GRPO group, per agent that trains on it, ends in exactly one state.

States: ``playing`` (launched; its episodes run in this coordinator) → ``emitted`` (its
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

Why in-flight episodes are abandoned rather than re-run after a restart: an episode's
state (the environment, the token views) lives in the process that died; rebuilding it
would mean persisting every turn. Abandoning costs at most ``concurrent_episodes``
episodes, is accounted for with its reason, and the launch gate replaces the groups.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from services.common.bus import Bus
from services.contracts.codec import FIELD, encode
from services.contracts.messages import Sample
from services.contracts.streams import split_verdict

RESTARTED = "coordinator restarted while the group was playing"


@dataclass
class GroupOutcome:
    """Where one agent's part of one group stands: its state, the reason, and (emitted) its mean reward."""

    group_id: str
    state: str  # playing | emitted | kept | dropped | abandoned
    reason: str = ""
    at: float = 0.0
    reward: float | None = None


class GroupLedger:
    def __init__(self, bus: Bus, agents: list[str]) -> None:
        self.bus, self.agents = bus, agents
        self.k_launched = bus.streams.key("coord:groups_launched")

    def key(self, agent: str) -> str:
        return self.bus.streams.group_ledger(agent)

    async def launch(self, group_id: str, index: int, agents: set[str]) -> None:
        """The group starts playing; the run's group counter moves past ``index`` in the same step."""
        entry = json.dumps({"state": "playing", "at": time.time(), "index": index})
        async with self.bus.redis.pipeline(transaction=True) as pipe:
            for agent in sorted(agents):
                pipe.hset(self.key(agent), group_id, entry)
            pipe.set(self.k_launched, index + 1)
            await pipe.execute()

    async def emit(self, group_id: str, samples: list[Sample], empty: dict[str, str]) -> dict[str, float]:
        """Publish the group's samples and record the emission, in one transaction; the agents in
        ``empty`` (agent -> reason) had no sample in it and are abandoned in the same step.

        Returns each emitted agent's mean reward in the group."""
        now = time.time()
        rewards: dict[str, list[float]] = {}
        ids: dict[str, list[str]] = {}
        s = self.bus.streams
        async with self.bus.redis.pipeline(transaction=True) as pipe:
            for sample in samples:
                pipe.xadd(s.samples(sample.agent), {FIELD: encode(sample)})
                rewards.setdefault(sample.agent, []).append(sample.reward)
                ids.setdefault(sample.agent, []).append(sample.id)
            means = {a: sum(rs) / len(rs) for a, rs in rewards.items()}
            for agent, mean in means.items():  # the buffer's record of who is in the group (streams.group_ledger)
                entry = {"state": "emitted", "at": now, "reward": mean, "samples": ids[agent]}
                pipe.hset(self.key(agent), group_id, json.dumps(entry))
                pipe.zadd(s.groups_pending(agent), {group_id: now})
            for agent, reason in empty.items():
                pipe.hset(self.key(agent), group_id, json.dumps({"state": "abandoned", "at": now, "reason": reason}))
            await pipe.execute()
        return means

    async def abandon(self, group_id: str, agents: set[str], reason: str) -> None:
        """Abandon a group that was never emitted (this coordinator decides; no buffer will)."""
        entry = json.dumps({"state": "abandoned", "at": time.time(), "reason": reason})
        for agent in sorted(agents):
            raw = await self.bus.redis.hget(self.key(agent), group_id)
            if raw is None or json.loads(raw)["state"] == "playing":  # an emitted group is the buffer's
                await self.bus.redis.hset(self.key(agent), group_id, entry)

    async def outcomes(self, agent: str) -> dict[str, GroupOutcome]:
        """Every group of ``agent``: the ledger's state, with the buffer's verdict where it gave one."""
        raw = await self.bus.redis.hgetall(self.key(agent))
        verdicts = {k.decode(): v.decode()
                    for k, v in (await self.bus.redis.hgetall(self.bus.streams.buffer_verdicts(agent))).items()}
        out = {}
        for gid_b, value in raw.items():
            gid, rec = gid_b.decode(), json.loads(value)
            o = GroupOutcome(gid, rec["state"], rec.get("reason", ""), rec.get("at", 0.0), rec.get("reward"))
            if o.state == "emitted" and gid in verdicts:
                o.state, o.reason = split_verdict(verdicts[gid])
            out[gid] = o
        return out

    async def restore(self) -> dict[str, dict[str, GroupOutcome]]:
        """Outcomes of every agent after a restart: groups that were playing in the process that died
        are abandoned now (their episodes are gone and none of their samples was published)."""
        out = {}
        for agent in self.agents:
            outcomes = await self.outcomes(agent)
            lost = {gid for gid, o in outcomes.items() if o.state == "playing"}
            for gid in lost:
                await self.abandon(gid, {agent}, RESTARTED)
                outcomes[gid].state, outcomes[gid].reason = "abandoned", RESTARTED
            out[agent] = outcomes
        return out

    async def groups_launched(self) -> int:
        return int(await self.bus.redis.get(self.k_launched) or 0)
