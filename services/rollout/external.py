"""The rollout's engines as one interface (``Engines``), and its external-router side (``ExternalRouter``).

A rollout reaches its engines in one of two ways, and its handlers see only ``Engines``: ``fleet.EngineFleet``
starts, supervises and restarts its own router and engines; ``ExternalRouter`` drives a router someone else
manages and loads weights on the workers that router lists, starting nothing. The external side is what an
agent sharing another agent's engines uses (``share_engines_with``: that agent's fleet, one base, each
agent's own adapters), and what ``--router URL`` gives an operator-managed router. Sharing, it records the
adapters the engines must hold for its agent (``record``: before a load and once it serves it) for the
owner's fleet to restore on an engine it restarts, and a failing turn is held while that fleet recovers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httpx

from services.common.adapter_dir import is_adapter_dir
from services.common.sglang_router import list_workers
from services.common.weights_auth import WeightsProof
from services.rollout.adapters import AdapterSync, Served
from services.rollout.engine_client import EngineClient


class Engines(Protocol):
    """What the rollout's handlers need of its engines, however they are managed."""

    router_url: str
    token: str | None
    sync: AdapterSync  # the adapter versions the engines hold, and the one turns are generated under
    router_restarts: int

    def healthy(self) -> int: ...

    async def engine_urls(self) -> list[str]: ...

    def recovering(self) -> bool: ...

    async def load_weights(self, path: str, version: int, rejoin_timeout: float | None = None,
                           proof: WeightsProof | None = None) -> list[str]: ...

    async def resume(self, path: str, version: int, proof: WeightsProof | None) -> None: ...

    async def status(self) -> list[dict[str, Any]]: ...

    async def supervise(self, stop: asyncio.Event) -> None: ...

    async def close(self) -> None: ...


class ExternalRouter:
    """The workers of a router this rollout does not manage. ``num_engines``: how many it counts on for its
    capacity; ``shared``: the router is another agent's fleet (sharing its base), whose rollout recovers its
    engines; ``record``: where the adapters the engines must hold for this agent go (sharing only)."""

    def __init__(self, agent: str, router_url: str, token: str | None, num_engines: int, shared: bool = False,
                 record: Callable[[list[Served]], Awaitable[None]] | None = None) -> None:
        self.router_url, self.token, self.num_engines, self.shared = router_url, token, num_engines, shared
        self.record = record
        self.router_restarts = 0  # not this rollout's to restart
        self._client = EngineClient(router_url, timeout=300.0, token=token)
        self.sync = AdapterSync(agent, self._client)
        self.held: dict[str, set[str]] = {}  # per worker url, the adapters this rollout loaded on it

    def healthy(self) -> int:
        return self.num_engines

    async def engine_urls(self) -> list[str]:
        """The workers the router lists now."""
        return await list_workers(self.router_url, token=self.token)

    def recovering(self) -> bool:
        """A shared fleet's owner restarts what failed: its sharers hold a failing turn meanwhile."""
        return self.shared

    async def load_weights(self, path: str, version: int, rejoin_timeout: float | None = None,
                           proof: WeightsProof | None = None) -> list[str]:
        """Load ``path`` as ``version`` on every worker the router lists (an adapter on its resident base, then
        served, with the versions beyond the kept ones unloaded; full weights in place); their urls."""
        adapter = is_adapter_dir(path)
        if adapter and self.record is not None:  # an engine the owner restarts meanwhile gets it too
            await self.record(self.sync.with_next(path, version, proof))
        engines = await list_workers(self.router_url, token=self.token)
        await asyncio.gather(*(self._load_on(url, path, version, proof) for url in engines))
        if adapter and engines:
            old = self.sync.record(path, version, proof)
            await asyncio.gather(*(self.sync.unload(url, self.held.setdefault(url, set()), old) for url in engines))
            if self.record is not None:
                await self.record(self.sync.kept)
        return engines

    async def _load_on(self, url: str, path: str, version: int, proof: WeightsProof | None) -> None:
        if is_adapter_dir(path):
            await self.sync.load(url, self.held.setdefault(url, set()), path, version, proof)
        else:
            await self._client.update_weights(url, path, version, proof)

    async def resume(self, path: str, version: int, proof: WeightsProof | None) -> None:
        """The workers outlive this rollout: go on naming the adapter they were given last."""
        if is_adapter_dir(path):
            self.sync.record(path, version, proof)
            if self.record is not None:
                await self.record(self.sync.kept)

    async def status(self) -> list[dict[str, Any]]:
        """The workers the router lists (none while it does not answer: it may be down a while)."""
        with contextlib.suppress(httpx.HTTPError, RuntimeError):
            return [{"url": u, "healthy": True} for u in await list_workers(self.router_url, token=self.token)]
        return []

    async def supervise(self, stop: asyncio.Event) -> None:
        """Nothing to supervise: whoever manages the router does."""
        await stop.wait()

    async def close(self) -> None:
        await self._client.aclose()
