"""Bounded history (docs/architecture.md §10): per-step records that outlive what Redis must hold move to an
append-only JSONL file, and readers join the file with what Redis still holds.

* ``append_jsonl`` appends records durably (fsync) and first cuts a torn last line a crash left behind, so a
  half-written record never swallows the next one. ``read_jsonl`` skips a line it cannot parse (only the
  last one can be torn, and its record is still in Redis: it is archived again by the next spill).
* The trainer's log (``Streams.train_log``): ``TrainLogSpill`` keeps the newest ``kept`` records in Redis and
  appends older ones to ``<checkpoint_root>/<run>/<agent>/train_log.jsonl`` (beside the checkpoints the
  records name, where the rollout and the coordinator already read; readers read Redis first, then the
  file). Its trained-sample ids leave the
  trained-sample set (``Streams.trained_samples``) in the same transaction that trims the records: the set
  always holds exactly the samples of the records still in Redis. Why that is safe is in ``TrainLogSpill``.
* Order of a spill: archive (fsynced), then trim Redis (one transaction). A crash between them archives
  those records again later: a record may be in the file twice (same ``version``), never lost;
  ``read_train_log`` keeps one per version.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.contracts.records import TrainLogRecord
from services.contracts.streams import Streams

TRAIN_LOG_ARCHIVE = "train_log.jsonl"
SPILL_BATCH = 16  # records moved at once: Redis holds at most kept + SPILL_BATCH - 1 of them


def append_jsonl(path: Path, lines: list[bytes]) -> None:
    """Append JSON records (one a line) to ``path`` and fsync; a torn last line is cut first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(max(0, size - 1))
            if f.read(1) != b"\n":  # a crash tore the last append: drop the partial line (still in Redis)
                f.seek(0)
                data = f.read()
                f.truncate(data.rfind(b"\n") + 1)
                f.seek(0, os.SEEK_END)
        f.write(b"".join(line.rstrip(b"\n") + b"\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The records of ``path``, oldest first; none when it does not exist; an unparsable line is skipped."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; a generator)
    except FileNotFoundError:
        return
    with f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield rec


def train_log_archive(checkpoint_root: str | Path, run: str, agent: str) -> Path:
    return Path(checkpoint_root) / run / agent / TRAIN_LOG_ARCHIVE


async def read_train_log(redis: Any, streams: Streams, agent: str, archive: Path) -> list[TrainLogRecord]:
    """Every committed record of the agent's trainer, by version: the ones in Redis, then the archive's.

    Redis first: a spill archives before it trims, so a record trimmed before the Redis read is already in
    the archive read after it. The other order loses the records a spill moves between the two reads."""
    in_redis = [TrainLogRecord.parse(raw) for raw in await redis.lrange(streams.train_log(agent), 0, -1)]
    by_version: dict[int, TrainLogRecord] = {}
    archived = await asyncio.to_thread(lambda: [TrainLogRecord.parse(rec) for rec in read_jsonl(archive)])
    for rec in [*archived, *in_redis]:
        by_version[rec.weight_version] = rec
    return [by_version[v] for v in sorted(by_version)]


class TrainLogSpill:
    """Keeps the newest ``kept`` train-log records (and their trained-sample ids) in Redis; archives the rest.

    Why dropping a record's sample ids from the trained-sample set is safe (nothing is trained twice): the
    set refuses a sample that reaches the trainer again. A trained sample can only reach it again

    * as a redelivery of its own batch entry: the trainer acknowledges a batch right after committing it, so
      only the batches committed since its last acknowledgement (the newest one or two) can be redelivered,
      and their records are among the newest ``kept`` (``kept`` >= ``MIN_KEPT``); older entries are also in
      the bus's done set, which skips them before the handler;
    * in another batch: impossible, the buffer removes a batch's samples in the transaction that releases it,
      and a redelivered sample of an already decided group is not stored again (buffer/store.py).

    The records the coordinator's report and a restarted rollout need stay readable: the report reads the
    archive with Redis (``read_train_log``); a rollout only verifies versions at most ``max_staleness + 1``
    behind the newest commit, which ``kept`` covers (the trainer keeps ``max(run.state_kept_steps,
    max_staleness + MIN_KEPT)``)."""

    MIN_KEPT = 4

    def __init__(self, redis: Any, streams: Streams, agent: str, archive: Path, kept: int) -> None:
        self.redis, self.streams, self.agent, self.archive = redis, streams, agent, archive
        self.kept = max(kept, self.MIN_KEPT)
        self.batch = SPILL_BATCH

    async def spill(self, force: bool = False) -> int:
        """Move the records beyond the newest ``kept`` to the archive once ``batch`` (``SPILL_BATCH``) are due
        (any number with ``force``); returns how many left Redis. The trainer calls it between steps (one writer)."""
        s, key = self.streams, self.streams.train_log(self.agent)
        excess = int(await self.redis.llen(key)) - self.kept
        if excess <= 0 or (excess < self.batch and not force):
            return 0
        raws = list(await self.redis.lrange(key, 0, excess - 1))
        await asyncio.to_thread(append_jsonl, self.archive, [bytes(r) for r in raws])
        sample_ids = [sid for raw in raws for sid in TrainLogRecord.parse(raw).sample_ids]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.ltrim(key, len(raws), -1)
            if sample_ids:
                pipe.srem(s.trained_samples(self.agent), *sample_ids)
            await pipe.execute()
        return len(raws)
