"""Pydantic models of every message on the streams (DESIGN §2).

Each message carries a schema version, a unique id and its creation time.
Unknown fields are rejected, so a producer on another schema is caught at the
consumer and dead-lettered rather than half-understood.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator

SCHEMA_VERSION = 1


def new_id() -> str:
    return uuid.uuid4().hex


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    id: str = Field(default_factory=new_id, min_length=1)
    created_at: float = Field(default_factory=time.time)


class SamplingParams(BaseModel):
    """Subset of SGLang's sampling_params that Tandem sets (same field names)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    max_new_tokens: int = Field(16, ge=1, le=2**20)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)


class GenerateRequest(Message):
    """turns:{agent} — one generation request from the coordinator."""

    agent: str
    episode_id: str
    group_id: str
    turn: int = Field(ge=0)
    role: str
    input_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams
    reply_stream: str
    purpose: Literal["train", "eval"] = "train"


FinishReason = Literal["stop", "length", "abort"]


class GenerateReply(Message):
    """replies:{coordinator} — the engine's answer, token-exact."""

    request_id: str
    agent: str
    episode_id: str
    turn: int
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    engine: str
    prompt_tokens: int = 0
    error: str | None = None

    @model_validator(mode="after")
    def _aligned(self) -> GenerateReply:
        if len(self.output_ids) != len(self.output_logprobs):
            raise ValueError("output_ids and output_logprobs differ in length")
        return self


class Sample(Message):
    """samples:{agent} — one agent-trajectory of one episode.

    ``tokens`` is the agent's whole view; ``loss_mask`` is 1 exactly on the
    tokens the agent's engines generated; ``rollout_logprobs`` holds the
    engine's logprob on those positions and 0.0 elsewhere.
    """

    agent: str
    role: str
    episode_id: str
    group_id: str
    group_size: int = Field(ge=1)
    tokens: list[int] = Field(min_length=1)
    loss_mask: list[int]
    rollout_logprobs: list[float]
    reward: FiniteFloat
    reward_terms: dict[str, FiniteFloat] = Field(default_factory=dict)
    turn_weight_versions: list[int] = Field(min_length=1)
    engines: list[str] = Field(default_factory=list)
    reply_ids: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _aligned(self) -> Sample:
        n = len(self.tokens)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"tokens ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"rollout_logprobs ({len(self.rollout_logprobs)}) must have one length"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask holds values other than 0 and 1")
        if not any(self.loss_mask):
            raise ValueError("loss_mask covers no token: the agent generated nothing")
        return self

    @property
    def min_weight_version(self) -> int:
        return min(self.turn_weight_versions)


class Batch(Message):
    """batches:{agent} — the samples of ``groups`` complete GRPO groups."""

    agent: str
    step: int = Field(ge=1, description="the weight version this batch trains towards")
    samples: list[Sample] = Field(min_length=1)


class WeightsUpdate(Message):
    """weights:{agent} — a new HF-format weight directory is ready."""

    agent: str
    version: int = Field(ge=1)
    path: str
    checksum: str


EventKind = Literal[
    "weights_loaded",
    "train_step",
    "group_done",
    "batch_released",
    "health",
    "error",
    "rollout_load",  # rollout → all: queue depth, in-flight bound, per-engine health and load
]


class Event(Message):
    """events — facts the coordinator aggregates (and anyone may read)."""

    source: str
    kind: EventKind
    agent: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class Control(Message):
    """control — commands from the coordinator to every service."""

    command: Literal["pause", "resume", "stop", "checkpoint", "eval"]
    args: dict[str, Any] = Field(default_factory=dict)


class DeadLetter(Message):
    """deadletter — a message that failed validation or processing."""

    source_stream: str
    entry_id: str
    service: str
    reason: str
    payload: bytes
