"""Restart bookkeeping of ``tandem up``: the run's ``state:restarts`` hash, and the engines' and routers'
restarts and silences read off the coordinator's status (each rollout's fleet counts them)."""

from __future__ import annotations

import logging

import redis as redis_lib

from services.contracts.streams import Streams

log = logging.getLogger("tandem.launcher")
SILENT_NAMED_S = 5.0  # an engine whose health check hangs this long is named in the live view


class EngineRestarts:
    """Engine and router restarts per agent (``engines.<agent>``, ``router.<agent>``) from the statuses the
    launcher polls: each rollout's fleet counts them, from 0 again when the rollout itself restarts."""

    def __init__(self, ledger: RestartLedger) -> None:
        self.ledger = ledger
        self.seen: dict[str, int] = {}  # name -> restarts the current rollout reports
        self.total: dict[str, int] = {}  # name -> restarts in this session

    def update(self, status: dict | None) -> None:
        for agent, a in ((status or {}).get("agents") or {}).items():
            rollout = a.get("rollout") or {}
            self._count(f"engines.{agent}", sum(int(e.get("restarts") or 0) for e in rollout.get("engines") or []))
            self._count(f"router.{agent}", int(rollout.get("router_restarts") or 0))

    def _count(self, name: str, now: int) -> None:
        new = now - self.seen.get(name, 0) if now >= self.seen.get(name, 0) else now  # a new fleet
        self.seen[name] = now
        if new > 0:
            self.total[name] = self.total.get(name, 0) + new
            self.ledger.record(name, self.total[name], new)


def silent_engines(status: dict | None, after_s: float = SILENT_NAMED_S) -> list[str]:
    """``engine URL of agent X: no answer for N s`` for each engine whose health checks hang past ``after_s``."""
    return [f"engine {e.get('url')} of {agent}: no answer for {float(e['silent_s']):.0f}s"
            for agent, a in ((status or {}).get("agents") or {}).items()
            for e in (a.get("rollout") or {}).get("engines") or []
            if float(e.get("silent_s") or 0) >= after_s]


class RestartLedger:
    """Restarts per service in the run's Redis hash ``state:restarts`` (the coordinator's report reads it;
    a resumed run adds to the counts of the sessions before)."""

    def __init__(self, redis_url: str, run: str) -> None:
        self.client = redis_lib.Redis.from_url(redis_url, socket_timeout=5)
        self.key = Streams(run).restarts()
        self.pending: dict[str, int] = {}  # restarts not yet written (Redis was down)

    def record(self, name: str, _count: int, n: int = 1) -> None:
        """Add ``n`` restarts of ``name``; while Redis is down (its own restart is under way) they wait for
        the next record or ``counts``."""
        self.pending[name] = self.pending.get(name, 0) + n
        self.flush()

    def flush(self) -> None:
        for name, n in list(self.pending.items()):
            try:
                self.client.hincrby(self.key, name, n)
            except redis_lib.RedisError as exc:
                log.info("restarts of %s not recorded yet: %s", name, exc)
                return
            del self.pending[name]

    def counts(self, local: dict[str, int]) -> dict[str, int]:
        self.flush()
        try:
            stored = {k.decode(): int(v) for k, v in self.client.hgetall(self.key).items()}
        except redis_lib.RedisError:
            stored = {}
        return {name: max(stored.get(name, 0), n) for name, n in {**stored, **local}.items()}
