"""The events stream folded into the run state (the coordinator's ``on_event``), and the wait for engines.

Events notify; what they announce is read from its owner's record (facts.py: else Reject): a loaded
weight version (into the agent's state and its players' pool, players.py), a train step's metrics
(once per version; the learning-signal watch checks it), a skipped step, a rollout's load report (an
agent whose rollout reports a healthy engine is ready: no turn is sent before every agent is) and
the buffer's verdict on a group. Each change wakes whoever waits on ``changed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.common.bus import Bus
from services.contracts.config import TandemConfig
from services.contracts.messages import Event
from services.coordinator.facts import OwnerFacts
from services.coordinator.learning_signal import SignalWatch
from services.coordinator.players import Players
from services.coordinator.state import RunState, finite, train_step_entry

log = logging.getLogger("tandem.coordinator")

ENGINE_WAIT_S = 1800.0  # SGLang engines can take minutes to load a real model


class RunEvents:
    def __init__(self, cfg: TandemConfig, bus: Bus, state: RunState, players: Players,
                 changed: asyncio.Condition) -> None:
        self.agents, self.state, self.players, self.changed = list(cfg.agents), state, players, changed
        self.facts = OwnerFacts(bus, cfg.run.checkpoint_root)  # what events announce, read from the owners
        self.signal = SignalWatch(cfg)  # steps without learning signal
        self.engines_ready: set[str] = set()  # agents whose rollout reports a healthy engine

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def on_event(self, ev: Event) -> None:
        """Events notify; versions and step metrics come from their owners' records (facts.py: else Reject)."""
        fact = await self.facts.weights_loaded(ev) if ev.kind == "weights_loaded" else None
        if fact is not None and fact.path is not None:
            self.players.add_version(ev.agent, fact.version, fact.path)
        if ev.kind == "rollout_load" and ev.agent not in self.engines_ready and any(
                e.healthy for e in ev.engines):
            self.engines_ready.add(ev.agent)  # frozen agents too: they have no AgentState
            await self.notify()
        agent = self.state.agents.get(ev.agent)
        if agent is None:
            return
        if fact is not None:
            agent.loaded_weight_version = max(agent.loaded_weight_version, fact.version)
            if fact.version not in agent.loaded_weight_versions:
                agent.loaded_weight_versions.append(fact.version)
        elif ev.kind == "train_step" and all(t.get("weight_version") != ev.weight_version for t in agent.train_steps):
            entry = train_step_entry(await self.facts.train_step(ev))  # the committed record's metrics
            agent.train_steps.append({**finite(entry), "time": ev.created_at})  # once per version (re-sends)
            self.signal.check(self.state, ev.agent)  # no learning signal: warn, stop at the limit
        elif ev.kind == "train_step_skipped" and not agent.all_dropped(ev.group_ids):
            await self.facts.skipped(ev)  # the trainer's record of the skip, else Reject
            agent.skip_step(ev.group_ids, ev.reason)  # once per batch (re-sends find its groups dropped)
        elif ev.kind == "rollout_load":
            agent.rollout = ev.report()
        elif ev.kind == "group_done":
            agent.resolve_group(ev.group_id, ev.outcome, ev.reason or "")
        await self.notify()

    async def wait_for_engines(self, timeout: float = ENGINE_WAIT_S) -> None:  # noqa: ASYNC109 (gives up, logs)
        """No turn is sent before every agent's rollout reports a healthy engine (or the wait runs out)."""
        deadline = time.monotonic() + timeout
        async with self.changed:
            while not self.state.stop_requested and (missing := set(self.agents) - self.engines_ready):
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("no healthy engine reported for %s after %.0fs; starting anyway", missing, timeout)
                    return
                log.info("waiting for the engines of %s", ", ".join(sorted(missing)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), min(left, 30.0))
