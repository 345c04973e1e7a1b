"""Spawning a rollout's engines and router: cheap to import, so they start before the rollout's own imports.

docs/architecture.md §2.3 and §9. The engines are the slow start of a run (torch, transformers, the
model); ``services/rollout/__main__.py`` calls ``spawn_early`` with nothing but the config loaded, and
the engines import torch while the rollout imports its bus, its HTTP clients and its service.
``EngineFleet`` (fleet.py) adopts the spawned processes (ports, admin token) and waits for their health;
it spawns its restarts through ``spawn`` too. This module imports only the standard library, the config
contract and the command lines (commands.py, ``router_command``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from dataclasses import dataclass, field

from services.common.admin_token import ADMIN_TOKEN_ENV, new_token, token_from_env
from services.common.embedded_redis import free_port
from services.common.lifetime import die_with_parent
from services.common.sglang_router import router_command
from services.contracts.config import AgentConfig
from services.rollout.commands import engine_command

POLL_S = 0.02  # how often ``Proc.wait`` looks at an exiting child


class Proc:
    """A child process with the part of ``asyncio.subprocess.Process``'s surface the fleet uses; it needs no
    event loop to start (so the rollout spawns its engines before it builds one)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.terminate()

    async def wait(self) -> int:
        while (code := self.popen.poll()) is None:  # noqa: ASYNC110 (no event tells a Popen child's exit)
            await asyncio.sleep(POLL_S)
        return code


def spawn(cmd: list[str], token: str) -> Proc:
    """Start ``cmd`` with the run's admin token in its environment; it dies with this process (Linux)."""
    return Proc(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent(),
                                 env={**os.environ, ADMIN_TOKEN_ENV: token}))


@dataclass
class Spawned:
    """An agent's engines and router as started by ``spawn_early``, for ``EngineFleet`` to adopt."""

    token: str
    router_port: int
    engine_ports: list[int]
    router: Proc | None = None
    engines: list[Proc] = field(default_factory=list)


def plan(acfg: AgentConfig) -> Spawned:
    """The ports and admin token of an agent's fleet (the configured ports, else free ones), nothing started."""
    base = acfg.engine_base_port
    return Spawned(token=token_from_env() or new_token(), router_port=acfg.router_port or free_port(),
                   engine_ports=[base + i if base else free_port() for i in range(acfg.num_engines)])


def spawn_early(acfg: AgentConfig, agent: str, host: str = "127.0.0.1", shared_with: tuple[str, ...] = ()) -> Spawned:
    """Start the agent's engines (the slow ones first), then its router; return them to adopt. ``shared_with``:
    the agents whose rollouts share these engines (their signed adapters load on them too)."""
    s = plan(acfg)
    s.engines = [spawn(engine_command(acfg, agent, i, port, host, shared_with), s.token)
                 for i, port in enumerate(s.engine_ports)]
    s.router = spawn(router_command(s.router_port, [], host=host, admin_token=s.token), s.token)
    return s
