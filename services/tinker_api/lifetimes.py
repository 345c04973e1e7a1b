"""What the Tinker API service collects while it runs: idle sessions, unused ephemeral snapshots, expired checkpoints.

``Reaper.sweep`` runs every ``reap_every_s``:

* a session without a heartbeat (the SDK sends one every 10 s) or a training request for
  ``session_idle_s`` is finished as if its client had closed it: its models leave memory and their ephemeral
  sampler snapshots the disk; named checkpoints and the request logs stay;
* an ephemeral snapshot (``save_weights_and_get_sampling_client``) whose sampling sessions
  have not sampled for ``sampler_idle_s`` is deleted, with its engine, unless it is its
  model's newest: an RL loop samples only from its latest one; a later sample on an old one
  fails with a clear error. Named snapshots are kept;
* a checkpoint past its TTL (``save_weights_external(ttl_seconds=...)``, ``set_checkpoint_ttl``)
  is deleted.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.tinker_api.checkpoints import parse_path

if TYPE_CHECKING:
    from services.tinker_api.service import TinkerService

log = logging.getLogger("tandem.tinker_api")
EPHEMERAL = "ephemeral-"


class Reaper:
    def __init__(self, svc: TinkerService, session_idle_s: float, sampler_idle_s: float, every_s: float) -> None:
        self.svc, self.session_idle_s, self.sampler_idle_s, self.every_s = svc, session_idle_s, sampler_idle_s, every_s
        self.collected = {"sessions": 0, "snapshots": 0, "checkpoints": 0}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed sweep is logged; the next one tries again
                log.exception("collecting idle sessions and snapshots failed")

    async def sweep(self) -> dict[str, int]:
        now = time.time()
        done = {"sessions": await self._sessions(now), "snapshots": await self._snapshots(now),
                "checkpoints": await self._expired(now)}
        for k, v in done.items():
            self.collected[k] += v
        return done

    async def _sessions(self, now: float) -> int:
        store, n = self.svc.store, 0
        for sid in await store.names("session"):
            if await store.field("session", sid, "finished") is not None:
                continue
            beat = await store.field("session", sid, "heartbeat") or (await store.get("session", sid) or {}).get(
                "created")
            if beat is None:
                continue
            seen = max(float(beat), self.svc.session_used.get(sid, 0.0))
            if now - seen > self.session_idle_s:
                await store.touch("session", sid, "finished", '{"expired": "no heartbeat"}')
                models = await self.svc.finish_session(sid)
                log.info("session %s expired (idle for %.0f s): %d models dropped", sid, now - seen, models)
                n += 1
        return n

    async def _snapshots(self, now: float) -> int:
        """Ephemeral snapshot dirs whose every sampling session is idle, each model's newest kept."""
        refs: dict[str, list[dict[str, Any]]] = {}
        for sid in await self.svc.store.names("sampler"):
            rec = await self.svc.store.get("sampler", sid) or {}
            if Path(rec.get("weights", "")).name.startswith(EPHEMERAL):
                used = self.svc.sampler_used.get(sid, rec.get("created", 0.0))
                refs.setdefault(rec["weights"], []).append({"sid": sid, "used": used})
        newest: dict[Path, Path] = {}
        for w in refs:
            d = Path(w)
            if d.parent not in newest or _seq(d) > _seq(newest[d.parent]):
                newest[d.parent] = d
        idle = [w for w, users in refs.items() if Path(w) != newest[Path(w).parent]
                and all(now - u["used"] > self.sampler_idle_s for u in users)]
        removed = [w for w in idle if await asyncio.to_thread(_remove, Path(w))]
        await self.svc.samplers.forget(idle)
        return len(removed)

    async def _expired(self, now: float) -> int:
        n = 0
        for path, at in (await self.svc.store.expiries()).items():
            if at > now:
                continue
            model_id, kind, name = parse_path(path)
            d = self.svc.workshop.local_dir(model_id, kind, name)
            await asyncio.to_thread(shutil.rmtree, d, True)
            await self.svc.samplers.forget([str(d)])
            await self.svc.store.set_expiry(path, None)
            n += 1
        return n


def _remove(d: Path) -> bool:
    """Delete a snapshot directory; False if it was gone already."""
    if not d.is_dir():
        return False
    shutil.rmtree(d, ignore_errors=True)
    return True


def _seq(d: Path) -> int:
    tail = d.name[len(EPHEMERAL):]
    return int(tail) if tail.isdigit() else -1
