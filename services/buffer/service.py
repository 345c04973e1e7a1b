"""The buffer service: one handler (``on_sample``) over the agent's sample store (buffer/store.py).

A stored sample that completes its group gets the group's verdict (``group_done``); every batch
that can then be formed is released to ``batches:{agent}`` (``batch_released``), and groups found
stale at release are reported dropped.

A sample is checked against the coordinator's record of its group first (store.py ``vouch``): one the
coordinator never emitted (an unknown group, an id not among the group's members) is rejected alone and
its group, if any, goes on untouched. A member that claims a ``group_samples`` other than the record's, or
whose token ids fall outside the agent's vocabulary (its model's ``config.json``), is rejected alone
(``Reject``: dead-lettered with the reason); its group is abandoned at once and reported, so the
coordinator replaces it without waiting for the group timeout (docs/architecture.md §2.3).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.buffer.store import GroupVerdict, SampleStore, Unvouched
from services.common.bus import Bus, Reject
from services.common.tokens import ids_problem, vocab_size
from services.contracts.config import TandemConfig
from services.contracts.messages import BatchReleased, GroupDone, Sample

GROUP_CHECK_MAX_S = 5.0


class BufferService:
    """One agent's buffer. Build it, ``await release()`` once (a restart may find complete groups waiting),
    then wire ``on_sample``."""

    def __init__(self, cfg: TandemConfig, agent: str, bus: Bus) -> None:
        acfg = cfg.agents[agent]
        self.agent, self.bus = agent, bus
        self.log = logging.getLogger(f"tandem.buffer.{agent}")
        self.store = SampleStore(bus, agent, acfg.groups_per_batch, acfg.max_staleness, acfg.filter_zero_variance,
                                 max_batches=cfg.run.total_steps)
        self.group_timeout_s = cfg.run.group_timeout_s
        self.vocab = vocab_size(acfg.model_path)

    async def on_sample(self, sample: Sample) -> None:
        if sample.agent != self.agent:
            raise Reject(f"sample of agent {sample.agent!r} reached the buffer of {self.agent!r}")
        try:
            members = await self.store.vouch(sample)
        except Unvouched as exc:
            if exc.member:  # the group loses this member
                await self.reject(sample, str(exc))
            raise Reject(f"sample {sample.id} of group {sample.group_id}: {exc}") from None
        problem = ids_problem(sample.tokens, self.vocab, "tokens")
        if problem is not None:
            await self.reject(sample, problem)
        verdict = await self.store.add(sample, members)
        if verdict is not None:
            await self.report(verdict)
            await self.release()

    async def reject(self, sample: Sample, problem: str) -> None:
        """Abandon the sample's group now (reported once), then raise ``Reject`` for the sample alone."""
        verdict = await self.store.abandon(sample.group_id, f"dead-lettered sample: {problem}")
        if verdict is not None:
            self.log.warning("group %s abandoned: %s", verdict.group_id, verdict.reason)
            await self.report(verdict)
        raise Reject(f"sample {sample.id} of group {sample.group_id}: {problem}")

    async def release(self) -> None:
        batches, dropped = await self.store.release()
        for v in dropped:
            await self.report(v)
        for b in batches:
            self.log.info("released batch for version %d: %d samples", b.weight_version, len(b.samples))
            await self.bus.publish(self.bus.streams.events, BatchReleased(
                source=self.bus.service, agent=self.agent, weight_version=b.weight_version, samples=len(b.samples)))

    async def report(self, v: GroupVerdict) -> None:
        await self.bus.publish(self.bus.streams.events, GroupDone(
            source=self.bus.service, agent=self.agent, group_id=v.group_id, outcome=v.outcome,  # type: ignore[arg-type]
            reason=v.reason or None, was_kept=v.was_kept))

    async def abandon_overdue(self, stop: asyncio.Event) -> None:
        """The group timeout: a group still missing a sample ``run.group_timeout_s`` after it was emitted is
        abandoned (reported with its reason), so a dead-lettered sample never stalls the run. Its Redis calls
        wait out an outage with the bus's backoff (an outage is not the buffer's death)."""
        while not stop.is_set():
            overdue = await self.bus.retrying("group timeout", lambda: self.store.abandon_overdue(self.group_timeout_s))
            for v in overdue:
                self.log.warning("group %s abandoned: %s", v.group_id, v.reason)
                await self.report(v)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(GROUP_CHECK_MAX_S, self.group_timeout_s / 4))
