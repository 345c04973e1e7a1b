"""Which LoRA adapter versions an agent's engines hold, and which one its turns are generated under.

Under ``lora`` the trainer publishes each version as a PEFT adapter directory (``is_adapter_dir``). The
rollout loads it on every engine by SGLang's ``/load_lora_adapter`` under the name ``{agent}-v{version}``
(unique per agent, so agents may share engines), and only once every engine holds it does ``serving``
name it: each turn is sent with ``lora_path`` set to that name and records that version, so a turn is
generated under exactly the version it records. The newest ``KEPT`` versions stay loaded: a turn sent
under the previous name just before a switch still finds it; older ones are unloaded (the engine waits for
the requests that name them). A restarted engine holds none: ``catch_up`` loads the kept ones before it
takes traffic.

Agents that share one fleet (``share_engines_with``: services/contracts/sharing.py) load their adapters on
the same engines, each under its own names. A sharing agent's rollout records the versions the engines must
hold for it (``publish_kept``: before it loads a new one, and again once it serves it); the fleet owner's
rollout reads them (``read_kept``) and loads them on an engine it restarts before that engine takes turns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError
from redis.exceptions import RedisError

from services.common.weights_auth import WeightsProof
from services.contracts.records import KeptAdapter
from services.contracts.streams import Streams
from services.rollout.engine_client import EngineClient, EngineClientError

KEPT = 2
KEPT_LIST = TypeAdapter(list[KeptAdapter])
log = logging.getLogger("tandem.rollout.adapters")


def adapter_name(agent: str, version: int) -> str:
    return f"{agent}-v{version}"


@dataclass(frozen=True)
class Served:
    """One adapter version on the engines: its name there, its directory, its weight version, the trainer's
    proof (checksum and signature) that engines check before loading it."""

    name: str
    path: str
    version: int
    proof: WeightsProof | None = None


class AdapterSync:
    """One agent's adapter versions on its engines (``held``: per engine, the names it holds)."""

    def __init__(self, agent: str, client: EngineClient) -> None:
        self.agent, self.client = agent, client
        self.kept: list[Served] = []  # the newest last; every engine that serves holds them all

    def serving(self) -> Served | None:
        """The adapter turns are generated under now (None: the base model, version 0 or full weights)."""
        return self.kept[-1] if self.kept else None

    async def load(self, url: str, held: set[str], path: str, version: int,
                   proof: WeightsProof | None = None) -> None:
        """Load version ``version`` (directory ``path``) on the engine at ``url`` unless it holds it."""
        name = adapter_name(self.agent, version)
        if name not in held:
            await self.client.load_adapter(url, name, path, proof)
            held.add(name)

    async def catch_up(self, url: str, held: set[str]) -> None:
        """Load every kept version the engine lacks (a restarted engine, a new one)."""
        for s in self.kept:
            await self.load(url, held, s.path, s.version, s.proof)

    def with_next(self, path: str, version: int, proof: WeightsProof | None = None) -> list[Served]:
        """The kept versions and ``version`` (about to be loaded): what the engines must hold meanwhile."""
        return [*(s for s in self.kept if s.version != version),
                Served(adapter_name(self.agent, version), path, version, proof)]

    def missing(self, held: set[str]) -> bool:
        return any(s.name not in held for s in self.kept)

    def record(self, path: str, version: int, proof: WeightsProof | None = None) -> list[str]:
        """Every engine holds ``version`` now: serve it; the names to unload (beyond the newest ``KEPT``)."""
        self.kept = [s for s in self.kept if s.version != version]
        self.kept.append(Served(adapter_name(self.agent, version), path, version, proof))
        old, self.kept = self.kept[:-KEPT], self.kept[-KEPT:]
        return [s.name for s in old]

    async def unload(self, url: str, held: set[str], names: list[str]) -> None:
        """Unload ``names`` from one engine; a failure only costs memory, so it is logged, not raised."""
        for name in names:
            if name not in held:
                continue
            try:
                await self.client.unload_adapter(url, name)
            except EngineClientError as exc:
                log.warning("could not unload adapter %s from %s: %s", name, url, exc)
            held.discard(name)


async def publish_kept(redis: Any, streams: Streams, agent: str, kept: list[Served]) -> None:
    """Record the adapter versions every engine serving ``agent`` must hold (a fleet shared with another agent)."""
    record = [KeptAdapter(name=s.name, path=s.path, weight_version=s.version, checksum=s.proof.checksum if s.proof
                          else "", signature=s.proof.signature if s.proof else "") for s in kept]
    await redis.set(streams.engine_adapters(agent), KEPT_LIST.dump_json(record))


async def read_kept(redis: Any, streams: Streams, agents: list[str]) -> list[Served]:
    """The adapter versions the ``agents`` sharing a fleet need on every engine of it (a malformed record: none;
    Redis unreachable: ``RuntimeError``, so the fleet tries the engine's registration again)."""
    out: list[Served] = []
    for agent in agents:
        try:
            raw = await redis.get(streams.engine_adapters(agent))
        except RedisError as exc:
            raise RuntimeError(f"cannot read the adapters agent {agent} needs on the shared engines: {exc}") from exc
        try:
            kept = KEPT_LIST.validate_json(raw) if raw is not None else []
        except ValidationError as exc:
            log.warning("the adapters agent %s needs on the shared engines are unreadable: %s", agent, exc)
            continue
        out += [Served(k.name, k.path, k.weight_version, WeightsProof(k.checksum, k.signature)
                       if k.checksum and k.signature else None) for k in kept]
    return out
