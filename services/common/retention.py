"""A stream's retention (docs/architecture.md §2.2): trimming what every group has acknowledged
(``trim_acknowledged``), and the bus's done-id sets (``DoneIds``: which messages a consumer group has already
handled), bounded by the stream's retention rather than by a fixed TTL.

One sorted set per (stream, group), ``Streams.done_set``: member = the message id, score = the millisecond part
of the newest stream entry that carried it (Redis's own clock, from the entry id). A consumer checks a whole
read at once (``ZMSCORE``) and records a completion burst in its acknowledging pipeline (``ZADD GT``).

Pruning (``prune``, at most every ``PRUNE_EVERY_S``): ids whose entry is older than the stream's first retained
entry by more than ``grace_s`` are removed. Why that is safe:

* a redelivery (this consumer's pending entries re-read, ``XAUTOCLAIM``) only ever returns entries that are
  still in the stream, and ``Bus.trim_acknowledged`` only cuts entries every group has acknowledged, so an
  entry older than the stream's trimmed range is never delivered again;
* the only other way the same message id reaches the stream again is its producer retrying the same
  ``XADD`` (ids are made once per message object, ``contracts.messages.new_id``; ``Bus.publish`` and the
  ledger's emission retry while Redis is unreachable, at most ``RECONNECT_WINDOW_S``). Such a copy is at
  most ``grace_s`` (= that window) newer than the entry scored here; while it is still in the stream the
  first retained entry is no newer than it, so the id's score is within ``grace_s`` of the floor and it is
  kept until the copy too has been trimmed.

A stream that is never trimmed (``run.trim_interval_s: 0``) keeps every id, exactly as it keeps every entry.
A done set stored as a plain set (unscored ids under a 7-day TTL) is converted once (``migrate``), its ids
scored "now", so a run's Redis in that form resumes with every id it held.

Which deliveries are checked (``services/common/bus/core.py``): a copy of a message id only reaches a stream as a
redelivery (re-read pending, ``XAUTOCLAIM``) or as a publish its producer knows is another (a retried ``XADD``,
or an id that producer published before: ``RecentIds``); those copies carry the ``again`` field
(``bus.adds.AGAIN``), and only they, redeliveries and ids this consumer has handled lately (``RecentIds``) pay
the done-set check. A first delivery of an id published once cannot have been handled, so it skips the round
trip.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from redis.exceptions import ResponseError

from services.common.reconnect import RECONNECT_WINDOW_S

PRUNE_EVERY_S = 30.0
RECENT_IDS = 4096  # message ids a producer or consumer remembers (about 0.5 MB)


class RecentIds:
    """The last ``size`` ids added, oldest forgotten first: what a Bus published lately, or what one consume
    loop has handled (and recorded in its done set) lately. Bounded, so memory stays flat in a long run."""

    def __init__(self, size: int = RECENT_IDS) -> None:
        self.size = size
        self.ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, msg_id: str) -> bool:
        return msg_id in self.ids

    def add(self, msg_ids: Iterable[str]) -> None:
        for msg_id in msg_ids:
            self.ids[msg_id] = None
            self.ids.move_to_end(msg_id)
        while len(self.ids) > self.size:
            self.ids.popitem(last=False)


async def trim_acknowledged(redis: Any, stream: str) -> int:
    """Trim the entries of ``stream`` that every group has acknowledged; returns entries removed."""
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:
        return 0
    if not groups:
        return 0
    floor: tuple[int, int] | None = None
    for g in groups:
        pending = await redis.xpending(stream, g["name"])
        if pending["pending"]:
            cut = pending["min"]
        else:
            last = g["last-delivered-id"]
            ms, seq = (int(x) for x in (last.decode() if isinstance(last, bytes) else last).split("-"))
            cut = f"{ms}-{seq + 1}"
        cut_s = cut.decode() if isinstance(cut, bytes) else cut
        key = (int(cut_s.split("-")[0]), int(cut_s.split("-")[1]))
        floor = key if floor is None or key < floor else floor
    assert floor is not None
    return int(await redis.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))


def entry_ms(entry_id: bytes | str) -> int:
    """The millisecond part of a stream entry id (``1700000000000-3`` -> 1700000000000)."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0])


class DoneIds:
    """The done-id set of one consumer group of one stream."""

    def __init__(self, redis: Any, stream: str, key: str, *, grace_s: float = RECONNECT_WINDOW_S,
                 prune_every_s: float = PRUNE_EVERY_S) -> None:
        self.redis, self.stream, self.key = redis, stream, key
        self.grace_ms = int(grace_s * 1000)
        self.prune_every_s = prune_every_s
        self._next_prune = 0.0

    async def migrate(self) -> None:
        """Convert a plain set of ids (kept by a 7-day TTL) into the scored set, once."""
        if await self.redis.type(self.key) not in (b"set", "set"):
            return
        members = await self.redis.smembers(self.key)
        now = int(time.time() * 1000)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)
            if members:
                pipe.zadd(self.key, {m: now for m in members})
            await pipe.execute()

    async def which_done(self, msg_ids: list[str]) -> list[bool]:
        if not msg_ids:
            return []
        scores = await self.redis.zmscore(self.key, msg_ids)
        return [s is not None for s in scores]

    def add(self, pipe: Any, done: list[tuple[str, bytes]]) -> None:
        """Queue on ``pipe`` the (message id, entry id) pairs just handled (the newest entry's time wins)."""
        if done:
            pipe.zadd(self.key, {mid: entry_ms(eid) for mid, eid in done}, gt=True)

    async def prune(self, force: bool = False) -> int:
        """Remove ids older than the stream's retained range (see the module docstring); returns how many."""
        now = time.monotonic()
        if not force and now < self._next_prune:
            return 0
        self._next_prune = now + self.prune_every_s
        floor = await self.retained_floor_ms()
        if floor is None:
            return 0
        return int(await self.redis.zremrangebyscore(self.key, "-inf", f"({floor - self.grace_ms}"))

    async def retained_floor_ms(self) -> int | None:
        """The time of the stream's oldest retained entry; of its last entry + 1 ms when all are trimmed."""
        first = await self.redis.xrange(self.stream, count=1)
        if first:
            return entry_ms(first[0][0])
        try:
            info = await self.redis.xinfo_stream(self.stream)
        except ResponseError:  # no such stream
            return None
        last = info.get("last-generated-id")
        return entry_ms(last) + 1 if last else None
