"""The buffer service: one handler (``on_sample``) over the agent's sample store (buffer/store.py).

A stored sample that completes its group gets the group's verdict (``group_done``); every batch
that can then be formed is released to ``batches:{agent}`` (``batch_released``), and groups found
stale at release are reported dropped.
"""

from __future__ import annotations

import logging

from services.buffer.store import GroupVerdict, SampleStore
from services.common.bus import Bus, Reject
from services.contracts.config import TandemConfig
from services.contracts.messages import BatchReleased, GroupDone, Sample


class BufferService:
    """One agent's buffer. Build it, ``await release()`` once (a restart may find complete groups waiting),
    then wire ``on_sample``."""

    def __init__(self, cfg: TandemConfig, agent: str, bus: Bus) -> None:
        acfg = cfg.agents[agent]
        self.agent, self.bus = agent, bus
        self.log = logging.getLogger(f"tandem.buffer.{agent}")
        self.store = SampleStore(bus, agent, acfg.groups_per_batch, acfg.max_staleness, acfg.filter_zero_variance,
                                 max_batches=cfg.run.total_steps)

    async def on_sample(self, sample: Sample) -> None:
        if sample.agent != self.agent:
            raise Reject(f"sample of agent {sample.agent!r} reached the buffer of {self.agent!r}")
        verdict = await self.store.add(sample)
        if verdict is not None:
            await self.report(verdict)
            await self.release()

    async def release(self) -> None:
        batches, dropped = await self.store.release()
        for v in dropped:
            await self.report(v)
        for b in batches:
            self.log.info("released batch for step %d: %d samples", b.step, len(b.samples))
            await self.bus.publish(self.bus.streams.events, BatchReleased(
                source=self.bus.service, agent=self.agent, step=b.step, samples=len(b.samples)))

    async def report(self, v: GroupVerdict) -> None:
        await self.bus.publish(self.bus.streams.events, GroupDone(
            source=self.bus.service, agent=self.agent, group_id=v.group_id, outcome="kept" if v.kept else "dropped",
            reason=v.reason or None, was_kept=v.was_kept))
