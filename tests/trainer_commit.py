"""What a trainer's commit of a version leaves in Redis (train-log record, published version) and the signed
``WeightsUpdate`` it publishes, for tests that drive the rollout without a trainer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from services.common.bus import Bus
from services.common.weights_auth import run_secret, sign, weights_checksum
from services.contracts.messages import WeightsUpdate


async def commit_weights(bus: Bus, agent: str, version: int, path: Path | str) -> WeightsUpdate:
    """Record ``path`` as the agent's committed ``version`` (as the trainer's ``commit`` does) and sign it."""
    s, p = bus.streams, str(path)
    checksum = await asyncio.to_thread(weights_checksum, p)
    rec = {"version": version, "batch_id": f"b{version}", "sample_ids": [], "path": p, "checksum": checksum}
    await bus.redis.rpush(s.train_log(agent), json.dumps(rec))
    published = int(await bus.redis.get(s.published_weight_version(agent)) or 0)
    await bus.redis.set(s.published_weight_version(agent), max(published, version))
    secret = run_secret()
    return WeightsUpdate(agent=agent, weight_version=version, path=p, checksum=checksum,
                         signature=sign(secret, agent, version, p, checksum))
