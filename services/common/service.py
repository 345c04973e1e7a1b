"""Service plumbing: CLI arguments, logging, signals, and the control stream.

Every service's ``main`` parses ``--config`` (and ``--agent`` where it is
per-agent) and ``--health-port``, builds a Bus, and runs its loops until
SIGTERM/SIGINT or a ``stop`` command on the control stream. With a health port
(``--health-port`` or ``TANDEM_HEALTH_PORT``; 0 = off) ``run_service`` also
serves ``GET /health`` for container health checks and Kubernetes probes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.common.bus import Bus
from services.common.health import HealthServer, health_port_from_env
from services.common.metrics import SERVICE_STARTS, record_start
from services.contracts.config import ConfigError, TandemConfig, load_config
from services.contracts.messages import Control


def setup_logging(name: str) -> logging.Logger:
    level = os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(f"tandem.{name}")


def parse_args(service: str, per_agent: bool, extra: Callable[[argparse.ArgumentParser], None] | None = None,
               argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"tandem-{service}")
    parser.add_argument("--config", required=True, help="experiment YAML")
    if per_agent:
        parser.add_argument("--agent", required=True, help="agent name from the config")
    parser.add_argument("--health-port", type=int, default=None,
                        help="serve GET /health on this port (default: $TANDEM_HEALTH_PORT, else 0 = off)")
    if extra:
        extra(parser)
    args = parser.parse_args(argv)
    if args.health_port is None:
        try:
            args.health_port = health_port_from_env()
        except ValueError as exc:
            parser.error(str(exc))
    elif not 0 <= args.health_port <= 65535:
        parser.error(f"--health-port {args.health_port} is outside 0..65535")
    global _health_port
    _health_port = args.health_port
    return args


T = TypeVar("T")
STOP_GRACE_S = 1.0  # at stop, how long loops get to end by themselves before they are cancelled
_health_port = 0  # set by parse_args: the services' main() passes it on to run_service implicitly


def load_or_exit(path: str, agent: str | None = None) -> TandemConfig:
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(2) from None
    if agent is not None and agent not in cfg.agents:
        print(f"--agent {agent!r} is not under agents in {path}", file=sys.stderr)
        raise SystemExit(2)
    if not cfg.redis_url:
        print("no redis_url: start services through `tandem up`, or set TANDEM_REDIS_URL", file=sys.stderr)
        raise SystemExit(2)
    return cfg


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def watch_control(bus: Bus, group: str, stop: asyncio.Event,
                        on_command: Callable[[Control], Awaitable[None]] | None = None,
                        stop_on_stop: bool = True) -> None:
    """Each service reads every control command through its own group."""

    async def handle(cmd: Control) -> None:
        if on_command is not None:
            await on_command(cmd)
        if cmd.command == "stop" and stop_on_stop:
            stop.set()

    await bus.consume(bus.streams.control, group, group, handle, stop, start="$")


async def serve_health_during(name: str, work: Callable[[], Awaitable[T]], health_port: int | None = None) -> T:
    """Serve ``GET /health`` (200) while ``work`` runs: for processes that run no service loops, such as
    the megatron follower ranks, whose pods still need to answer their probes."""
    port = _health_port if health_port is None else health_port
    health = HealthServer(name, lambda: (True, ""), port=port) if port else None
    if health is not None:
        await health.start()
    try:
        return await work()
    finally:
        if health is not None:
            await health.close()


async def run_service(name: str, bus: Bus, stop: asyncio.Event, *loops: Awaitable[None],
                      health_port: int | None = None, ready: Callable[[], tuple[bool, str]] | None = None) -> None:
    """Run the loops until ``stop`` is set, then cancel what is left and close the bus.

    ``health_port`` (default: what ``parse_args`` read; 0 = off) serves ``GET /health``:
    200 while every loop runs (and ``ready()``, if given, says ``(True, "")``; e.g. a
    rollout whose engines are up), 503 with the reason otherwise and once the service stops."""
    log = logging.getLogger(f"tandem.{name}")
    tasks: list[asyncio.Future] = []

    def status() -> tuple[bool, str]:
        if stop.is_set():
            return False, "stopping"
        ended = sum(t.done() for t in tasks)
        if ended:
            return False, f"{ended} of {len(tasks)} loops ended"
        return ready() if ready is not None else (True, "")

    port = _health_port if health_port is None else health_port
    if os.environ.get("LOCAL_RANK", "0") != "0":  # under torchrun one process per pod serves it
        port = 0
    health = HealthServer(name, status, port=port) if port else None
    if health is not None:
        try:
            await health.start()
        except OSError as exc:  # e.g. the port is taken: fail at start, naming it, with nothing left running
            for loop in loops:
                if asyncio.iscoroutine(loop):
                    loop.close()
            await bus.close()
            raise RuntimeError(f"cannot serve the health endpoint on port {port}: {exc}") from exc
        log.info("health endpoint on :%d/health", health.port)
    starts = bus.streams.key(SERVICE_STARTS)
    await bus.retrying("record its start", lambda: record_start(bus.redis, starts, bus.service))
    install_signal_handlers(stop)
    tasks.extend(asyncio.ensure_future(x) for x in loops)
    try:
        await _run_loops(log, bus, stop, tasks)
    finally:
        if health is not None:
            await health.close()


async def _run_loops(log: logging.Logger, bus: Bus, stop: asyncio.Event, tasks: list[asyncio.Future]) -> None:
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        if t is not stopper and t.exception() is not None:
            log.error("loop failed: %r", t.exception())
            stop.set()
            for other in tasks:
                other.cancel()
            await bus.close()
            raise t.exception()  # type: ignore[misc]
    stop.set()
    # loops that watch ``stop`` (the bus's consume loops: they acknowledge what they handled) end on their own;
    # the rest is cancelled after a grace period
    _, pending = await asyncio.wait(tasks, timeout=STOP_GRACE_S) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await bus.close()
    log.info("stopped")
