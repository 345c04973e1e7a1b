"""The flow table: which message goes on which stream, which service produces it, which consumer groups read it.

Every stream is ``tandem:{run}:{name}`` or ``tandem:{run}:{name}:{agent or coordinator}``
(``streams.Streams``); ``FLOWS[name]`` says what its entries are. The Bus takes the message model
from here (``Bus.consume`` validates every entry as ``flow.message``; ``Bus.publish`` refuses a
message of another type), and tests/integration/test_flows.py checks every ``publish``/``consume``/``xadd`` in
``services/`` against this table.

| stream              | message          | producers                 | consumer groups                    |
|---------------------|------------------|---------------------------|------------------------------------|
| turns:{agent}       | GenerateRequest  | coordinator               | rollout                            |
| replies:{coord}     | GenerateReply    | rollout                   | coordinator                        |
| samples:{agent}     | Sample           | coordinator               | buffer                             |
| batches:{agent}     | Batch            | buffer                    | trainer                            |
| weights:{agent}     | WeightsUpdate    | trainer                   | rollout                            |
| events              | Event (by kind)  | rollout, trainer, buffer  | coordinator                        |
| control             | Control          | coordinator               | control-{service}[-{agent}], each  |
| deadletter          | DeadLetter       | every service (the Bus)   | none (read by operators)           |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from services.contracts.messages import (
    EVENT_TYPES,
    Batch,
    Control,
    DeadLetter,
    Event,
    GenerateReply,
    GenerateRequest,
    Sample,
    WeightsUpdate,
)

ANY_SERVICE = "*"


@dataclass(frozen=True)
class Flow:
    name: str  # the stream's name in ``Streams``
    message: Any  # the model every entry is validated as (a class, or the Event union)
    message_name: str
    types: tuple[type[BaseModel], ...]  # the classes an entry may be
    producers: tuple[str, ...]  # services (package names under services/); "*": every service
    groups: tuple[str, ...]  # consumer groups, as fnmatch patterns


def _flow(name: str, message: type[BaseModel], producers: tuple[str, ...], groups: tuple[str, ...]) -> Flow:
    return Flow(name, message, message.__name__, (message,), producers, groups)


FLOWS: dict[str, Flow] = {f.name: f for f in (
    _flow("turns", GenerateRequest, ("coordinator",), ("rollout",)),
    _flow("replies", GenerateReply, ("rollout",), ("coordinator",)),
    _flow("samples", Sample, ("coordinator",), ("buffer",)),
    _flow("batches", Batch, ("buffer",), ("trainer",)),
    _flow("weights", WeightsUpdate, ("trainer",), ("rollout",)),
    Flow("events", Event, "Event", EVENT_TYPES, ("rollout", "trainer", "buffer"), ("coordinator",)),
    _flow("control", Control, ("coordinator",),
          ("control-coordinator", "control-rollout-*", "control-trainer-*", "control-buffer-*")),
    _flow("deadletter", DeadLetter, (ANY_SERVICE,), ()),
)}

EVENT_PRODUCERS: dict[str, tuple[str, ...]] = {  # the event kinds each producer of ``events`` sends
    "rollout": ("weights_loaded", "rollout_load"),
    "trainer": ("train_step", "train_step_skipped"),
    "buffer": ("group_done", "batch_released"),
}


def flow(name: str) -> Flow:
    try:
        return FLOWS[name]
    except KeyError:
        raise KeyError(f"stream {name!r} is not in the flow table ({', '.join(FLOWS)})") from None
