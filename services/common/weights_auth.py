"""Authenticated weights: what the trainer signs when it publishes a version, what the rollout checks before
its engines load one.

* ``weights_checksum``: SHA-256 over every file of the version's directory (relative name and content,
  in name order), so a swapped ``config.json`` or shard changes it as much as a changed tensor.
* ``sign``: HMAC-SHA256 with the run's secret over (agent, version, path, checksum).
* ``run_secret``: ``TANDEM_WEIGHTS_SECRET`` when set, else the run's Redis key
  (``Streams.weights_secret``), created once per run (``SET NX``) by whichever service asks first.
* ``refusal``: why an update must not be loaded, or None: the signature (constant-time compare), the
  trainer's commit of that very version (its train log: same path and checksum, and not beyond the
  published version), and the checksum recomputed from the files on disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

from services.contracts.messages import WeightsUpdate
from services.contracts.streams import Streams

SECRET_ENV = "TANDEM_WEIGHTS_SECRET"


def weights_checksum(directory: Path | str) -> str:
    """SHA-256 over the directory's files: for each (in relative-name order) its name, size and content."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"no weights directory {root}")
    h = hashlib.sha256()
    for p in sorted(x for x in root.rglob("*") if x.is_file()):
        h.update(f"{p.relative_to(root).as_posix()}\0{p.stat().st_size}\0".encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def sign(secret: bytes, agent: str, version: int, path: str, checksum: str) -> str:
    payload = json.dumps([agent, version, path, checksum], separators=(",", ":")).encode()
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


async def run_secret(redis: Any, streams: Streams) -> bytes:
    """The run's signing secret (the env var's, or the run's Redis key, made once per run)."""
    env = os.environ.get(SECRET_ENV)
    if env:
        return env.encode()
    key = streams.weights_secret()
    await redis.set(key, secrets.token_hex(32), nx=True)
    raw = await redis.get(key)
    return raw if isinstance(raw, bytes) else str(raw).encode()


async def committed(redis: Any, streams: Streams, agent: str, version: int) -> dict[str, Any] | None:
    """The trainer's train-log record of ``version`` (one record per version, appended in order), if committed."""
    published = await redis.get(streams.published_weight_version(agent))
    if published is None or version > int(published):
        return None
    first = await redis.lindex(streams.train_log(agent), 0)  # older records may be archived (common/history.py)
    offset = int(json.loads(first).get("version", 1)) if first is not None else 1
    raw = await redis.lindex(streams.train_log(agent), version - offset) if version >= offset else None
    rec = json.loads(raw) if raw is not None else None
    if rec is not None and rec.get("version") == version:
        return rec
    for raw in await redis.lrange(streams.train_log(agent), 0, -1):  # a log not in version order: look it up
        rec = json.loads(raw)
        if rec.get("version") == version:
            return rec
    return None


async def refusal(redis: Any, streams: Streams, secret: bytes, w: WeightsUpdate) -> str | None:
    """Why the update must not be loaded (forged, uncommitted, corrupt), or None when it is authentic."""
    if not w.signature:
        return "not signed"
    if not hmac.compare_digest(w.signature, sign(secret, w.agent, w.weight_version, w.path, w.checksum)):
        return "bad signature (not signed with this run's secret)"
    rec = await committed(redis, streams, w.agent, w.weight_version)
    if rec is None:
        return f"version {w.weight_version} is not one the trainer of {w.agent!r} committed"
    if rec.get("path") != w.path or rec.get("checksum") != w.checksum:
        return f"version {w.weight_version} differs from the trainer's commit (path or checksum)"
    try:
        on_disk = await asyncio.to_thread(weights_checksum, w.path)
    except OSError as exc:
        return f"cannot read {w.path}: {exc}"
    if not hmac.compare_digest(on_disk, w.checksum):
        return f"the files under {w.path} do not match the checksum (corrupt or replaced)"
    return None
