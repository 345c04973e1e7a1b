"""The run's status as ``GET /v1/status`` answers it: ``RunStatus`` (the coordinator builds it, the launcher's
live view and the dashboard read it).

The field names are the JSON keys; a key the coordinator adds later still validates (``extra: allow``),
and an evaluation report restored from an older run may lack the keys added since (they default, and the
API leaves unset ones out: ``response_model_exclude_unset``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StatusModel(BaseModel):
    """A part of the status: declared keys, and any key added later kept as it is."""

    model_config = ConfigDict(extra="allow")


class GateStatus(StatusModel):
    """An agent's staleness gate (docs/architecture.md §4)."""

    open: bool = Field(description="no new group would be generated more than max_staleness versions behind")
    holding_next_group: bool = Field(description="this gate holds the next group's launch back now")
    groups_held: int = Field(description="groups whose launch this gate held back")
    held_s: float = Field(description="seconds this gate held launches back")
    held_back_by: dict[str, int] = Field(description="agent whose gate held one of this agent's groups back -> groups")


class AgentStatus(StatusModel):
    """One training agent: its steps, versions, groups, rewards, evaluations, play and pipeline."""

    step: int = Field(description="train steps reported")
    weight_version: int = Field(description="the version its engines have loaded")
    loaded_weight_versions: int = Field(description="how many versions its engines have loaded")
    mean_reward: float | None = Field(description="the last trained batch's mean reward")
    recent_group_reward: float | None = Field(description="the mean reward of its last 16 groups")
    groups: dict[str, int] = Field(description="groups kept, dropped, abandoned and in flight")
    eval_start: float | None = Field(description="the start evaluation's headline score")
    eval_end: float | None = Field(description="the end evaluation's headline score")
    max_staleness: int
    skipped_steps: int = Field(description="training steps the trainer skipped (non-finite)")
    illegal_rate: float | None = Field(description="illegal or malformed share of its newest training episodes")
    signal: dict[str, Any] = Field(description="the last step's zero-variance share, malformed rate, and the steps "
                                               "in a row without learning signal")
    rollout: dict[str, Any] = Field(description="its rollout's last load report (queue, in flight, engines)")
    gate: GateStatus


class WaitingGroup(StatusModel):
    """The next group while a staleness gate holds its launch."""

    index: int
    agents: list[str]
    held_by: list[str]
    waiting_s: float


class EvalReport(StatusModel):
    """One evaluation: every agent against every eval opponent (services/coordinator/evals.py)."""

    label: str = Field(description="start, step-N, end or on-demand")
    time: float
    versions: dict[str, int] = {}
    checkpoints: dict[str, str | None] = {}
    opponents: list[str] = []
    frozen: list[str] = []
    scores: dict[str, float | None] = {}
    details: dict[str, dict[str, Any]] = {}
    vs: dict[str, dict[str, dict[str, Any]]] = {}


class RejectedReplies(StatusModel):
    replies: int = Field(description="engine replies the coordinator refused")
    episodes_abandoned: int = Field(description="episodes those replies abandoned")


class RunStatus(StatusModel):
    """``GET /v1/status``: the run's state, in memory (Redis-backed counts are null while Redis is down)."""

    run: str
    phase: str = Field(description="starting, eval_start, training, eval_end, done or stopped")
    paused: bool
    error: str | None = Field(description="why the coordinator stopped the run itself")
    uptime_s: float
    episodes: int = Field(description="episodes played")
    episodes_per_s: float
    episodes_failed: dict[str, dict[str, int]] = Field(description="purpose -> total and per agent")
    total_steps: int
    agents: dict[str, AgentStatus]
    waiting_group: WaitingGroup | None
    evals: list[EvalReport]
    rejected_replies: dict[str, RejectedReplies] | None = Field(description="per agent; null while Redis is down")
    redis: str = Field(description="ok, or unavailable: the reason")
