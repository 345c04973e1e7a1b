"""Pydantic models of every message on the streams (which stream carries which: contracts/flows.py).

Each message carries a schema version, a unique id and its creation time.
Unknown fields are rejected, so a producer on another schema is caught at the
consumer and dead-lettered rather than half-understood.

Every wire model is strict (``strict=True``: no lax coercion, a ``"1.0"`` is not a float, a ``True``
not an int); token ids are non-negative (``TokenId``) and logprobs finite and ≤ 0 (``Logprob``).
Whether an id is within the agent's vocabulary depends on its model: the buffer and the rollout
check that (``services.common.tokens``).

Events are a discriminated union on ``kind``: one model per kind, with typed fields.

One name per concept (docs/architecture.md §3): a weight version is ``weight_version`` everywhere, a
sample's per-turn versions are ``Sample.weight_versions``, and ``Sample.group_samples`` is the agent's share
of its group, not ``environment.group_size`` (the group's episodes). ``WeightsUpdate`` carries a required
``signature`` (HMAC of the update with the run's secret, §2.3) next to its ``checksum``: an update from a
producer on another schema (no signature) is rejected at decode naming ``schema_version``, not refused
later as merely unsigned.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator

from services.contracts.records import DecidedState

SCHEMA_VERSION = 3


TokenId = Annotated[int, Field(ge=0)]
"""A token id: non-negative (the upper bound, the vocabulary size, is the model's)."""
Logprob = Annotated[FiniteFloat, Field(le=0.0)]
"""A log-probability: finite and at most 0."""


def new_id() -> str:
    return uuid.uuid4().hex


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    schema_version: Literal[3] = SCHEMA_VERSION
    id: str = Field(default_factory=new_id, min_length=1)
    created_at: float = Field(default_factory=time.time)


class SamplingParams(BaseModel):
    """Subset of SGLang's sampling_params that Tandem sets (same field names)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float = Field(1.0, ge=0.0, description="sampling temperature (below 1e-6: greedy, as SGLang)")
    top_p: float = Field(1.0, gt=0.0, le=1.0,
                         description="nucleus sampling: the smallest set of tokens whose probability reaches top_p")
    top_k: int = Field(-1, ge=-1, le=2**31 - 1, description="sample among the k likeliest tokens; -1: all")
    max_new_tokens: int = Field(16, ge=1, le=2**20, description="the most tokens one reply may generate")
    stop_token_ids: list[TokenId] = Field(default_factory=list,
                                          description="token ids that end a reply, besides the tokenizer's "
                                                      "end-of-sequence")
    seed: int | None = Field(None, ge=0, le=2**63 - 1,
                             description="a sampling seed (same seed, same tokens, whatever the batch); null: random")


class GenerateRequest(Message):
    """turns:{agent} — one generation request from the coordinator."""

    agent: str
    episode_id: str
    group_id: str
    turn: int = Field(ge=0)
    role: str
    input_ids: list[TokenId] = Field(min_length=1)
    sampling: SamplingParams
    reply_stream: str
    purpose: Literal["train", "eval"] = "train"


FinishReason = Literal["stop", "length", "abort"]
"""Why a generation ended: the one definition (SGLang's ``finish_reason.type``; ``sglang_api.FinishInfo``)."""


class GenerateReply(Message):
    """replies:{coordinator} — the engine's answer, token-exact."""

    request_id: str
    agent: str
    episode_id: str
    turn: int
    output_ids: list[TokenId]
    output_logprobs: list[Logprob]
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


def turn_spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """Each run of 1s in ``loss_mask`` as [start, end) token positions: a Sample's turns when it names none."""
    spans, start = [], None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


class TurnSpan(BaseModel):
    """One generated turn of a Sample: its tokens ``[start, end)``, all loss mask 1."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    start: int = Field(ge=0)
    end: int = Field(ge=1)


class Sample(Message):
    """samples:{agent} — one agent-trajectory of one episode.

    ``tokens`` is the agent's whole view; ``loss_mask`` is 1 exactly on the
    tokens the agent's engines generated; ``rollout_logprobs`` holds the
    engine's logprob on those positions and 0.0 elsewhere. ``turns`` names each generated turn's tokens
    (empty: each run of 1s in ``loss_mask`` is one, ``turn_spans``); ``spans`` is what the trainer reads.
    """

    agent: str
    role: str
    episode_id: str
    group_id: str
    group_samples: int = Field(ge=1, description="how many samples the agent has in this group (its share of the "
                               "group; environment.group_size counts the group's episodes)")
    tokens: list[TokenId] = Field(min_length=1)
    loss_mask: list[int]
    rollout_logprobs: list[Logprob]
    reward: FiniteFloat
    reward_terms: dict[str, FiniteFloat] = Field(default_factory=dict)
    turns: list[TurnSpan] = Field(
        default_factory=list, description="per generated turn (a turn with tool calls: per generation), in order, "
        "its tokens [start, end): together exactly the loss mask's 1s. Empty: each run of 1s in loss_mask is a turn")
    weight_versions: list[int] = Field(min_length=1, description="per generated turn, the weight version")
    engines: list[str] = Field(default_factory=list)
    reply_ids: list[str] = Field(default_factory=list)
    turn_rewards: list[FiniteFloat] = Field(
        default_factory=list, description="per generated turn (``turns``, in order), what that "
        "turn earned: the environment's per-turn rewards to this role from it until the role's next turn, the "
        "last turn also the final reward; they sum to reward. Empty: the episode's reward only (algorithm.credit)")
    malformed_turns: int = Field(0, ge=0, description="this view's replies that the environment found illegal or "
                                 "malformed (its step info); the trainer reports the batch's share of such samples")

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
        if self.turns:
            self._check_turns()
        if self.turn_rewards:
            turns = len(self.spans)
            if len(self.turn_rewards) != turns:
                raise ValueError(f"turn_rewards has {len(self.turn_rewards)} values for {turns} generated turns")
            if abs(sum(self.turn_rewards) - self.reward) > 1e-6 * max(1.0, abs(self.reward)):
                raise ValueError(f"turn_rewards sum to {sum(self.turn_rewards)}, not to reward {self.reward}")
        return self

    def _check_turns(self) -> None:
        """``turns`` in order, inside ``tokens``, on 1s of the mask and on all of them; one weight version (and
        engine, reply id when given) per turn."""
        at, covered = 0, 0
        for k, t in enumerate(self.turns):
            if t.start < at or t.end <= t.start or t.end > len(self.tokens):
                raise ValueError(f"turns[{k}] = [{t.start}, {t.end}) is not a non-empty span after the previous "
                                 f"turn (from {at}) inside the {len(self.tokens)} tokens")
            if not all(self.loss_mask[t.start:t.end]):
                raise ValueError(f"turns[{k}] = [{t.start}, {t.end}) covers tokens of loss mask 0")
            at, covered = t.end, covered + t.end - t.start
        if covered != sum(self.loss_mask):
            raise ValueError(f"turns cover {covered} tokens, loss_mask has {sum(self.loss_mask)} 1s: a generated "
                             "token outside every turn")
        for name in ("weight_versions", "engines", "reply_ids"):
            got = len(getattr(self, name))
            if got != len(self.turns) and (got or name == "weight_versions"):
                raise ValueError(f"{name} has {got} values for {len(self.turns)} turns")

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Each generated turn's tokens [start, end): ``turns``, or the runs of 1s of an older producer's mask."""
        return [(t.start, t.end) for t in self.turns] if self.turns else turn_spans(self.loss_mask)

    @property
    def min_weight_version(self) -> int:
        return min(self.weight_versions)


class Batch(Message):
    """batches:{agent} — the samples of ``groups`` complete GRPO groups."""

    agent: str
    weight_version: int = Field(ge=1, description="the weight version this batch trains into (the version the "
                                "step on it makes)")
    samples: list[Sample] = Field(min_length=1)


class WeightsUpdate(Message):
    """weights:{agent} — a new HF-format weight directory is ready. ``checksum``: SHA-256 over the directory's
    files; ``signature``: HMAC-SHA256 of (agent, weight_version, path, checksum) with the run's secret (the rollout
    refuses an update without a valid one: services.common.weights_auth)."""

    agent: str
    weight_version: int = Field(ge=1)
    path: str
    checksum: str = Field(min_length=1)
    signature: str = Field(min_length=1)


class EventBase(Message):
    """events — facts the coordinator aggregates (and anyone may read); ``kind`` tells which."""

    source: str = Field(description="the publishing service, e.g. rollout-A")
    agent: str


class WeightsLoaded(EventBase):
    """rollout → the agent's engines now serve ``weight_version`` (loaded from ``path``)."""

    kind: Literal["weights_loaded"] = "weights_loaded"
    weight_version: int = Field(ge=0)
    path: str
    engines: list[str]


class TrainStep(EventBase):
    """trainer → version ``weight_version`` is committed; ``metrics`` are the step's (flat: loss terms, kl, entropy,
    clip_frac, grad_norm, lr, tokens_per_s, TIS statistics, algorithm, backend ...)."""

    kind: Literal["train_step"] = "train_step"
    weight_version: int = Field(ge=1)
    batch_weight_version: int = Field(ge=1, description="the weight_version of the batch it trained on")
    metrics: dict[str, float | int | str | None]


class TrainStepSkipped(EventBase):
    """trainer → the step on batch ``batch_id`` was skipped: its loss, a gradient or a weight was non-finite
    (``reason``). No version was made; the weights are as they were; the samples are rejected (dead-lettered),
    their groups dropped; ``consecutive`` counts skipped steps in a row (the trainer stops at the limit)."""

    kind: Literal["train_step_skipped"] = "train_step_skipped"
    batch_id: str
    batch_weight_version: int = Field(ge=1)
    reason: str
    sample_ids: list[str]
    group_ids: list[str]
    consecutive: int = Field(ge=1)


class GroupDone(EventBase):
    """buffer → a group's verdict: kept (ready for a batch), dropped (``reason``: zero reward variance, stale)
    or abandoned (``reason``). ``was_kept``: dropped after an earlier kept verdict (stale at release)."""

    kind: Literal["group_done"] = "group_done"
    group_id: str
    outcome: DecidedState  # records.GroupState: kept, dropped or abandoned
    reason: str | None = None
    was_kept: bool = False


class BatchReleased(EventBase):
    """buffer → the batch for ``weight_version`` (``samples`` samples) is on ``batches:{agent}``."""

    kind: Literal["batch_released"] = "batch_released"
    weight_version: int = Field(ge=1)
    samples: int = Field(ge=1)


class EngineStatus(BaseModel):
    """One engine in a ``rollout_load`` report (fields the rollout does not know are left out)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    url: str
    healthy: bool
    pid: int | None = None
    restarts: int | None = None
    weight_version: int | None = None
    num_reqs: int | None = None
    num_waiting_reqs: int | None = None
    num_tokens: int | None = None
    silent_s: float | None = Field(None, ge=0, description="seconds since the engine last passed a health check")


class RolloutLoad(EventBase):
    """rollout → its turns queue depth, in-flight bound and per-engine health and load (every few seconds)."""

    kind: Literal["rollout_load"] = "rollout_load"
    queue_depth: int = Field(0, ge=0)
    inflight: int = Field(0, ge=0)
    capacity: int = Field(0, ge=0)
    waiting: int = Field(0, ge=0)
    router: str = ""
    router_restarts: int = Field(0, ge=0, description="restarts of the router by this rollout's fleet")
    engines: list[EngineStatus] = Field(default_factory=list)

    def report(self) -> dict[str, Any]:
        """The load as a plain dict (engines without the fields their rollout left out)."""
        return {**self.model_dump(include={"queue_depth", "inflight", "capacity", "waiting", "router",
                                           "router_restarts"}),
                "engines": [e.model_dump(exclude_none=True) for e in self.engines]}


Event = Annotated[WeightsLoaded | TrainStep | TrainStepSkipped | GroupDone | BatchReleased | RolloutLoad,
                  Field(discriminator="kind")]
"""Every event, told apart by ``kind``."""
EVENT_TYPES: tuple[type[EventBase], ...] = (WeightsLoaded, TrainStep, TrainStepSkipped, GroupDone, BatchReleased,
                                            RolloutLoad)


class Control(Message):
    """control — commands from the coordinator to every service."""

    command: Literal["pause", "resume", "stop", "checkpoint"]
    args: dict[str, Any] = Field(default_factory=dict)


class DeadLetter(Message):
    """deadletter — a message that failed validation or processing."""

    source_stream: str
    entry_id: str
    service: str
    reason: str
    payload: bytes
