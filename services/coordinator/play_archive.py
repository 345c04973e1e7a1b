"""Bounded training-play counts (docs/architecture.md §10): the per-version counts of ``coord:train_play``
(train_play.py) for versions the run has left behind move to ``runs/<run>/train_play.jsonl``; ``load`` sums
the archive, a pending move and Redis, so a restarted coordinator has every version's counts.

A move (``prune``), safe against a crash at any point (counted once, never lost):

1. one script moves the chosen fields from the hash to a staging hash, tagged with a new move number (the
   ``:seq`` counter): the counts are then in exactly one of the two, atomically;
2. the staging hash is appended (fsynced) to the archive as one record ``{"seq", "counts"}``, unless the
   archive already holds that move (a crash after the append); then the staging hash is deleted.

A crash between 1 and 2 leaves the staging hash: the next move or ``load`` finishes it (``load`` counts it
once: from the archive when its move is there, from staging otherwise). A late episode of a moved version
adds to the hash again; a later move moves that too, and ``load`` sums every move.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from services.common.history import append_jsonl, read_jsonl
from services.coordinator.train_play import PlayCounts

ARCHIVE = "train_play.jsonl"
log = logging.getLogger("tandem.coordinator.play_archive")

# KEYS: counts hash, staging hash, move counter; ARGV: fields to move. Returns the move's number (0: none moved).
MOVE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local seq = redis.call('INCR', KEYS[3])
local n = 0
for i = 1, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    redis.call('HSET', KEYS[2], ARGV[i], v)
    redis.call('HDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
if n == 0 then return 0 end
redis.call('HSET', KEYS[2], '_seq', seq)
return seq
"""


def _add(out: dict[str, dict[int, PlayCounts]], fields: dict[str, Any]) -> None:
    """Add ``agent|version|what -> value`` fields (train_play.save's layout) to ``out``."""
    for name, value in fields.items():
        if name == "_seq":
            continue
        agent, version, what = name.rsplit("|", 2)
        c = out.setdefault(agent, {}).setdefault(int(version), PlayCounts())
        setattr(c, what, getattr(c, what) + (float(value) if what == "reward" else int(value)))


def _decode(raw: dict[Any, Any]) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}


def _archived(path: Path) -> dict[int, dict[str, str]]:
    """Move number -> its counts, once each (a move appended twice after a crash is counted once)."""
    return {int(rec["seq"]): rec["counts"] for rec in read_jsonl(path) if "seq" in rec}


async def _finish(redis: Any, key: str, path: Path) -> None:
    """Append a staged move to the archive (unless it is there already), then drop the staging hash."""
    staged = _decode(await redis.hgetall(key + ":staging"))
    if not staged:
        return
    seq = int(staged["_seq"])
    if seq not in await asyncio.to_thread(_archived, path):
        counts = {k: v for k, v in staged.items() if k != "_seq"}
        line = json.dumps({"seq": seq, "counts": counts}).encode()
        await asyncio.to_thread(append_jsonl, path, [line])
    await redis.delete(key + ":staging")


async def prune(redis: Any, key: str, run_dir: Path, below: dict[str, int]) -> int:
    """Move the counts of every agent's versions older than ``below[agent]`` to the archive; returns fields
    moved. Only the coordinator writes ``key`` (one at a time), so one move is staged at most."""
    path = Path(run_dir) / ARCHIVE
    await _finish(redis, key, path)
    fields = [f for f in _decode(await redis.hgetall(key))
              if (parts := f.rsplit("|", 2))[0] in below and int(parts[1]) < below[parts[0]]]
    if not fields:
        return 0
    script = redis.register_script(MOVE)
    if not int(await script(keys=[key, key + ":staging", key + ":seq"], args=fields)):
        return 0
    await _finish(redis, key, path)
    return len(fields)


async def load(redis: Any, key: str, run_dir: Path) -> dict[str, dict[int, PlayCounts]]:
    """agent -> version -> counts: the archive's moves, a staged move not yet archived, and the hash."""
    path = Path(run_dir) / ARCHIVE
    out: dict[str, dict[int, PlayCounts]] = {}
    archived = await asyncio.to_thread(_archived, path)
    for counts in archived.values():
        _add(out, counts)
    staged = _decode(await redis.hgetall(key + ":staging"))
    if staged and int(staged["_seq"]) not in archived:
        _add(out, staged)
    _add(out, _decode(await redis.hgetall(key)))
    return out


async def prune_behind(redis: Any, streams: Any, key: str, run_dir: Path, horizons: dict[str, int]) -> int:
    """``prune`` the versions more than ``horizons[agent]`` behind each agent's published version (the
    group ledger's horizon: ledger.py ``horizons``)."""
    below = {a: int(await redis.get(streams.published_weight_version(a)) or 0) - h for a, h in horizons.items()}
    try:
        return await prune(redis, key, run_dir, {a: v for a, v in below.items() if v > 0})
    except OSError as exc:  # a full or unwritable disk: the counts stay in Redis (or staged) until a later move
        log.warning("cannot archive training-play counts under %s: %r", run_dir, exc)
        return 0
