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
* Reading one back (``find``, the API's ``/v1/episodes/{id}`` once a transcript left Redis): the sidecar index
  ``transcripts.index`` has one line per archived record, ``<id>\t<member offset>\t<member length>``, appended
  and fsynced after the member and before the Redis copy is deleted (so an id missing from Redis is in the
  index). A lookup scans the index with ``mmap.find`` (C speed, ~40 bytes an episode: a few ms for a
  million) and decompresses only that member (at most ``ARCHIVE_BATCH`` records). An archive written before
  the index existed is indexed once, on the first lookup, by walking its members.
* Browsing (``page``, the dashboard's archive list; ``archive_page`` / ``archive_find`` read a finished run's
  archive without writing): the members newest first, each record once, filtered; a scan of the whole archive.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import mmap
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from services.common.bus import Bus
from services.coordinator.dashboard.transcripts import save_tokens, tokens_key
from services.coordinator.record import RunRecord
from services.play.episode import EpisodeResult

log = logging.getLogger("tandem.coordinator")

ARCHIVE_BATCH = 32
ARCHIVE_NAME = "transcripts.jsonl.gz"
INDEX_NAME = "transcripts.index"


def append_gzip(path: Path, lines: list[bytes]) -> tuple[int, int]:
    """Append ``lines`` (JSON records) to the gzip file at ``path`` as one member, durably; the member's
    (offset, length) in the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as raw:
        start = raw.seek(0, os.SEEK_END)
        with gzip.GzipFile(fileobj=raw, mode="ab") as gz:
            gz.write(b"".join(line.rstrip(b"\n") + b"\n" for line in lines))
        raw.flush()
        os.fsync(raw.fileno())
        return start, raw.tell() - start


def append_index(path: Path, ids: list[str], offset: int, length: int) -> None:
    """Index ``ids`` as held by the member at ``offset``, durably (after a torn last line, on a line of its own)."""
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        torn = size > 0 and os.pread(f.fileno(), 1, size - 1) != b"\n"
        f.write((b"\n" if torn else b"") + b"".join(f"{i}\t{offset}\t{length}\n".encode() for i in ids))
        f.flush()
        os.fsync(f.fileno())


def index_lookup(path: Path, episode_id: str) -> tuple[int, int] | None:
    """The (offset, length) of the first member indexed as holding ``episode_id``, or None."""
    key = episode_id.encode()
    if not key or any(c in key for c in b"\t\n\r") or not path.is_file() or path.stat().st_size == 0:
        return None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        at = 0 if m[:len(key) + 1] == key + b"\t" else m.find(b"\n" + key + b"\t")
        if at < 0:
            return None
        line_end = m.find(b"\n", at + 1)
        fields = m[at:line_end if line_end >= 0 else len(m)].strip().split(b"\t")
    if len(fields) != 3 or not (fields[1].isdigit() and fields[2].isdigit()):
        return None  # a torn line: not an entry
    return int(fields[1]), int(fields[2])


def read_member(path: Path, offset: int, length: int) -> list[dict[str, Any]]:
    """The records of the gzip member at ``offset`` (``length`` bytes)."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = zlib.decompressobj(wbits=31).decompress(f.read(length))
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def members(path: Path) -> Iterator[tuple[int, int, list[str]]]:
    """Each whole gzip member of the archive: (offset, length, the ids it holds); stops at a torn one."""
    data, at = path.read_bytes(), 0
    while at < len(data):
        d = zlib.decompressobj(wbits=31)
        try:
            text = d.decompress(data[at:])
        except zlib.error:
            log.warning("%s: unreadable gzip member at byte %d; the rest is not indexed", path, at)
            return
        if not d.eof:
            return  # a member torn by a crash during its append (its records are archived again later)
        length = len(data) - at - len(d.unused_data)
        yield at, length, [json.loads(line)["id"] for line in text.splitlines() if line.strip()]
        at += length


def read_archive(path: Path | str) -> Iterator[dict[str, Any]]:
    """Every archived transcript record, oldest first (a record archived twice appears twice)."""
    p = Path(path)
    if not p.is_file():
        return
    with gzip.open(p, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _spans(path: Path, index: Path) -> list[tuple[int, int]]:
    """The archive's members in append order: from the index, else (an archive written before the index,
    read without writing one) by walking the members."""
    if not index.is_file():
        return [(offset, length) for offset, length, _ in members(path)] if path.is_file() else []
    spans: dict[tuple[int, int], None] = {}
    for line in index.read_bytes().splitlines():
        fields = line.split(b"\t")
        if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
            spans.setdefault((int(fields[1]), int(fields[2])), None)
    return list(spans)


def newest_first(path: Path, index: Path) -> Iterator[dict[str, Any]]:
    """Every archived record once (the newest copy of one archived twice), newest first; reads only."""
    seen: set[str] = set()
    for span in reversed(_spans(path, index)):
        for rec in reversed(read_member(path, *span)):
            if rec.get("id") not in seen:
                seen.add(rec.get("id"))
                yield rec


def archive_page(path: Path, index: Path, keep: Callable[[dict[str, Any]], bool], offset: int, limit: int
                 ) -> tuple[int, list[dict[str, Any]]]:
    """The archived records ``keep`` passes, newest first: how many there are and those in
    ``[offset, offset + limit)`` (a scan of the whole archive: blocking, call it off the loop)."""
    total, page = 0, []
    for rec in newest_first(path, index):
        if keep(rec):
            if offset <= total < offset + limit:
                page.append(rec)
            total += 1
    return total, page


def archive_find(path: Path, index: Path, episode_id: str) -> dict[str, Any] | None:
    """The archived record of ``episode_id`` through the index (or a walk of the members without one); reads only."""
    where = index_lookup(index, episode_id) if index.is_file() else None
    spans = [where] if where is not None else ([] if index.is_file() else _spans(path, index))
    for span in spans:
        found = next((r for r in read_member(path, *span) if r.get("id") == episode_id), None)
        if found is not None:
            return found
    return None


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
        self.index = Path(run_dir) / INDEX_NAME
        self.lock = asyncio.Lock()
        self.index_lock = threading.Lock()  # building the index of an older archive: once, from either thread

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
                await asyncio.to_thread(self.append, [i for i, raw in zip(ids, raws, strict=True) if raw], lines)
            async with r.pipeline(transaction=True) as pipe:
                pipe.hdel(self.bus.streams.episodes(), *ids)
                pipe.delete(*token_keys)
                pipe.ltrim(order, len(ids), -1)
                await pipe.execute()
            return len(lines)

    def append(self, ids: list[str], lines: list[bytes]) -> None:
        """Archive ``lines`` (the records of ``ids``), then index them (blocking: call it off the loop)."""
        self.ensure_index()
        offset, length = append_gzip(self.path, lines)
        append_index(self.index, ids, offset, length)

    def ensure_index(self) -> None:
        """Index an archive written before the index existed (once: the index file then exists)."""
        with self.index_lock:
            if self.index.exists() or not self.path.is_file():
                return
            tmp = self.index.with_suffix(".index.partial")
            tmp.unlink(missing_ok=True)
            for offset, length, ids in members(self.path):
                append_index(tmp, ids, offset, length)
            tmp.touch()
            tmp.rename(self.index)

    def find(self, episode_id: str) -> dict[str, Any] | None:
        """The archived record of ``episode_id`` (with ``reply_tokens`` when they were kept), or None
        (blocking: call it off the loop)."""
        self.ensure_index()
        return archive_find(self.path, self.index, episode_id)

    def page(self, keep: Callable[[dict[str, Any]], bool], offset: int, limit: int
             ) -> tuple[int, list[dict[str, Any]]]:
        """``archive_page`` of this archive (blocking: call it off the loop)."""
        self.ensure_index()
        return archive_page(self.path, self.index, keep, offset, limit)


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
