"""A full disk, named once for the whole run: ``tandem up`` asks Redis whether it can persist and looks at the
free space where the run writes, and says ``disk full at PATH`` with what happens meanwhile.

While Redis cannot write its AOF it refuses writes (``MISCONF``); every service waits that out with the bus's
backoff (services/common/reconnect.py), so the run is paused, not crashing service after service. Once space
returns, Redis writes again and the run goes on by itself; the launcher says so. Paths watched: the embedded
Redis's data directory, the run directory (reports, logs) and the checkpoint root.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOW_FREE_BYTES = 16 << 20  # below this a write of a log, a report or a checkpoint shard is likely to fail


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (its nearest existing parent), or None when unknown."""
    for p in [path, *path.parents]:
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


class DiskWatch:
    """Says ``disk full at PATH`` once when Redis stops persisting or a watched path runs out of space, and
    ``disk space is back`` once it is over."""

    def __init__(self, paths: list[Path], redis_info: Callable[[], dict[str, Any]] | None,
                 say: Callable[[str], None], low_free: int = LOW_FREE_BYTES) -> None:
        self.paths, self.redis_info, self.say, self.low_free = paths, redis_info, say, low_free
        self.full: str | None = None  # the message said, while the fault lasts

    def problem(self) -> str | None:
        """Why the run cannot write now, naming the path, or None."""
        aof_error = False
        if self.redis_info is not None:
            try:
                info = self.redis_info()
                aof_error = info.get("aof_last_write_status") == "err" or info.get("rdb_last_bgsave_status") == "err"
            except Exception:  # Redis down: the supervisor names that; the free space below still speaks
                aof_error = False
        for path in self.paths:
            free = free_bytes(path)
            if free is not None and (free < self.low_free or (aof_error and path == self.paths[0])):
                return f"disk full at {path} ({free >> 20} MB free)"
        return "disk full: Redis cannot write its AOF or snapshot (MISCONF)" if aof_error else None

    def check(self) -> None:
        now = self.problem()
        if now is not None and self.full is None:
            self.say(f"{now}: Redis refuses writes and every service waits (the run is paused, nothing acknowledged "
                     "is lost); free space and the run goes on by itself, or stop it and `--resume` later")
        elif now is None and self.full is not None:
            self.say("disk space is back: the run goes on")
        self.full = now
