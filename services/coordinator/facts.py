"""Events are notifications; the facts they announce are read from the service that owns them.

A ``weights_loaded`` event says "look at the rollout's loaded version": the version the coordinator
records is the rollout's ``loaded_weight_version`` key (written in the transaction after every engine
loaded a verified update, docs/architecture.md §2.3), and the path it adds to the opponent pool is the
trainer's train-log record of that version, never the event's. A ``train_step`` event says "look at the
trainer's log": the step's metrics are the committed record's (the one the trainer signed with the run's
secret), never the event's; a ``train_step_skipped`` is taken only when the trainer recorded that skip.
An event whose claim its owner's record does not back (a version the rollout
never recorded as loaded, a version the trainer never committed) is refused with ``Reject``: the bus
dead-letters it with the reason, and nothing in the run state moves.

The coordinator holds no weights secret (only trainers sign and rollouts verify), so it checks the
commit's presence and fields, not its HMAC; whoever can write the owners' keys can write Redis at will.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.bus import Bus, Reject
from services.common.history import read_train_log, train_log_archive
from services.common.weights_auth import committed
from services.contracts.messages import TrainStep, TrainStepSkipped, WeightsLoaded
from services.contracts.records import TrainLogRecord


@dataclass(frozen=True)
class LoadedFact:
    """What the rollout recorded: its loaded version, and the trainer's path of the event's version (or None)."""

    loaded: int
    version: int
    path: str | None


class OwnerFacts:
    """Reads the owners' records behind ``weights_loaded`` and ``train_step`` events (see the module doc)."""

    def __init__(self, bus: Bus, checkpoint_root: str | None) -> None:
        self.bus, self.checkpoint_root = bus, checkpoint_root

    async def record_of(self, agent: str, version: int) -> TrainLogRecord | None:
        """The trainer's commit of ``version``: the train log in Redis, else its archive on disk."""
        rec = await committed(self.bus.redis, self.bus.streams, agent, version)
        if rec is not None or self.checkpoint_root is None:
            return rec
        published = await self.bus.redis.get(self.bus.streams.published_weight_version(agent))
        if published is None or version > int(published):
            return None
        archive = train_log_archive(self.checkpoint_root, self.bus.streams.run, agent)
        records = await read_train_log(self.bus.redis, self.bus.streams, agent, archive)
        return next((r for r in records if r.weight_version == version), None)

    async def weights_loaded(self, ev: WeightsLoaded) -> LoadedFact:
        """The rollout's record behind the event; ``Reject`` when it never recorded that version as loaded."""
        raw = await self.bus.redis.get(self.bus.streams.loaded_weight_version(ev.agent))
        loaded = int(raw) if raw is not None else 0
        if ev.weight_version > loaded:
            raise Reject(f"weights_loaded of {ev.agent!r} version {ev.weight_version} from {ev.source!r} is not "
                         f"backed by the rollout's record (its loaded version is {loaded}): not taken")
        rec = await self.record_of(ev.agent, ev.weight_version) if ev.weight_version else None
        if ev.weight_version and rec is None:
            raise Reject(f"weights_loaded of {ev.agent!r} version {ev.weight_version} from {ev.source!r}: the "
                         "trainer never committed that version: not taken")
        return LoadedFact(loaded=loaded, version=ev.weight_version, path=rec.path if rec else None)

    async def train_step(self, ev: TrainStep) -> TrainLogRecord:
        """The trainer's committed record of the event's version; ``Reject`` when there is none."""
        rec = await self.record_of(ev.agent, ev.weight_version)
        if rec is None:
            raise Reject(f"train_step of {ev.agent!r} version {ev.weight_version} from {ev.source!r}: the trainer "
                         "never committed that version (no train-log record): not taken")
        return rec

    async def skipped(self, ev: TrainStepSkipped) -> None:
        """``Reject`` unless the trainer recorded the skip of that batch (its ``skipped_batches`` hash)."""
        if await self.bus.redis.hget(self.bus.streams.skipped_batches(ev.agent), ev.batch_id) is None:
            raise Reject(f"train_step_skipped of {ev.agent!r} batch {ev.batch_id!r} from {ev.source!r}: the trainer "
                         "recorded no such skip: not taken")
