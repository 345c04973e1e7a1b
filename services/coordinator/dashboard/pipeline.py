"""The pipeline now, for the dashboard: the staleness gate per agent and every service's health.

A service's health is read from Redis itself: each service reads its streams through a consumer
group under its own name, and a live one polls them every second or so, so a consumer whose last
read is older than ``STALE_S`` has stopped. Its last event on the events stream (kind, age, and the
``restarts`` count when a ``health`` event carries one) and the engines' restarts from the rollout's
load report complete the picture.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping
from typing import Any

from services.common.bus import Bus
from services.common.metrics import SERVICE_STARTS
from services.contracts.codec import FIELD, decode
from services.contracts.messages import Event
from services.coordinator.state import AgentState

STALE_S = 15.0
EVENTS_SCANNED = 500


def gate(agent: AgentState) -> dict[str, Any]:
    """An agent's launch gate (coordinator/state.py): claimed groups against the staleness limit."""
    limit = (agent.loaded_weight_version + agent.max_staleness + 1) * agent.groups_per_batch
    return {"blocked": agent.blocked_by_staleness(), "claimed": agent.claimed, "limit": limit,
            "max_staleness": agent.max_staleness, "loaded_weight_version": agent.loaded_weight_version,
            "groups": agent.group_counts(),
            "abandon_reasons": dict(agent.abandon_reasons)}  # the group ledger's reasons (ledger.py)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def consumers(redis: Any, streams: list[str], prefix: str = "") -> dict[str, list[dict[str, Any]]]:
    """Per consumer (a service), its groups on the run's streams with idle time and pending count."""
    out: dict[str, list[dict[str, Any]]] = {}
    for stream in streams:
        with contextlib.suppress(Exception):  # a stream nobody created yet
            for g in await redis.xinfo_groups(stream):
                group = _s(g["name"])
                for c in await redis.xinfo_consumers(stream, group):
                    idle = float(c.get("inactive", c.get("idle", 0)) or 0)
                    if idle < 0:  # a consumer that never read successfully
                        idle = float(c.get("idle", 0) or 0)
                    name = _s(c["name"]).removeprefix("control-")  # watch_control's group/consumer name
                    out.setdefault(name, []).append({
                        "stream": stream.removeprefix(prefix),
                        "group": group, "idle_s": round(idle / 1000, 1), "pending": int(c.get("pending", 0))})
    return out


async def recent_events(redis: Any, stream: str, count: int = EVENTS_SCANNED) -> dict[str, dict[str, Any]]:
    """Per event source, its last event (kind, age)."""
    now = time.time()
    out: dict[str, dict[str, Any]] = {}
    for _, fields in await redis.xrevrange(stream, count=count):
        try:
            ev = decode(fields[FIELD], Event)
        except Exception:
            continue
        out.setdefault(ev.source, {"last_kind": ev.kind, "last_event_s": round(now - ev.created_at, 1)})
    return out


async def service_restarts(redis: Any, key: str) -> dict[str, int]:
    """Per service, its restarts: the starts each service counts in the run's hash (metrics.record_start), less one."""
    starts = await redis.hgetall(key)
    return {_s(k): max(int(v) - 1, 0) for k, v in starts.items()}


async def services(bus: Bus, reply_stream: str, agents: Iterable[str],
                   states: Mapping[str, AgentState]) -> list[dict[str, Any]]:
    """Every service the run's streams know of (those of ``agents``, the coordinator's ``reply_stream``):
    alive (recent reads), last event, restarts (an engine's from its agent's state)."""
    s = bus.streams
    streams = [s.events, s.control, reply_stream] + [
        f(a) for a in agents for f in (s.turns, s.samples, s.batches, s.weights)]
    reads = await consumers(bus.redis, streams, s.key(""))
    events = await recent_events(bus.redis, s.events)
    started = await service_restarts(bus.redis, s.key(SERVICE_STARTS))
    restarts = {f"rollout-{a}": sum(int(e.get("restarts") or 0) for e in st.rollout.get("engines", []))
                for a, st in states.items()}
    rows = []
    for name in sorted(set(reads) | set(events) | set(started)):
        groups = reads.get(name, [])
        idle = min((g["idle_s"] for g in groups), default=None)
        ev = events.get(name, {})
        alive = (idle is not None and idle < STALE_S) or ev.get("last_event_s", 1e9) < STALE_S
        rows.append({"service": name, "healthy": alive, "idle_s": idle, "reads": groups,
                     "last_event": ev.get("last_kind"), "last_event_s": ev.get("last_event_s"),
                     "restarts": started.get(name), "engine_restarts": restarts.get(name)})
    return rows
