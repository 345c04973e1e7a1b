"""Run state the coordinator owns: per-agent versions, group accounting, metrics, episodes.

The launch gate (docs/architecture.md §4) lives here: agent X blocks a new group while
``kept + in_flight >= (loaded_weight_version + max_staleness + 1) * groups_per_batch``.
``kept`` counts groups the buffer accepted, so a group it drops (stale,
filtered) or one abandoned (see ledger.py) is replaced; with
``max_staleness = 0`` no group for step k+1 starts before version k+1 is
loaded on every engine. A group starts when some agent in it still wants
groups and no agent that still wants groups is blocked. Groups launch one at a time, lowest index first:
a group whose training agents are all gated is skipped for the next one whose agents are not
(``launched_ahead``, and back to it once they open); one where only some are gated waits, and the
groups behind it too. ``GateWait`` says which gates hold the first held group; each agent's ``gate``
in the status counts the groups its gate held back and the groups it played in that another agent's
gate held back (§4).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from services.contracts.config import TandemConfig
from services.contracts.records import GroupState, TrainLogRecord
from services.coordinator.learning_signal import signal_status
from services.coordinator.train_play import PlayCounts, recent


def finite(data: dict[str, Any]) -> dict[str, Any]:
    """Metrics with NaN/inf replaced by None (JSON cannot carry them)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in data.items()}


def train_step_entry(rec: TrainLogRecord) -> dict[str, Any]:
    """A train step as the run state keeps it, from the trainer's log record (the same entry a ``TrainStep``
    event makes, without its time)."""
    entry = {**(rec.metrics or {}), "weight_version": rec.weight_version}
    if rec.batch_weight_version is not None:
        entry["batch_weight_version"] = rec.batch_weight_version
    return {**entry, "time": None}


@dataclass
class AgentState:
    name: str
    groups_per_batch: int
    max_staleness: int
    total_steps: int
    loaded_weight_version: int = 0
    loaded_weight_versions: list[int] = field(default_factory=list)
    kept_groups: int = 0
    dropped_groups: int = 0
    abandoned_groups: int = 0
    skipped_steps: int = 0  # training steps the trainer skipped (non-finite)
    in_flight_groups: int = 0
    train_steps: list[dict[str, Any]] = field(default_factory=list)
    group_rewards: list[tuple[float, float]] = field(default_factory=list)  # (time, mean reward)
    eval_start: float | None = None
    eval_end: float | None = None
    group_status: dict[str, GroupState] = field(default_factory=dict)
    abandon_reasons: dict[str, int] = field(default_factory=dict)  # reason -> groups
    rollout: dict[str, Any] = field(default_factory=dict)  # the last rollout_load event's data
    train_play: dict[int, PlayCounts] = field(default_factory=dict)  # weight version -> training play (train_play.py)
    groups_held: int = 0  # groups whose launch this agent's staleness gate held back
    held_s: float = 0.0  # their total wait
    held_back_by: dict[str, int] = field(default_factory=dict)  # agent whose gate held one of my groups -> groups

    def resolve_group(self, group_id: str, outcome: GroupState | str, reason: str = "") -> None:
        """Apply a group's decided state (kept, dropped, abandoned) once; repeats are ignored.

        A group moves in flight → kept | dropped | abandoned, and kept → dropped when the
        buffer finds it stale at release (the ledger's rule, ledger.py)."""
        state = GroupState(outcome) if outcome in set(GroupState) else None
        if state is None or not state.decided:
            raise ValueError(f"group {group_id}: unknown outcome {outcome!r}")
        prev = self.group_status.get(group_id)
        if prev == state or (prev is not None and prev.final) or (prev is GroupState.KEPT
                                                                   and state is not GroupState.DROPPED):
            return
        if prev is None:
            self.in_flight_groups = max(0, self.in_flight_groups - 1)
        else:
            self.kept_groups -= 1
        if state is GroupState.KEPT:
            self.kept_groups += 1
        elif state is GroupState.DROPPED:
            self.dropped_groups += 1
        else:
            self.abandoned_groups += 1
            key = reason.split(":")[0] or "unknown"
            self.abandon_reasons[key] = self.abandon_reasons.get(key, 0) + 1
        self.group_status[group_id] = state

    def all_dropped(self, group_ids: list[str]) -> bool:
        return all(self.group_status.get(g) == GroupState.DROPPED for g in group_ids)

    def skip_step(self, group_ids: list[str], reason: str) -> None:
        """A training step the trainer skipped: its groups are dropped (new groups replace them, and the buffer
        releases a batch in its place)."""
        self.skipped_steps += 1
        for g in group_ids:
            self.resolve_group(g, GroupState.DROPPED, f"non-finite training step: {reason}")

    def restore_versions(self, loaded: int, records: list[TrainLogRecord]) -> None:
        """Versions as their owners hold them: ``loaded`` on the engines; the trainer's log records."""
        self.loaded_weight_version = max(self.loaded_weight_version, loaded)
        for rec in records:
            if rec.weight_version <= loaded and rec.weight_version not in self.loaded_weight_versions:
                self.loaded_weight_versions.append(rec.weight_version)
            if all(t.get("weight_version") != rec.weight_version for t in self.train_steps):
                self.train_steps.append(train_step_entry(rec))

    def restore_groups(self, outcomes: list[tuple[str, GroupState, str, float, float | None]]) -> None:
        """Groups as the ledger holds them: (group id, state, reason, time, mean reward), by time."""
        for gid, state, reason, at, reward in sorted(outcomes, key=lambda o: o[3]):
            if gid not in self.group_status:
                self.in_flight_groups += 1
                if state.decided:
                    self.resolve_group(gid, state, reason)
            if reward is not None:
                self.group_rewards.append((at, reward))

    def group_counts(self) -> dict[str, int]:
        """Groups per decided state, and those in flight (the status's ``groups``)."""
        return {GroupState.KEPT.value: self.kept_groups, GroupState.DROPPED.value: self.dropped_groups,
                GroupState.ABANDONED.value: self.abandoned_groups, "in_flight": self.in_flight_groups}

    @property
    def claimed(self) -> int:
        return self.kept_groups + self.in_flight_groups

    def wants_groups(self) -> bool:
        """More groups are needed to reach ``total_steps`` batches."""
        return self.claimed < self.total_steps * self.groups_per_batch

    def blocked_by_staleness(self) -> bool:
        """A new group would be generated more than ``max_staleness`` versions behind."""
        return self.claimed >= (self.loaded_weight_version + self.max_staleness + 1) * self.groups_per_batch

    @property
    def finished(self) -> bool:
        return self.loaded_weight_version >= self.total_steps


