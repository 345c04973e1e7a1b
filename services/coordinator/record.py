"""The coordinator's run record in Redis, and the facts it reads back from their owners at start.

Owned here (``coord:run`` hash, ``coord:evals`` list): when the run started, whether it is
paused or asked to stop, the error that stopped it, episodes played, and every evaluation
report (so a restarted coordinator neither re-runs the start evaluation nor loses the end
one). Read from their owners, never copied: the version the agent's engines have loaded
(the rollout's ``loaded_weight_version``) and each trained version's path and step metrics (the
trainer's ``train_log``). The groups are in the ledger (ledger.py).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from services.common.bus import Bus
from services.common.history import read_train_log, train_log_archive
from services.contracts.records import TrainLogRecord
from services.coordinator.ledger import GroupLedger
from services.coordinator.state import RunState

log = logging.getLogger("tandem.coordinator")


@dataclass
class RunFlags:
    started_at: float
    paused: bool = False
    stop_requested: bool = False
    error: str | None = None
    episodes_done: int = 0


@dataclass
class AgentVersions:
    """What the owners say of one agent's versions: loaded on its engines, and trained."""

    loaded: int = 0
    trained: list[TrainLogRecord] = field(default_factory=list)  # the trainer's log records, by version

    @property
    def loaded_records(self) -> list[TrainLogRecord]:
        return [r for r in self.trained if r.weight_version <= self.loaded]


class RunRecord:
    def __init__(self, bus: Bus, checkpoint_root: str | None = None) -> None:
        self.bus, self.checkpoint_root = bus, checkpoint_root  # where the trainers archive their older log records
        self.k_run = bus.streams.key("coord:run")
        self.k_evals = bus.streams.key("coord:evals")

    async def load(self) -> RunFlags:
        """The run's flags; the first start records its start time."""
        await self.bus.redis.hsetnx(self.k_run, "started_at", json.dumps(time.time()))
        raw = {k.decode(): json.loads(v) for k, v in (await self.bus.redis.hgetall(self.k_run)).items()}
        return RunFlags(started_at=float(raw["started_at"]), paused=bool(raw.get("paused", False)),
                        stop_requested=bool(raw.get("stop_requested", False)), error=raw.get("error"),
                        episodes_done=int(raw.get("episodes_done", 0)))

    async def set(self, **fields: Any) -> None:
        await self.bus.redis.hset(self.k_run, mapping={k: json.dumps(v) for k, v in fields.items()})

    async def count_episode(self) -> None:
        await self.bus.redis.hincrby(self.k_run, "episodes_done", 1)

    async def evals(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in await self.bus.redis.lrange(self.k_evals, 0, -1)]

    async def add_evals(self, evals: list[dict[str, Any]]) -> None:
        if evals:
            await self.bus.redis.rpush(self.k_evals, *[json.dumps(e) for e in evals])

    async def versions(self, agent: str) -> AgentVersions:
        s = self.bus.streams
        loaded = int(await self.bus.redis.get(s.loaded_weight_version(agent)) or 0)
        if self.checkpoint_root is None:
            log = sorted((TrainLogRecord.parse(x) for x in await self.bus.redis.lrange(s.train_log(agent), 0, -1)),
                         key=lambda r: r.weight_version)
        else:  # the trainer's archive (records beyond run.state_kept_steps) joined with what Redis still holds
            archive = train_log_archive(self.checkpoint_root, s.run, agent)
            log = await read_train_log(self.bus.redis, s, agent, archive)
        return AgentVersions(loaded, log)


async def restore_run(st: RunState, record: RunRecord, ledger: GroupLedger) -> tuple[list[dict[str, Any]],
                                                                                  dict[str, list[str]]]:
    """Rebuild ``st`` from Redis; return the evaluation reports and each agent's loaded version paths."""
    flags = await record.load()
    st.started_at, st.paused, st.stop_requested = flags.started_at, flags.paused, flags.stop_requested
    st.error, st.episodes_done = flags.error, flags.episodes_done
    st.groups_launched, st.launched_ahead = await ledger.groups_launched(), await ledger.launched_ahead()
    evals = await record.evals()
    st.restore_evals(evals)
    paths = {}
    for agent, a in st.agents.items():
        versions = await record.versions(agent)
        a.restore_versions(versions.loaded, versions.trained)
        paths[agent] = [r.path for r in versions.loaded_records]
    for agent, outcomes in (await ledger.restore()).items():
        st.agents[agent].restore_groups([(o.group_id, o.state, o.reason, o.at, o.reward) for o in outcomes.values()])
    if st.groups_launched:
        log.info("restored run %s: %s", st.cfg.run.name, {a: v["groups"] for a, v in st.status()["agents"].items()})
    return evals, paths
