"""The key table: every Redis key (not a stream) that more than one service writes or reads, who owns it, who
writes and reads it, and what its values are; and the Lua scripts that touch shared keys, with their KEYS.

Every key is ``tandem:{run}:{name}`` (``streams.Streams``: ``helper`` names the method that builds it).
tests/unit/test_keys.py reads every Redis call in ``services/`` and fails on a service that reads or writes a
shared key without being listed here, on a key two services touch that is not listed, and on a script call
whose KEYS differ from the script's entry. Services still meet only through these keys and the streams
(contracts/flows.py): a shared key's owner decides its meaning; the others follow this table.

| key                             | owner       | writers                      | readers              | value          |
|---------------------------------|-------------|------------------------------|----------------------|----------------|
| coord:ledger:{agent}            | coordinator | coordinator                  | buffer               | LedgerEntry    |
| groups:{agent}:pending          | coordinator | coordinator, buffer          |                      | emission times |
| buffer:{agent}:verdicts         | buffer      | buffer, trainer, coordinator |                      | Verdict        |
| buffer:{agent}:group:{group_id} | buffer      | buffer                       | coordinator          | sample ids     |
| buffer:{agent}:released         | buffer      | buffer, trainer              |                      | batch count    |
| trainer:{agent}:log             | trainer     | trainer                      | coordinator, rollout | TrainLogRecord |
| trainer:{agent}:skipped_batches | trainer     | trainer                      | coordinator          | SkipRecord     |
| state:{agent}:published_version | trainer     | trainer                      | coordinator, rollout | weight version |
| state:{agent}:loaded_version    | rollout     | rollout                      | coordinator          | weight version |
| state:{agent}:engine_adapters   | rollout     | rollout                      |                      | KeptAdapter    |
| service_starts                  | *           | every service                | coordinator          | starts         |
| {stream}:done:{group}           | *           | every consumer, its own      |                      | message ids    |

The trainer writes the verdicts and the released count through its ``SKIP`` script, the buffer removes a
pending group in ``DECIDE``, the coordinator deletes verdicts with its ledger entries in ``FORGET``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.contracts.records import KeptAdapter, LedgerEntry, SkipRecord, TrainLogRecord, Verdict

ANY_SERVICE = "*"
Mode = Literal["read", "write"]


@dataclass(frozen=True)
class SharedKey:
    name: str  # the key under tandem:{run}: (its fields in braces)
    helper: str  # the ``Streams`` method that builds it; ``key:<name>`` for ``Streams.key(<name>)``
    owner: str  # the service whose fact it is
    writers: tuple[str, ...]  # services (package names under services/); "*": every service
    readers: tuple[str, ...]  # services that read it without writing it
    value: type | str  # the model of one value (a hash field's, a list item's), or what it holds

    @property
    def services(self) -> tuple[str, ...]:
        return (*self.writers, *self.readers)


@dataclass(frozen=True)
class Script:
    """A Lua script that touches shared keys: its module constant, the service that runs it, its KEYS in order."""

    name: str
    service: str
    keys: tuple[tuple[str, Mode], ...]  # (Streams helper, what the script does with it)


KEYS: dict[str, SharedKey] = {k.helper: k for k in (
    SharedKey("coord:ledger:{agent}", "group_ledger", "coordinator", ("coordinator",), ("buffer",), LedgerEntry),
    SharedKey("groups:{agent}:pending", "groups_pending", "coordinator", ("coordinator", "buffer"), (),
              "sorted set: group id scored by its emission time (the buffer removes it with the verdict)"),
    SharedKey("buffer:{agent}:verdicts", "buffer_verdicts", "buffer", ("buffer", "trainer", "coordinator"), (),
              Verdict),
    SharedKey("buffer:{agent}:group:{group_id}", "buffer_group", "buffer", ("buffer",), ("coordinator",),
              "set: ids of the group's samples stored and not yet released"),
    SharedKey("buffer:{agent}:released", "batches_released", "buffer", ("buffer", "trainer"), (),
              "counter: batches released (the trainer counts a skipped one back down)"),
    SharedKey("trainer:{agent}:log", "train_log", "trainer", ("trainer",), ("coordinator", "rollout"),
              TrainLogRecord),
    SharedKey("trainer:{agent}:skipped_batches", "skipped_batches", "trainer", ("trainer",), ("coordinator",),
              SkipRecord),
    SharedKey("state:{agent}:published_version", "published_weight_version", "trainer", ("trainer",),
              ("coordinator", "rollout"), "int: the last weight version the trainer committed"),
    SharedKey("state:{agent}:loaded_version", "loaded_weight_version", "rollout", ("rollout",), ("coordinator",),
              "int: the weight version every engine of the agent loaded"),
    SharedKey("state:{agent}:engine_adapters", "engine_adapters", "rollout", ("rollout",), (),
              KeptAdapter),  # a sharing agent's rollout writes it, the fleet owner's rollout reads it
    SharedKey("service_starts", "key:service_starts", ANY_SERVICE, (ANY_SERVICE,), ("coordinator",),
              "hash: service name -> its starts in the run"),
    SharedKey("{stream}:done:{group}", "done_set", ANY_SERVICE, (ANY_SERVICE,), (),
              "sorted set per consumer group (each group's own): ids of the messages whose effect is done"),
)}

SCRIPTS: dict[str, Script] = {s.name: s for s in (
    Script("DECIDE", "buffer", (("buffer_verdicts", "write"), ("buffer_ready", "write"), ("buffer_samples", "write"),
                                ("buffer_group", "write"), ("groups_pending", "write"))),
    Script("SKIP", "trainer", (("skipped_batches", "write"), ("batches_released", "write"),
                               ("buffer_verdicts", "write"), ("nonfinite_in_row", "write"))),
    Script("FORGET", "coordinator", (("group_ledger", "write"), ("buffer_verdicts", "write"))),
)}
