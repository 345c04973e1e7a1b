"""The records services share through Redis keys (the key table: contracts/keys.py), and the states of a group.

* ``GroupState``: where one agent's part of a GRPO group stands. The coordinator's ledger holds ``playing``
  and ``emitted``; the buffer's verdict is ``kept``, ``dropped`` or ``abandoned`` (the coordinator also
  abandons a group that was never emitted). A str-valued enum: Redis, events and the API carry the plain word.
* ``Verdict``: a decided state with its reason, stored in the buffer's verdicts hash as ``kept``,
  ``dropped:<reason>`` or ``abandoned:<reason>`` (``encode``/``parse``).
* ``LedgerEntry``: the coordinator's JSON record of one agent's part of one group (``coord:ledger:{agent}``).
* ``TrainLogRecord``: the trainer's commit of one weight version (``trainer:{agent}:log``). Its persisted
  names ``version`` (the weight version) and ``metrics.batch_step`` (the batch's weight version) are read
  and written here only; everywhere else they are ``weight_version`` and ``batch_weight_version``.
* ``SkipRecord``: the trainer's record of a skipped (non-finite) step (``trainer:{agent}:skipped_batches``).
* ``KeptAdapter``: one adapter version every engine serving an agent that shares another's engines must hold
  (``state:{agent}:engine_adapters``, a JSON list): the fleet's owner loads them on a restarted engine.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class GroupState(StrEnum):
    PLAYING = "playing"  # launched; its episodes run in the coordinator
    EMITTED = "emitted"  # its samples are on samples:{agent}; the buffer decides next
    KEPT = "kept"  # complete and ready for a batch (may still be dropped stale at release)
    DROPPED = "dropped"  # zero reward variance, stale at release, or its training step skipped
    ABANDONED = "abandoned"  # never completed: a timeout, a failed episode, a dead-lettered sample, a restart

    @property
    def decided(self) -> bool:
        """A verdict's state (kept, dropped, abandoned), not one of the ledger's own (playing, emitted)."""
        return self in (GroupState.KEPT, GroupState.DROPPED, GroupState.ABANDONED)

    @property
    def final(self) -> bool:
        """Nothing moves a group out of this state (a kept group may still be dropped)."""
        return self in (GroupState.DROPPED, GroupState.ABANDONED)


DecidedState = Literal[GroupState.KEPT, GroupState.DROPPED, GroupState.ABANDONED]
"""The states a verdict may hold (the ``outcome`` of a ``group_done`` event)."""


class Verdict(BaseModel):
    """A group's decided state and why (empty for ``kept``)."""

    model_config = ConfigDict(frozen=True)

    state: DecidedState
    reason: str = ""

    def encode(self) -> str:
        """As the verdicts hash holds it: ``kept``, ``dropped:<reason>``, ``abandoned:<reason>``."""
        return self.state.value if self.state is GroupState.KEPT else f"{self.state.value}:{self.reason}"

    @classmethod
    def parse(cls, raw: str | bytes) -> Verdict:
        """``kept`` -> (kept, ""), ``dropped:stale`` -> (dropped, "stale"); ValueError on an unknown state."""
        text = raw.decode() if isinstance(raw, bytes) else raw
        state, _, reason = text.partition(":")
        return cls(state=GroupState(state), reason=reason)  # type: ignore[arg-type]

    @property
    def kept(self) -> bool:
        return self.state is GroupState.KEPT


class LedgerEntry(BaseModel):
    """One agent's part of one group, as the coordinator records it. ``playing``: ``index`` (the run's group
    counter); ``emitted``: ``reward`` (the mean), ``samples`` (the ids emitted: the buffer takes them as the
    group's membership and size) and ``version`` (the oldest weight version a sample was played with; optional:
    an entry may lack it); ``abandoned``: ``reason``. Fields not set are not written."""

    state: GroupState
    at: float = 0.0
    index: int | None = None
    reward: float | None = None
    samples: list[str] | None = None
    version: int | None = None
    reason: str | None = None

    def dump(self) -> str:
        return json.dumps(self.model_dump(mode="json", exclude_none=True))

    @classmethod
    def parse(cls, raw: str | bytes) -> LedgerEntry:
        return cls.model_validate(json.loads(raw))


class TrainLogRecord(BaseModel):
    """The trainer's commit of ``weight_version``: the batch, its samples, the signed weights and the metrics.

    Persisted under the names stored logs use: ``version`` for ``weight_version``, and the metrics dict
    carrying ``version`` and ``batch_step`` (``batch_weight_version``); ``parse`` reads them, ``dump`` writes
    them, so every stored log reads. ``metrics`` here holds the step's own metrics only, and
    is None for a record written without metrics."""

    model_config = ConfigDict(populate_by_name=True)

    weight_version: int = Field(alias="version")
    batch_id: str = ""
    sample_ids: list[str] = Field(default_factory=list)
    path: str = ""
    checksum: str = ""
    signature: str = ""
    engines: list[str] = Field(default_factory=list)
    min_weight_version: int | None = None
    metrics: dict[str, Any] | None = None
    batch_weight_version: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _persisted_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("metrics"), dict):
            metrics = dict(data["metrics"])
            metrics.pop("version", None)
            batch_step = metrics.pop("batch_step", None)
            data = {**data, "metrics": metrics}
            if batch_step is not None and data.get("batch_weight_version") is None:
                data["batch_weight_version"] = batch_step
        return data

    @classmethod
    def parse(cls, raw: str | bytes | dict[str, Any]) -> TrainLogRecord:
        return cls.model_validate(raw if isinstance(raw, dict) else json.loads(raw))

    def persisted(self) -> dict[str, Any]:
        """The record under its persisted names (as ``dump`` writes it)."""
        out = self.model_dump(by_alias=True, exclude={"metrics", "batch_weight_version"})
        if self.min_weight_version is None:
            del out["min_weight_version"]
        if self.metrics is not None:
            out["metrics"] = {**self.metrics, "version": self.weight_version,
                              **({"batch_step": self.batch_weight_version}
                                 if self.batch_weight_version is not None else {})}
        return out

    def dump(self) -> str:
        return json.dumps(self.persisted())


class SkipRecord(BaseModel):
    """A training step the trainer skipped (non-finite): the batch, why, its samples and groups, the skips in a
    row, and the weight version the weights stayed at. Persisted names: ``batch_step`` for
    ``batch_weight_version``, ``version`` for ``weight_version``."""

    model_config = ConfigDict(populate_by_name=True)

    batch_id: str
    batch_weight_version: int = Field(alias="batch_step")
    reason: str
    sample_ids: list[str]
    group_ids: list[str]
    consecutive: int
    weight_version: int = Field(alias="version")

    def dump(self) -> str:
        return json.dumps(self.model_dump(by_alias=True))

    @classmethod
    def parse(cls, raw: str | bytes) -> SkipRecord:
        return cls.model_validate_json(raw)


class KeptAdapter(BaseModel):
    """One adapter version the engines must hold: its name there (``{agent}-v{version}``), its directory, its
    weight version and the trainer's proof (checksum and signature; empty: none), which the engine checks."""

    model_config = ConfigDict(extra="forbid")

    name: str
    path: str
    weight_version: int = Field(ge=1)
    checksum: str = ""
    signature: str = ""