@dataclass
class GateWait:
    """The next group while a staleness gate holds its launch: its training agents and the closed gates."""
    index: int
    agents: list[str]
    since: float
    held_by: set[str] = field(default_factory=set)

    def status(self) -> dict[str, Any]:
        return {"index": self.index, "agents": self.agents, "held_by": sorted(self.held_by),
                "waiting_s": round(time.time() - self.since, 2)}


@dataclass
class RunState:
    cfg: TandemConfig
    phase: str = "starting"  # starting | eval_start | training | eval_end | done | stopped
    paused: bool = False
    stop_requested: bool = False
    error: str | None = None  # why the coordinator stopped the run itself
    started_at: float = field(default_factory=time.time)
    agents: dict[str, AgentState] = field(default_factory=dict)
    episodes_done: int = 0
    episode_times: deque[float] = field(default_factory=lambda: deque(maxlen=2000))
    groups_launched: int = 0  # every group index below is launched (or passed over: nobody trains on it)
    launched_ahead: set[int] = field(default_factory=set)  # indices above it launched past a gated group
    gate_wait: GateWait | None = None  # the next group, while a gate holds it
    episodes_failed: dict[str, dict[str, int]] = field(default_factory=dict)  # purpose -> total/agent (failures.py)

    @classmethod
    def from_config(cls, cfg: TandemConfig) -> RunState:
        agents = {
            name: AgentState(name, a.groups_per_batch, a.max_staleness, cfg.run.total_steps)
            for name, a in cfg.agents.items() if a.train  # a frozen agent has no state to track
        }
        return cls(cfg=cfg, agents=agents)

    def closed_gates(self, index: int, wanting: list[AgentState]) -> list[str]:
        """The agents of group ``index`` (those that want groups) whose staleness gate is closed, noted
        in ``gate_wait`` for the status."""
        blocked = [a.name for a in wanting if a.blocked_by_staleness()]
        if blocked:
            if self.gate_wait is None or self.gate_wait.index != index:
                self.gate_wait = GateWait(index, [a.name for a in wanting], time.time())
            self.gate_wait.held_by.update(blocked)
        return blocked

    def after_launch(self, index: int) -> tuple[int, set[int]]:
        """``groups_launched`` and ``launched_ahead`` once group ``index`` (not yet launched) is launched."""
        ahead = self.launched_ahead | {index}
        low = self.groups_launched
        while low in ahead:
            ahead.discard(low)
            low += 1
        return low, ahead

    def unlaunched(self, count: int) -> list[int]:
        """The ``count`` lowest group indices not yet launched, in order."""
        out, index = [], self.groups_launched
        while len(out) < count:
            if index not in self.launched_ahead:
                out.append(index)
            index += 1
        return out

    def launched(self, index: int) -> None:
        """Group ``index`` launched (or passed over): count the wait, if a gate held it, against each gate that
        did. A group launched past a held one leaves that wait as it is."""
        self.groups_launched, self.launched_ahead = self.after_launch(index)
        wait = self.gate_wait
        if wait is None or wait.index != index:
            return
        self.gate_wait = None
        for name in wait.held_by:
            self.agents[name].groups_held += 1
            self.agents[name].held_s += time.time() - wait.since
        for name in wait.agents:
            for gate in wait.held_by:
                held = self.agents[name].held_back_by
                held[gate] = held.get(gate, 0) + 1

    def held_seconds(self, a: AgentState, now: float | None = None) -> float:
        """Seconds ``a``'s gate has held launches back, the next group's wait so far included (it only grows:
        at the launch that wait moves into ``held_s``)."""
        wait = self.gate_wait
        ongoing = (time.time() if now is None else now) - wait.since if wait and a.name in wait.held_by else 0.0
        return a.held_s + max(ongoing, 0.0)

    def gate_status(self, a: AgentState) -> dict[str, Any]:
        wait = self.gate_wait
        return {"open": not a.blocked_by_staleness(),
                "holding_next_group": bool(wait and a.name in wait.held_by and a.blocked_by_staleness()),
                "groups_held": a.groups_held, "held_s": round(a.held_s, 2), "held_back_by": dict(a.held_back_by)}

    def restore_evals(self, evals: list[dict[str, Any]]) -> None:
        for ev in evals:
            for agent, score in ev["scores"].items():
                if agent in self.agents and ev["label"] in ("start", "end"):
                    setattr(self.agents[agent], f"eval_{ev['label']}", score)

    def episodes_per_s(self, window: float = 30.0) -> float:
        now = time.time()
        recent = [t for t in self.episode_times if now - t <= window]
        if not recent:
            return 0.0
        span = max(min(window, now - self.started_at), 1e-6)
        return len(recent) / span

    def status(self) -> dict[str, Any]:
        agents = {}
        for name, a in self.agents.items():
            last = a.train_steps[-1] if a.train_steps else {}
            agents[name] = {
                "step": len(a.train_steps),
                "weight_version": a.loaded_weight_version,
                "loaded_weight_versions": len(a.loaded_weight_versions),
                "mean_reward": last.get("reward_mean"),
                "recent_group_reward": (sum(r for _, r in a.group_rewards[-16:]) / len(a.group_rewards[-16:])
                                        if a.group_rewards else None),
                "groups": a.group_counts(),
                "eval_start": a.eval_start,
                "eval_end": a.eval_end,
                "max_staleness": a.max_staleness,
                "skipped_steps": a.skipped_steps,
                "illegal_rate": recent(a.train_play).report()["illegal_rate"],  # the newest training episodes'
                "signal": signal_status(a.train_steps),  # the last step's zero-variance share, malformed rate
                "rollout": a.rollout,
                "gate": self.gate_status(a),
            }
        return {
            "run": self.cfg.run.name,
            "phase": self.phase,
            "paused": self.paused,
            "error": self.error,
            "uptime_s": round(time.time() - self.started_at, 1),
            "episodes": self.episodes_done,
            "episodes_per_s": round(self.episodes_per_s(), 3),
            "episodes_failed": self.episodes_failed,
            "total_steps": self.cfg.run.total_steps,
            "agents": agents,
            "waiting_group": self.gate_wait.status() if self.gate_wait else None,
        }
