"""Rollout entry point: ``python -m services.rollout --config C --agent A [--router URL]``
(the service: rollout/service.py).

Start-up overlap (docs/architecture.md §9): before it imports its bus, HTTP clients and service, the
rollout loads the config and starts its engines and router (``spawn.spawn_early``), so they import
torch and load the model meanwhile. A config that does not load starts nothing here: the full path
below then reports it and exits 2, as every service does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.rollout.spawn import Spawned


def spawn_early(argv: list[str]) -> Spawned | None:
    """The agent's engines and router, started from nothing but the config (None with ``--router``, for an
    agent sharing another's engines, or a config or agent that does not load: the service's own checks then
    name the problem)."""
    parser = argparse.ArgumentParser(add_help=False)
    for flag in ("--config", "--agent", "--router"):
        parser.add_argument(flag, default=None)
    known, _ = parser.parse_known_args(argv)
    if known.router is not None or known.config is None:
        return None
    from services.common.weights_auth import secret_problem

    if secret_problem() is not None:  # the full path below names the missing secret and exits 2
        return None
    from services.common.admin_token import token_from_env
    from services.contracts.config import ConfigError, load_config
    from services.contracts.sharing import sharers
    from services.rollout.spawn import spawn_early as start

    try:
        cfg = load_config(known.config)
        token_from_env()  # a token file that does not read: the full path below names it and exits 2
    except ConfigError:
        return None
    if known.agent not in cfg.agents or not cfg.redis_url or cfg.agents[known.agent].share_engines_with:
        return None
    return start(cfg.agents[known.agent], known.agent, shared_with=tuple(sharers(cfg.agents, known.agent)))


async def main_async(config: str, agent: str, router_url: str | None, early: Spawned | None = None) -> int:
    from services.common.admin_token import token_from_env
    from services.common.bus import Bus
    from services.common.service import load_or_exit, run_service, setup_logging, watch_control
    from services.common.weights_auth import secret_problem
    from services.contracts.config import ConfigError
    from services.rollout.service import RolloutService, shared_router_url

    log = setup_logging(f"rollout.{agent}")
    cfg = load_or_exit(config, agent)
    if (no_secret := secret_problem()) is not None:  # it verifies what its engines load (weights_auth.py)
        log.error("%s", no_secret)
        return 2
    try:
        router_url = router_url or shared_router_url(cfg, agent)  # a fleet shared with another agent: its router
        token_from_env()  # $TANDEM_ADMIN_TOKEN_FILE names a file that does not read: said here, at start
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    bus = Bus(cfg.redis_url, cfg.run.name, f"rollout-{agent}", reconnect_window_s=cfg.run.done_ids_grace_s)
    s = bus.streams
    rollout = await RolloutService.start(cfg, agent, bus, router_url, early=early)
    stop = asyncio.Event()
    try:
        await run_service(
            f"rollout.{agent}", bus, stop,
            bus.consume(s.turns(agent), "rollout", bus.service, rollout.on_turn, stop,
                        concurrency=rollout.concurrency, count=64),
            bus.consume(s.weights(agent), "rollout", bus.service, rollout.on_weights, stop),
            watch_control(bus, f"control-rollout-{agent}", stop),
            *rollout.background(stop))
    finally:
        await rollout.close()
    return 0


def main() -> None:
    early = spawn_early(sys.argv[1:])
    from services.common.service import parse_args

    args = parse_args("rollout", per_agent=True, extra=lambda p: p.add_argument(
        "--router", default=None, help="an externally managed router's URL (then no engines are started here)"))
    raise SystemExit(asyncio.run(main_async(args.config, args.agent, args.router, early)))


if __name__ == "__main__":
    main()
