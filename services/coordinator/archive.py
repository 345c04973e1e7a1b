"""Bounded transcripts (docs/architecture.md §10): the run's episode hash (``Streams.episodes``) keeps the
newest ``run.transcripts_kept`` transcripts per purpose (train, eval); older ones are archived, compressed,
to ``runs/<run>/transcripts.jsonl.gz`` and removed from Redis.

* What: the episode's record, with the dashboard's per-reply tokens (``dashboard:tokens:<id>``, otherwise
  kept 24 h) under ``reply_tokens`` when they are still there; both leave Redis together.
* Order: one Redis list per purpose (``episodes:order:<purpose>``), episode ids appended as they are recorded.
* Spilling: once a purpose holds ``ARCHIVE_BATCH`` more than it keeps, the oldest excess is appended to the
  archive as one gzip member (one JSON record a line; a gzip file of several members reads as one stream:
  ``gzip.open(path, "rt")``), fsynced, and only then removed from the hash and the order list (one
  transaction). So Redis holds at most ``transcripts_kept + ARCHIVE_BATCH - 1`` per purpose.
* A crash between the append and the removal archives that batch again on the next spill: a record may be
  in the archive twice (same ``id``), never lost. One spill runs at a time (a lock).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.common.bus import Bus
from services.coordinator.dashboard.transcripts import save_tokens, tokens_key
from services.coordinator.record import RunRecord
from services.play.episode import EpisodeResult

ARCHIVE_BATCH = 32
ARCHIVE_NAME = "transcripts.jsonl.gz"


def append_gzip(path: Path, lines: list[bytes]) -> None:
    """Append ``lines`` (JSON records) to the gzip file at ``path`` as one member, durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as raw:
        with gzip.GzipFile(fileobj=raw, mode="ab") as gz:
            gz.write(b"".join(line.rstrip(b"\n") + b"\n" for line in lines))
        raw.flush()
        os.fsync(raw.fileno())


def read_archive(path: Path | str) -> Iterator[dict[str, Any]]:
    """Every archived transcript record, oldest first (a record archived twice appears twice)."""
    p = Path(path)
    if not p.is_file():
        return
    with gzip.open(p, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def with_tokens(record: bytes, tokens: bytes | None) -> bytes:
    """The archived line: the episode's record, with its reply tokens when they were kept."""
    if tokens is None:
        return record
    data = json.loads(record)
    data["reply_tokens"] = json.loads(tokens)
    return json.dumps(data, separators=(",", ":")).encode()


class TranscriptArchive:
    def __init__(self, bus: Bus, keep: int, run_dir: Path, batch: int = ARCHIVE_BATCH) -> None:
        self.bus, self.keep, self.batch = bus, keep, max(1, batch)
        self.path = Path(run_dir) / ARCHIVE_NAME
        self.lock = asyncio.Lock()

    def order_key(self, purpose: str) -> str:
        return self.bus.streams.key(f"episodes:order:{purpose}")

    async def add(self, episode_id: str, purpose: str) -> int:
        """Record that the episode's transcript is in the hash; archive the oldest when over the limit.
        Returns how many were archived now."""
        held = int(await self.bus.redis.rpush(self.order_key(purpose), episode_id))
        if held - self.keep < self.batch:
            return 0
        return await self.spill(purpose)

    async def spill(self, purpose: str) -> int:
        """Archive every transcript of ``purpose`` beyond the newest ``keep``."""
        async with self.lock:
            r, order = self.bus.redis, self.order_key(purpose)
            excess = int(await r.llen(order)) - self.keep
            if excess <= 0:
                return 0
            ids = [i.decode() for i in await r.lrange(order, 0, excess - 1)]
            token_keys = [tokens_key(self.bus.streams.key, i) for i in ids]
            raws = await r.hmget(self.bus.streams.episodes(), ids)
            tokens = await r.mget(token_keys)
            lines = [with_tokens(raw, tok) for raw, tok in zip(raws, tokens, strict=True) if raw is not None]
            if lines:
                await asyncio.to_thread(append_gzip, self.path, lines)
            async with r.pipeline(transaction=True) as pipe:
                pipe.hdel(self.bus.streams.episodes(), *ids)
                pipe.delete(*token_keys)
                pipe.ltrim(order, len(ids), -1)
                await pipe.execute()
            return len(lines)


async def store_episode(bus: Bus, archive: TranscriptArchive, run_record: RunRecord, result: EpisodeResult,
                        rec: dict[str, Any]) -> None:
    """Write one episode's transcript, spill the oldest over the limit, count the episode and keep its reply
    tokens for the dashboard. Each write is retried through a Redis restart: a restart must not fail the
    group (a repeated spill may archive a record twice, never lose one)."""
    retry, key = bus.retrying, bus.streams.episodes()
    await retry("recording an episode", lambda: bus.redis.hset(key, result.episode_id, json.dumps(rec)))
    await retry("archiving old transcripts", lambda: archive.add(result.episode_id, rec.get("purpose", "train")))
    await retry("counting an episode", run_record.count_episode)
    await retry("saving an episode's tokens", lambda: save_tokens(bus, result))
